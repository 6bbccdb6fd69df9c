"""Request intake: what a caller sends (prompt, SamplingParams, maybe a constraint) -> a Sequence the
scheduler can take, or a typed error. Nothing here changes engine state, so a request refused here
leaves the engine exactly as it was.

    check                                         refused with
    params against the vocabulary (ids in range;  InvalidParameterError (SamplingParams.validate_vocab)
      min_tokens leaves a token to sample)
    prompt: str, token ids in the vocabulary,     InvalidParameterError("prompt", ...)
      or a RenderedPrompt; not empty
    prompt + max_tokens within max_model_len      ContextLengthExceededError
    structured_outputs compiles                   the grammar backend's typed error

The trace starts here too: the prompt (ids, text, which ids are control tokens), the resolved
request and, for a grammar, its compile record. The engine adds the running checks (dead, a
duplicate id) and queues the sequence (engine.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from onecall.engine.engine_parts import LoadedEngineParts
from onecall.engine.sequence import Sequence, TextState
from onecall.engine.trace import RequestTrace
from onecall.errors import ContextLengthExceededError, InvalidParameterError
from onecall.sampling.types import TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import RenderedPrompt
from onecall.text.detokenizer import IncrementalDetokenizer
from onecall.text.stop import StopStringMatcher

if TYPE_CHECKING:
    from onecall.sampling.grammar import GrammarBackend

Prompt = str | list[int] | RenderedPrompt


class RequestIntake:
    """Validates requests and builds their Sequences for one engine's model (seq ids unique to it)."""

    def __init__(self, parts: LoadedEngineParts, grammar: Callable[[], GrammarBackend]) -> None:
        """`grammar`: the engine's structured-outputs backend, built on first use (Engine.grammar)."""
        self._parts = parts
        self.tokenizer = parts.tokenizer
        self._grammar = grammar
        self._seq_ids = itertools.count()
        # the context window: the model's, capped by what the KV pool holds (the engine lowers it
        # when static decode steps take the pool's last block for padding)
        self.max_model_len = parts.max_model_len

    def new_sequence(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        constraint: TokenConstraint | None,
        arrival_time: float | None,
    ) -> Sequence:
        """A validated request as a Sequence with its trace, detokenizer and stop matcher; typed errors
        for anything the caller got wrong. `constraint` (any TokenConstraint) overrides the grammar."""
        parts = self._parts
        params.validate_vocab(self._parts.vocab_size, self.tokenizer.eos_token_ids)
        trace = RequestTrace(request_id=request_id, arrival_time=arrival_time or time.perf_counter())
        ids = self._prompt_ids(prompt, trace)
        check_length(len(ids), params.max_tokens, self.max_model_len)
        if constraint is None and params.structured_outputs is not None:
            grammar = self._grammar().new_constraint(params.structured_outputs)
            trace.record_grammar(grammar.trace)
            constraint = grammar
        trace.record_request(params.trace_dict(), str(parts.device), str(parts.dtype), parts.model_name)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=parts.device).manual_seed(params.seed % 2**64)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_total_tokens=self.max_model_len,
            trace=trace,
            generator=gen,
            constraint=constraint,
        )
        seq.text_state = TextState(
            # the prompt's last ids as context: a SentencePiece output's first token keeps its space
            IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, context=ids
            ),
            StopStringMatcher(params.stop) if params.stop else None,
        )
        return seq

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The token ids the engine runs for `prompt` (a str gets the tokenizer's BOS, if any);
        InvalidParameterError for an empty prompt, ids outside the vocabulary, or another type."""
        vocab_size = self._parts.vocab_size
        if isinstance(prompt, RenderedPrompt):
            ids = list(prompt.token_ids)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidParameterError(
                    "prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )
        else:
            raise InvalidParameterError(
                "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidParameterError("prompt", "is empty: at least one token is needed")
        return ids

    def _prompt_ids(self, prompt: Prompt, trace: RequestTrace) -> list[int]:
        ids = self.prompt_token_ids(prompt)
        special = self.tokenizer.special_ids
        if isinstance(prompt, RenderedPrompt):
            trace.record_prompt(ids, prompt.text, list(prompt.is_control))
        else:
            trace.record_prompt(ids, prompt if isinstance(prompt, str) else None, [i in special for i in ids])
        return ids


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt, and the prompt plus max_tokens, fit the context window (a prompt that fills it
    exactly fits only when nothing is to be generated)."""
    if num_prompt_tokens > max_model_len or (max_tokens > 0 and num_prompt_tokens == max_model_len):
        raise ContextLengthExceededError(num_prompt_tokens, max_model_len)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceededError(num_prompt_tokens, max_model_len, max_tokens)
