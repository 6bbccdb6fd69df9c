"""What the engine hands out: a RequestOutput per request per step, and the EngineStats totals.

RequestOutputs are built in one place (make_output), from a Sequence as it stands after the step:

    field                            comes from                           kept as
    text, finished, finish_reason    the text state and status            a copy (str, enum value)
    token_ids, logprobs, top_...     the sequence's append-only lists     the list + its length now
    prompt_logprobs, prompt_top_...  lists complete once the prompt is    the list (None until then)
                                     computed, never appended to again

so an output read later still shows its own step's view, and making one costs O(1) per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onecall.engine.sequence import Sequence
from onecall.engine.trace import RequestTrace
from onecall.errors import EngineStepError


@dataclass
class RequestOutput:
    """What a request produced so far. `text`/`token_ids` are cumulative; `delta_*` is this step's.

    `token_ids`, `logprobs` and `top_logprobs` are snapshots taken lazily: the output keeps a
    reference to the sequence's append-only lists and how long they were at this step, so making an
    output costs O(1) per token, and reading it later still gives this step's view.

    `prompt_logprobs` / `prompt_top_logprobs` (SamplingParams.prompt_logprobs): one entry per prompt
    token, the first None, on every output once the whole prompt is computed (None before, and
    when not asked for). `cumulative_logprob`: the sum of `logprobs` (None when not asked for).
    """

    request_id: str
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    trace: RequestTrace
    _all_token_ids: list[int] = field(repr=False)  # prompt + output, append-only
    _num_tokens: int = field(repr=False)  # its length at this step
    _logprobs: list[float | None] | None = field(default=None, repr=False)  # when asked for
    _top_logprobs: list[list[tuple[int, float]] | None] | None = field(default=None, repr=False)
    error: EngineStepError | None = None  # finish_reason "error": the step that ran it raised
    prompt_logprobs: list[float | None] | None = None  # complete lists only; never appended to
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    cumulative_logprob: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self._all_token_ids[self.num_prompt_tokens : self._num_tokens]

    @property
    def logprobs(self) -> list[float | None] | None:
        """Per output token, when asked for (SamplingParams.logprobs)."""
        n = self._num_tokens - self.num_prompt_tokens
        return None if self._logprobs is None else self._logprobs[:n]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        n = self._num_tokens - self.num_prompt_tokens
        return None if self._top_logprobs is None else self._top_logprobs[:n]


@dataclass
class EngineStats:
    """Counters for metrics; monotonically increasing totals plus current gauges."""

    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_prefix_cache_query_tokens_total: int = 0
    num_prefix_cache_hit_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0


def make_output(
    seq: Sequence, delta_text: str, delta_ids: list[int], error: EngineStepError | None = None
) -> RequestOutput:
    """`seq`'s output at this step; `delta_text` and `delta_ids` are what this step produced ("" and []
    for an abort or a failure), `error` the EngineStepError of a step that failed the request."""
    want_lp = seq.params.logprobs is not None
    ts = seq.text_state
    return RequestOutput(
        request_id=seq.request_id,
        text=ts.text if ts else "",
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        trace=seq.trace,
        _all_token_ids=seq.token_ids,
        _num_tokens=seq.num_tokens,
        _logprobs=seq.output_logprobs if want_lp else None,
        _top_logprobs=seq.output_top_logprobs if want_lp else None,
        error=error,
        prompt_logprobs=seq.prompt_logprobs if seq.has_prompt_logprobs else None,
        prompt_top_logprobs=seq.prompt_top_logprobs if seq.has_prompt_logprobs else None,
        cumulative_logprob=seq.cumulative_logprob if want_lp else None,
    )
