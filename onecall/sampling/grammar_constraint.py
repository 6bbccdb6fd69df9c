"""GrammarConstraint: one request's llguidance matcher behind the sampler's TokenConstraint hook.

Per step, for a request with structured outputs:

    sampler: fill_bitmask(bitmask, row)  -> the matcher writes its allowed ids into the row
    engine:  advance(token)              -> the matcher consumes the token the engine appended
    engine:  is_finished()               -> the grammar is complete: the request stops ("stop")

EOS is allowed exactly when the grammar may end (llguidance puts the EOS ids in
the mask in an accepting state). When nothing can follow the output the matcher
is "stopped" and the request ends at once, without sampling an EOS.

Reasoning (thinking templates) defers the grammar. States, by what has been generated:

    state       the mask                              leaves it when
    PREAMBLE    the grammar's, plus reasoning_start   token 1 is reasoning_start -> REASONING,
                (only with reasoning_start set)       anything else (grammar-allowed) -> ACTIVE
    REASONING   none: the row is unconstrained        the output's bytes contain reasoning_end
                                                      (it may span tokens) -> ACTIVE, next token
    ACTIVE      the grammar's                         never (the request ends with the grammar)

Without reasoning_end a constraint starts ACTIVE; with reasoning_end alone it
starts in REASONING (the prompt already opened the block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance
    import torch


@dataclass
class GrammarTrace:
    """How a request's structured-output constraint was built and how it ran (RequestTrace.grammar).

    Per-step figures (num_allowed / num_masked / mask_time) live in the StepRecords;
    the seed's first step would read "2 allowed, 151,934 masked".
    """

    kind: str  # "json", "json_object", "regex", "choice" or "grammar"
    compile_time: float = 0.0  # seconds the grammar took to compile (on a cache hit: when it was compiled)
    cache_hit: bool = False  # the compiled grammar came from the backend's cache
    reasoning_start: str | None = None  # the output could open a reasoning block with this token
    reasoning_end: str | None = None  # the constraint waited for this text in the output
    activated_at: int | None = None  # output tokens before the grammar began to apply
    error: str | None = None  # the matcher failed mid-request (the request then stops)


class GrammarConstraint:
    """A TokenConstraint (sampling/types.py) over one llguidance matcher (states: module docstring)."""

    PREAMBLE, REASONING, ACTIVE = "preamble", "reasoning", "active"

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        token_bytes: Callable[[int], bytes],
        trace: GrammarTrace,
        reasoning_start_id: int | None = None,
    ) -> None:
        self._matcher = matcher
        self._num_words = (vocab_size + 31) // 32  # the matcher writes exactly this many int32 words
        self._token_bytes = token_bytes
        self.trace = trace
        self._start_id = reasoning_start_id
        self._marker = trace.reasoning_end.encode() if trace.reasoning_end else b""
        self._tail = b""  # while reasoning: the last len(marker) - 1 output bytes
        self._num_output_tokens = 0
        if not self._marker:
            self.state = self.ACTIVE
            trace.activated_at = 0
        else:
            self.state = self.PREAMBLE if reasoning_start_id is not None else self.REASONING

    @property
    def is_active(self) -> bool:
        """The grammar applies to the next token."""
        return self.state == self.ACTIVE

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.state == self.REASONING:
            return False
        assert bitmask.dtype.itemsize == 4 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        words = bitmask[row]
        assert words.numel() >= self._num_words, "bitmask narrower than the tokenizer's vocabulary"
        words[self._num_words :] = 0  # ids past the tokenizer (a padded model vocab) are never allowed
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._num_words * 4)
        self._note_error()  # an over-limit step leaves an EOS-only mask and an error
        if self.state == self.PREAMBLE:  # the model may also open its reasoning block
            assert self._start_id is not None
            word, bit = divmod(self._start_id, 32)
            words[word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign
        return True

    def advance(self, token_id: int) -> None:
        self._num_output_tokens += 1
        if self.state == self.PREAMBLE:
            if token_id == self._start_id:
                self.state = self.REASONING
                return
            self._activate(0)  # no reasoning block: this token was the grammar's first
        if self.state == self.REASONING:
            seen = self._tail + self._token_bytes(token_id)
            if self._marker in seen:
                self._activate(self._num_output_tokens)
            else:
                self._tail = seen[len(seen) - len(self._marker) + 1 :]
            return
        if not self._matcher.consume_token(token_id):
            self._note_error()

    def is_finished(self) -> bool:
        """Complete: nothing may follow (or the matcher failed; trace.error says why)."""
        return self.is_active and self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still go on)."""
        return self.is_active and self._matcher.is_accepting()

    def _activate(self, num_tokens_before: int) -> None:
        self.state = self.ACTIVE
        self.trace.activated_at = num_tokens_before

    def _note_error(self) -> None:
        if self.trace.error is None and self._matcher.is_error():
            self.trace.error = self._matcher.get_error()[:1000]
