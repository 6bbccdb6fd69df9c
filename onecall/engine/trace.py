"""The per-request trace: what happened to one call, stage by stage.

A RequestTrace is filled in as the request moves through render -> queue -> prefill (possibly in
chunks) -> decode steps -> finish, only through its record_* methods (the engine, the scheduler
and postprocess call them; none of them assigns a field), so what a stamp means is decided here.
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
    end_time: float | None = None  # perf_counter seconds when the step ended (its start: end - duration)
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
    # matched tokens recomputed anyway: the pool had no room to copy their blocks (block_manager.py)
    num_dropped_cache_tokens: int = 0
    # a hybrid model (a linear-attention state beside the KV: engine/state_slots.py): the KV match, and
    # the snapshot the state resumed from (= num_cached_tokens); None for other models. A hit shorter
    # than its KV match had no state snapshot between the two
    num_kv_matched_tokens: int | None = None
    state_resumed_at: int | None = None
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

    # ---- recording: the only writers of the fields above ----------------------------------------
    # The engine, the scheduler and postprocess say what happened; these methods decide what that
    # means for the record (first admission only, the first token only, ...).
    def record_request(self, sampling: dict[str, Any], device: str, dtype: str, model: str) -> None:
        self.sampling, self.device, self.dtype, self.model = sampling, device, dtype, model

    def record_grammar(self, grammar: GrammarTrace) -> None:
        """The request's grammar (its own GrammarTrace, which the constraint keeps up to date)."""
        self.grammar = grammar

    def record_prompt(self, ids: list[int], text: str | None, is_control: list[bool]) -> None:
        self.prompt_token_ids, self.prompt_text, self.prompt_is_control = ids, text, is_control

    def record_admission(
        self, num_cached: int, divergence: dict[str, int] | None, capped: bool, num_dropped: int = 0
    ) -> bool:
        """The scheduler admitted the request with this prefix-cache match (`num_dropped` matched
        tokens recomputed for lack of room). Only the first admission is the request's cache figure
        (a preempted request rejoins later on its own blocks); returns whether this was it."""
        if self.first_scheduled_time is not None:
            return False
        self.num_cached_tokens, self.divergence, self.cache_match_capped = num_cached, divergence, capped
        self.num_dropped_cache_tokens = num_dropped
        return True

    def record_state_resume(self, resumed_at: int, kv_matched: int) -> None:
        """A hybrid model's admission: its KV matched `kv_matched` tokens, its linear layers' state
        resumed from the snapshot after `resumed_at` of them (0: from scratch). First admission only."""
        if self.first_scheduled_time is None:
            self.state_resumed_at, self.num_kv_matched_tokens = resumed_at, kv_matched

    def record_scheduled(self, now: float) -> bool:
        """The request is in a step for the first time (True) or again (False)."""
        if self.first_scheduled_time is not None:
            return False
        self.first_scheduled_time = now
        return True

    def record_preemption(self) -> None:
        self.num_preemptions += 1

    def record_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def record_prefill_done(self, now: float) -> None:
        if self.prefill_done_time is None:
            self.prefill_done_time = now

    def record_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now

    def record_stop(self, reason: str | int) -> None:
        """The stop string or stop token id that ended the request."""
        self.stop_reason = reason

    def record_finish(self, reason: str, now: float) -> None:
        self.finish_reason, self.finish_time = reason, now

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
