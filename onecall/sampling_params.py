"""SamplingParams: the user-facing, validated knobs of one request.

Validation happens once, in `__post_init__`, and raises InvalidParameterError
naming the parameter and its allowed range. Everything downstream (sampler,
engine, server) may then trust the values. Defaults follow vLLM/OpenAI:
temperature 1.0, top_p 1.0, no top_k (0), no min_p, no penalties.

`StructuredOutputsParams` (SamplingParams.structured_outputs) says what the
output must match; its *shape* is checked here, and whether the schema, regex
or grammar compiles is checked by the engine's grammar backend at add_request.
"""

from __future__ import annotations

import hashlib
import json as _json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from onecall.errors import InvalidParameterError

MAX_LOGPROBS = 20
MAX_CACHE_SALT = 1024  # characters
# Per-request bounds on what every step of the batch pays for: stop strings are matched against each
# token's text on the engine thread, stop ids and logit_bias are walked per token.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
TRACE_LEVELS = ("basic", "full")
_SO = "structured_outputs"
_SO_KINDS = ("json", "json_object", "regex", "choice", "grammar")


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


def _check_count(name: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidParameterError(name, f"at most {limit} {what} are allowed, got {count}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of

        json         a JSON Schema, as a dict or a JSON string        -> JSON that validates
        json_object  True                                             -> any JSON object
        regex        a regular expression (Rust `regex` syntax)       -> a full match
        choice       a list of strings                                -> exactly one of them
        grammar      a Lark grammar, as llguidance reads it           -> a sentence of it

    `reasoning_end` (e.g. "</think>") defers the constraint for thinking
    templates: the model writes freely until its output contains that text,
    and the constraint applies from the next token on. With `reasoning_start`
    too (e.g. "<think>", one token of the vocabulary) the output may open its
    reasoning block with that token or skip it: any other first token starts
    the constrained output at once. Without it, the output is taken to start
    inside the block (the prompt opened it).

    `allow_additional_properties` (json only): False, the default, gives
    objects that leave additionalProperties unspecified no keys beyond their
    `properties` (as xgrammar and OpenAI's strict mode do; the output still
    validates against the schema as written: see sampling/json_schema.py).
    True keeps JSON Schema's default, where any extra key may follow.

    Each problem raises InvalidParameterError with param "structured_outputs.<field>".
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None  # stored as a tuple
    grammar: str | None = None
    reasoning_start: str | None = None
    reasoning_end: str | None = None
    allow_additional_properties: bool = False

    def __post_init__(self) -> None:
        # 1. exactly one kind
        given = [k for k in _SO_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise InvalidParameterError(_SO, f"set exactly one of {', '.join(_SO_KINDS)} (got {got})")
        # 2. the kind's own shape
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise InvalidParameterError(f"{_SO}.json", f"is not valid JSON: {e}") from e
            if not isinstance(schema, dict):
                raise InvalidParameterError(
                    f"{_SO}.json", f"must be a JSON Schema object, got {schema!r:.80}"
                )
        for name in ("json_object", "allow_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(
                    f"{_SO}.{name}", f"must be true or false, got {getattr(self, name)!r}"
                )
        for name in ("regex", "grammar", "reasoning_start", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(f"{_SO}.{name}", f"must be a non-empty string, got {value!r:.80}")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise InvalidParameterError(
                f"{_SO}.reasoning_start", "needs reasoning_end (where the block closes)"
            )
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise InvalidParameterError(f"{_SO}.choice", "must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in choice):
                raise InvalidParameterError(f"{_SO}.choice", "every choice must be a string")
            object.__setattr__(self, "choice", tuple(choice))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        """From a plain mapping such as {"json": {...}}; unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidParameterError(_SO, f"unknown field(s) {unknown}; expected {sorted(known)}")
        return cls(**d)

    @property
    def kind(self) -> str:
        """Which of json / json_object / regex / choice / grammar is set."""
        return next(k for k in _SO_KINDS if getattr(self, k) not in (None, False))

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The `json` schema as a dict (parsed when it was given as a string)."""
        if self.json is None:
            return None
        return _json.loads(self.json) if isinstance(self.json, str) else self.json


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. seed gives the
    request its own generator: the same seed gives the same tokens whatever
    else shares the batch. logprobs=N returns the chosen token's logprob and
    the N likeliest alternatives (0 <= N <= 20). trace_level "full" makes the
    sampler record, per generated token, the top candidates and the chosen
    token's rank after each of its stages (sampling/provenance.py); it never
    changes which token is chosen, and "basic" rows pay nothing for it.

    prompt_logprobs=N (vLLM's name) gives every prompt token its logprob and
    the N likeliest alternatives, from the model's raw logits (the first token
    gets None: nothing predicts it). Such a request computes its whole prompt:
    the prefix cache supplies none of it (engine/sequence.py). max_tokens=0
    ends a request once its prompt is computed, with no token sampled: with
    prompt_logprobs, a scoring request (what evaluation harnesses send).

    cache_salt (vLLM's name): requests share prefix-cache entries only with requests of the same
    salt (none shares with none), so one tenant cannot reuse, or time, another's cached prompts.
    The trace records a short hash of it, never the salt itself.
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
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    trace_level: str = "basic"  # "full": the trace records each token's logit provenance
    cache_salt: str | None = None
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
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(
                self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs)
            )

        # max_tokens 0 only scores a prompt: without prompt_logprobs it would return nothing at all
        _check_int("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1)
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
            _check_count("logit_bias", len(self.logit_bias), MAX_LOGIT_BIAS, "entries")
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias", tok, 0)
                _check_range("logit_bias", bias, -100.0, 100.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_count("stop", len(self.stop), MAX_STOP_STRINGS, "stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError("stop", f"each stop string must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidParameterError(
                    "stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        _check_count("stop_token_ids", len(self.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise InvalidParameterError(
                "cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT} characters"
            )
        if self.trace_level not in TRACE_LEVELS:
            raise InvalidParameterError(
                "trace_level", f"must be one of {', '.join(TRACE_LEVELS)}; got {self.trace_level!r}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidParameterError(
                _SO, f"must be StructuredOutputsParams or a dict, got {type(so).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_vocab(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """Check token ids against the model's vocabulary (known only once a model is loaded), and that
        min_tokens leaves something to sample: while it holds back EOS and the stop_token_ids, some
        other token must exist."""
        for tok in self.logit_bias or {}:
            if tok >= vocab_size:
                raise InvalidParameterError(
                    "logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})"
                )
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise InvalidParameterError(
                    "stop_token_ids", f"token id {tok} is outside the vocabulary [0, {vocab_size})"
                )
        if self.min_tokens > 0 and len({*self.stop_token_ids, *eos_token_ids}) >= vocab_size:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) holds back EOS and every stop_token_ids id, which together "
                f"are the whole vocabulary of {vocab_size} tokens: nothing could be generated",
            )

    def trace_dict(self) -> dict[str, object]:
        """The resolved settings, as the trace records them (no schema text: only its kind)."""
        d: dict[str, object] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "trace_level": self.trace_level,
        }
        if self.cache_salt is not None:  # which salt applied, without writing the secret itself
            d["cache_salt_sha256"] = hashlib.sha256(self.cache_salt.encode()).hexdigest()[:12]
        if self.logit_bias:
            d["logit_bias"] = dict(self.logit_bias)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.kind
        d["mode"] = "greedy" if self.is_greedy else "sample"
        return d
