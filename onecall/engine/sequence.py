"""One request's state while the engine works on it.

The engine's unit of progress is the *computed token*: `token_ids` holds the
prompt followed by every sampled token, and `num_computed_tokens` counts those
whose K/V is in the cache. Each step a sequence feeds the next chunk
`token_ids[num_computed_tokens : num_computed_tokens + n]`; when that reaches
the end of `token_ids`, the step's logits at the last position give the next
token. Prefill, chunked prefill, decode and recompute after preemption are all
this one rule:

    state                         tokens fed this step           samples?
    fresh prompt (P tokens)       P - cached (or a chunk of it)  when chunk reaches P
    decoding                      1 (the last sampled token)     yes
    preempted, re-admitted        everything not cached again    when it catches up

A request with max_tokens 0 (scoring a prompt) never samples: it ends when its prompt is computed.

Prompt logprobs (params.prompt_logprobs). The logits at position p give the logprob of token
p + 1, so token t's entry needs position t - 1 to run through the model in some step: positions
the prefix cache supplies have no logits. `prompt_logprobs` holds the entries collected so far
(token 0's is None: nothing predicts it), in order, each exactly once:

    collected k entries (tokens 0 .. k-1)   next needed: token k, from position k - 1
    prefix cache may supply                 at most k - 1 positions (none for a fresh request)
    all P collected                         no limit (a preempted, decoding request reuses freely)

So such a request bypasses the prefix cache for its prompt rather than recomputing what it
reused; the KV it computes is still committed, for others to reuse. A chunk that recomputes
positions already collected (after a preemption) adds nothing for them.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import overload

import torch

from onecall.engine.trace import RequestTrace
from onecall.sampling.types import TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.text.detokenizer import IncrementalDetokenizer
from onecall.text.stop import StopStringMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or a finished grammar
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the step that ran it raised (RequestOutput.error says where and why)


@dataclass
class Sequence:
    seq_id: int  # engine-internal, used by the KV manager
    request_id: str  # caller's id
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (context window)
    trace: RequestTrace
    generator: torch.Generator | None = None
    constraint: TokenConstraint | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (what usage reports)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    is_admitted: bool = False  # KV manager knows it (begin() done, not freed since)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum of output_logprobs (when logprobs are asked for)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # see the module docstring
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    text_state: TextState | None = None  # set by the engine when a tokenizer is attached

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first token: nothing predicts it
            self.prompt_top_logprobs.append(None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def output_view(self) -> OutputTokens:
        """The output ids as a read-only view of token_ids (no copy; for the sampler's penalties)."""
        return OutputTokens(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still catching up on tokens it did not sample itself (prompt, or recompute)."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some prompt token still has none."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def has_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and every prompt token has its entry."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) == self.num_prompt_tokens

    @property
    def prefix_cache_tokens(self) -> list[int]:
        """The tokens the prefix cache may match at admission (it reuses at most len - 1 of them):
        all of token_ids, or at most k - 1 positions while prompt logprobs are being collected."""
        if not self.needs_prompt_logprobs:
            return self.token_ids
        k = len(self.prompt_logprobs)
        return self.token_ids[:k] if k > 1 else []  # reuse <= k - 1; [] matches nothing at all

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class OutputTokens(SequenceABC[int]):
    """token_ids[start:] without copying it: the output tokens of a sequence, read at use time."""

    __slots__ = ("_ids", "_start")

    def __init__(self, ids: list[int], start: int) -> None:
        self._ids, self._start = ids, start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._ids[self._start :][i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._ids[self._start + i]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._start, None)


@dataclass
class TextState:
    """Per-request text bookkeeping: incremental detokenizer, stop-string matcher, emitted text."""

    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    text: str = ""
