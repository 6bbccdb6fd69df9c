"""Metrics: the Prometheus registry behind GET /metrics, updated from the engine thread.

    gauges      onecall_requests_running, onecall_requests_waiting,
                onecall_kv_cache_usage (0..1: blocks held by live sequences; cache-only blocks are free),
                onecall_engine_restarting (1 while the engine is rebuilt in place),
                onecall_engine_last_outage_seconds (how long the last restart kept it from serving),
                onecall_engine_last_restart_info{reason} (why it last stopped; one series, replaced)
    counters    onecall_prompt_tokens_total, onecall_generation_tokens_total,
                onecall_prefix_cache_query_tokens_total, onecall_prefix_cache_hit_tokens_total,
                onecall_preemptions_total, onecall_request_success_total{finish_reason},
                onecall_request_aborted_total, onecall_request_failed_total (a step that ran it raised,
                or the engine restarted under it), onecall_engine_restarts_total
    histograms  onecall_time_to_first_token_seconds, onecall_inter_token_latency_seconds,
                onecall_e2e_request_latency_seconds, onecall_request_queue_time_seconds (arrival to
                first scheduled), onecall_request_prefill_time_seconds (first scheduled to first token)

Sources: gauges are set from the engine after every step, add and abort; token counters advance
by the delta of EngineStats since the last update (so they never disagree with the engine); TTFT
and end-to-end latency come from each request's RequestTrace when it finishes (an aborted request
counts its TTFT if it got a first token, but no end-to-end latency); queue and prefill time are
observed with TTFT, from the same stamps, so per request queue + prefill = TTFT (a dashboard can
split TTFT into the two); inter-token latency is the wall time between consecutive outputs of one
request, as a streaming client sees it. The restart figures come from the supervisor
(server/engine_loop.py) when it rebuilds the engine.

vLLM's names beside them, for what already reads vLLM (KServe, llm-d's endpoint picker, the vLLM
production stack, published Grafana dashboards): each is fed by the same update as its onecall_*
twin, so the two never disagree; names, types, help texts, labels and buckets are vLLM's
(vllm/v1/metrics/loggers.py), every series labelled model_name (the served name) and engine ("0"):

    vllm:num_requests_running, vllm:num_requests_waiting          = onecall_requests_running, _waiting
    vllm:kv_cache_usage_perc (0..1, despite its name)             = onecall_kv_cache_usage
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total = onecall_prefix_cache_{query,hit}_tokens_total
    vllm:prompt_tokens_total, vllm:generation_tokens_total        = onecall_{prompt,generation}_tokens_total
    vllm:num_preemptions_total                                    = onecall_preemptions_total
    vllm:request_success_total{finished_reason}                   stop, length: = onecall_request_success_total;
                                                                  abort: = onecall_request_aborted_total;
                                                                  error: requests a failed step ended;
                                                                  repetition: vLLM's, always 0 here
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
    vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds
                                                                  the same observations as their onecall_*
                                                                  twins (equal _count and _sum), vLLM's buckets

The model_name label is bound once, before the engine thread starts (ServerState does it with the
served name); a Metrics driven without a server takes the engine's model name at its first update.

Each Metrics has its own CollectorRegistry (not the process-global one), so several servers or
tests in one process never collide. prometheus_client is thread-safe: render() may run on the
event loop while the engine thread updates. `_last_stats` and `_last_output_time` are touched by
the engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from onecall.engine.engine import Engine, EngineStats, RequestOutput

# Buckets from a fast GPU (milliseconds) to a busy CPU (tens of seconds).
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 240.0, 480.0, 960.0,
)  # fmt: skip

# vLLM's buckets (vllm/v1/metrics/loggers.py), kept as vLLM has them so its dashboards' quantiles agree.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"  # one engine per server: vLLM's label value for its first (only) engine core
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason

# EngineStats field -> the counter it advances (attribute names on Metrics and on _VllmSeries).
_COUNTED_STATS = {
    "num_prompt_tokens_total": "prompt_tokens",
    "num_generation_tokens_total": "generation_tokens",
    "num_prefix_cache_query_tokens_total": "prefix_cache_query_tokens",
    "num_prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
    "num_preemptions_total": "preemptions",
}


@dataclass(frozen=True)
class _VllmSeries:
    """vLLM's series: the labelled families (`create`), or their children for one model (`bind`).
    Attributes named as their onecall_* twins on Metrics; request_success stays the family (its
    finished_reason label is known only per request)."""

    requests_running: Gauge
    requests_waiting: Gauge
    kv_cache_usage: Gauge
    prefix_cache_query_tokens: Counter
    prefix_cache_hit_tokens: Counter
    preemptions: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    request_prefill_time: Histogram

    @classmethod
    def create(cls, r: CollectorRegistry) -> _VllmSeries:
        labels = VLLM_LABELS

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        return cls(
            requests_running=Gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                labels,
                registry=r,
            ),
            requests_waiting=Gauge(
                "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
            ),
            kv_cache_usage=Gauge(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
            ),
            prefix_cache_query_tokens=Counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                labels,
                registry=r,
            ),
            prefix_cache_hit_tokens=Counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                labels,
                registry=r,
            ),
            preemptions=Counter(
                "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
            ),
            prompt_tokens=Counter(
                "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
            ),
            generation_tokens=Counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
            ),
            request_success=Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                [*labels, "finished_reason"],
                registry=r,
            ),
            time_to_first_token=histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                VLLM_TTFT_BUCKETS,
            ),
            inter_token_latency=histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                VLLM_ITL_BUCKETS,
            ),
            e2e_request_latency=histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                VLLM_REQUEST_LATENCY_BUCKETS,
            ),
            request_queue_time=histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                VLLM_REQUEST_LATENCY_BUCKETS,
            ),
            request_prefill_time=histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                VLLM_REQUEST_LATENCY_BUCKETS,
            ),
        )

    def bind(self, model_name: str) -> _VllmSeries:
        """The children for `model_name` (every finished_reason shown at 0 from the start, as vLLM does)."""
        for reason in VLLM_FINISHED_REASONS:
            self.request_success.labels(model_name, VLLM_ENGINE, reason)
        children = {
            f.name: getattr(self, f.name).labels(model_name, VLLM_ENGINE)
            for f in fields(self)
            if f.name != "request_success"
        }
        return replace(self, **children)


class Metrics:
    """The onecall_* metrics and vLLM's twins in one registry; `render()` is the body of GET /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "onecall_requests_running", "Requests in the running batch.", registry=r
        )
        self.requests_waiting = Gauge(
            "onecall_requests_waiting", "Requests queued, not yet running.", registry=r
        )
        self.kv_cache_usage = Gauge(
            "onecall_kv_cache_usage", "Fraction of KV blocks held by live sequences (0 to 1).", registry=r
        )
        self.prompt_tokens = Counter(
            "onecall_prompt_tokens", "Prompt tokens of scheduled requests.", registry=r
        )
        self.generation_tokens = Counter("onecall_generation_tokens", "Tokens generated.", registry=r)
        self.prefix_cache_query_tokens = Counter(
            "onecall_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "onecall_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache.", registry=r
        )
        self.preemptions = Counter("onecall_preemptions", "Sequences preempted for KV space.", registry=r)
        self.request_success = Counter(
            "onecall_request_success", "Requests finished (stop or length).", ["finish_reason"], registry=r
        )
        self.request_aborted = Counter(
            "onecall_request_aborted", "Requests aborted (client gone, shutdown).", registry=r
        )
        self.request_failed = Counter(
            "onecall_request_failed", "Requests failed by an engine step that raised.", registry=r
        )
        self.time_to_first_token = Histogram(
            "onecall_time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "onecall_inter_token_latency_seconds",
            "Wall time between consecutive tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "onecall_e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS, registry=r
        )
        self.request_queue_time = Histogram(
            "onecall_request_queue_time_seconds",
            "Arrival to first scheduled (observed with TTFT: queue + prefill = TTFT).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.request_prefill_time = Histogram(
            "onecall_request_prefill_time_seconds",
            "First scheduled to first token (observed with TTFT: queue + prefill = TTFT).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.engine_restarts = Counter(
            "onecall_engine_restarts", "Times the stopped engine was rebuilt in place.", registry=r
        )
        self.engine_restarting = Gauge(
            "onecall_engine_restarting", "1 while the engine is rebuilt in place, else 0.", registry=r
        )
        self.engine_last_outage = Gauge(
            "onecall_engine_last_outage_seconds",
            "From the engine stopping to serving again, at the last restart.",
            registry=r,
        )
        self.engine_last_restart = Info(
            "onecall_engine_last_restart", "Why the engine last stopped and was restarted.", registry=r
        )
        self._vllm_families = _VllmSeries.create(r)
        self._vllm: _VllmSeries | None = None  # the children, once the model's name is bound
        self.model_name: str | None = None
        self._last_stats = EngineStats()
        self._last_output_time: dict[str, float] = {}  # request id -> when its last output came

    def bind_model(self, model_name: str) -> None:
        """The model_name label of the vllm: series; the first call decides (ServerState calls it with
        the served name before the engine thread starts), later ones are no-ops."""
        if self._vllm is None:
            self.model_name = model_name
            self._vllm = self._vllm_families.bind(model_name)

    def _vllm_series(self, fallback_name: str) -> _VllmSeries:
        if self._vllm is None:
            self.bind_model(fallback_name)
        assert self._vllm is not None
        return self._vllm

    def update_engine(self, engine: Engine) -> None:
        """Gauges from the engine's state, counters by the EngineStats delta. Engine thread only."""
        v = self._vllm_series(engine.parts.model_name)
        for series in (self, v):
            series.requests_running.set(engine.num_running)
            series.requests_waiting.set(engine.num_waiting)
            series.kv_cache_usage.set(engine.block_manager.usage)
        stats = engine.stats
        for name, attr in _COUNTED_STATS.items():
            delta = getattr(stats, name) - getattr(self._last_stats, name)
            if delta > 0:
                getattr(self, attr).inc(delta)
                getattr(v, attr).inc(delta)
        self._last_stats = replace(stats)  # a copy: the engine keeps mutating its own

    def observe_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Inter-token latency per output, and the per-request figures of those that finished."""
        for out in outputs:
            rid = out.request_id
            if out.delta_token_ids:
                last = self._last_output_time.get(rid)
                if last is not None:
                    self.inter_token_latency.observe(now - last)
                    self._vllm_series(out.trace.model).inter_token_latency.observe(now - last)
                self._last_output_time[rid] = now
            if out.finished:
                self._last_output_time.pop(rid, None)
                self._observe_finished(out)

    def observe_restart(
        self, outputs: list[RequestOutput], request_ids: list[str], reason: str, outage: float, now: float
    ) -> None:
        """The engine was rebuilt in place after stopping for `reason`, `outage` seconds without
        serving. Every request it cut off counts as failed: `request_ids`, the streams it failed;
        `outputs`, Engine.restart()'s, for those the engine still knew (the batch of the step that
        stopped it, it had dropped already)."""
        self.observe_outputs(outputs, now)
        known = {out.request_id for out in outputs}
        for rid in request_ids:
            self._last_output_time.pop(rid, None)
            if rid not in known:
                self.request_failed.inc()
        self.engine_restarts.inc()
        self.engine_last_outage.set(outage)
        self.engine_last_restart.info({"reason": reason[:300]})
        self.engine_restarting.set(0)

    def _observe_finished(self, out: RequestOutput) -> None:
        trace = out.trace
        v = self._vllm_series(trace.model)
        ttft, scheduled = trace.time_to_first_token, trace.first_scheduled_time
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            v.time_to_first_token.observe(ttft)
            if scheduled is not None and trace.first_token_time is not None:
                queue, prefill = scheduled - trace.arrival_time, trace.first_token_time - scheduled
                self.request_queue_time.observe(queue)
                v.request_queue_time.observe(queue)
                self.request_prefill_time.observe(prefill)
                v.request_prefill_time.observe(prefill)
        reason = out.finish_reason or "unknown"
        v.request_success.labels(self.model_name, VLLM_ENGINE, reason).inc()
        if reason == "abort":
            self.request_aborted.inc()
            return
        if reason == "error":
            self.request_failed.inc()
            return
        if trace.e2e_time is not None:
            self.e2e_request_latency.observe(trace.e2e_time)
            v.e2e_request_latency.observe(trace.e2e_time)
        self.request_success.labels(finish_reason=reason).inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
