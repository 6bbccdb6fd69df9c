"""The per-request trace: what happened to one call, stage by stage.

A RequestTrace is filled in by the engine as the request moves through
render -> queue -> prefill (possibly in chunks) -> decode steps -> finish.
Times are `time.perf_counter()` seconds; derived figures (queue time, TTFT,
tokens/s) are properties so they can never disagree with the raw stamps.
`to_dict()` is the machine-readable form (CLI --json, the server's "trace").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from onecall.sampling.grammar_constraint import GrammarTrace


@dataclass
class StepRecord:
    """One engine step as this request saw it."""

    step: int  # engine step counter
    kind: str  # "prefill" (a prompt chunk) or "decode"
    num_tokens: int  # tokens of this request in the step
    batch_size: int  # sequences in the step
    num_batched_tokens: int  # tokens in the whole step
    duration: float  # seconds for the whole step (forward + sampling)
    token_id: int | None = None  # the token sampled at the end of the step, if any
    num_masked: int = 0  # tokens a constraint/ban set to -inf before sampling
    num_allowed: int | None = None  # tokens a grammar left allowed (None: unconstrained step)
    mask_time: float = 0.0  # seconds spent on this request's grammar mask in the step
    # trace_level "full": TokenProvenance.to_dict() of the sampled token (sampling/provenance.py)
    provenance: dict[str, Any] | None = None


@dataclass
class RequestTrace:
    request_id: str
    # 1. the rendered prompt
    prompt_text: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_is_control: list[bool] = field(default_factory=list)
    # 2. prefix cache
    num_cached_tokens: int = 0
    divergence: dict[str, int] | None = None  # {"index", "prompt_token", "cached_token"} or None
    cache_match_capped: bool = False  # the whole prompt was cached; the last token is recomputed
    # 3. timestamps (perf_counter seconds)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    prefill_done_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # 4. per-step records and counters
    steps: list[StepRecord] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    sampling: dict[str, Any] = field(default_factory=dict)
    grammar: GrammarTrace | None = None  # structured outputs: compile and activation
    device: str = ""
    dtype: str = ""
    model: str = ""

    # ---- derived -----------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefilled_tokens(self) -> int:
        """Prompt tokens the model actually computed (prompt minus cache hits, plus recompute)."""
        return sum(s.num_tokens for s in self.steps if s.kind == "prefill")

    @property
    def num_output_tokens(self) -> int:
        return sum(1 for s in self.steps if s.token_id is not None)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float:
        return sum(s.duration for s in self.steps if s.kind == "prefill")

    @property
    def decode_time(self) -> float:
        return sum(s.duration for s in self.steps if s.kind == "decode")

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_tokens_per_s(self) -> float | None:
        t = self.prefill_time
        return self.num_prefilled_tokens / t if t > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = sum(1 for s in self.steps if s.kind == "decode")
        t = self.decode_time
        return n / t if t > 0 else None

    @property
    def mask_time(self) -> float:
        """Seconds spent on this request's grammar masks over all steps."""
        return sum(s.mask_time for s in self.steps)

    @property
    def e2e_time(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in (
            "num_prompt_tokens",
            "num_prefilled_tokens",
            "num_output_tokens",
            "queue_time",
            "prefill_time",
            "decode_time",
            "time_to_first_token",
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "mask_time",
            "e2e_time",
        ):
            d[name] = getattr(self, name)
        return d
