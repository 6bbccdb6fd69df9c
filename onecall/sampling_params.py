"""SamplingParams: the user-facing, validated knobs of one request.

Validation happens once, in `__post_init__`, and raises InvalidParameterError
naming the parameter and its allowed range. Everything downstream (sampler,
engine, server) may then trust the values. Defaults follow vLLM/OpenAI:
temperature 1.0, top_p 1.0, no top_k (0), no min_p, no penalties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from onecall.errors import InvalidParameterError

MAX_LOGPROBS = 20


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    ok_lo = value > lo if lo_open else value >= lo
    if not ok_lo or value > hi:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise InvalidParameterError(name, f"must be in {lo_s}, {hi}], got {value}")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidParameterError(name, f"must be {rng}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. seed gives the
    request its own generator: the same seed gives the same tokens whatever
    else shares the batch. logprobs=N returns the chosen token's logprob and
    the N likeliest alternatives (0 <= N <= 20).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Accept lists/strings for convenience; store tuples so the object stays hashable-ish.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

        _check_int("max_tokens", self.max_tokens, 1)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError("logit_bias", "must be a mapping of token id to bias")
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias", tok, 0)
                _check_range("logit_bias", bias, -100.0, 100.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError("stop", f"each stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary (known only once a model is loaded)."""
        for tok in (self.logit_bias or {}):
            if tok >= vocab_size:
                raise InvalidParameterError("logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise InvalidParameterError("stop_token_ids", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
