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
                onecall_e2e_request_latency_seconds

Sources: gauges are set from the engine after every step, add and abort; token counters advance
by the delta of EngineStats since the last update (so they never disagree with the engine); TTFT
and end-to-end latency come from each request's RequestTrace when it finishes (an aborted request
counts its TTFT if it got a first token, but no end-to-end latency); inter-token latency is the
wall time between consecutive outputs of one request, as a streaming client sees it. The restart
figures come from the supervisor (server/engine_loop.py) when it rebuilds the engine.

Each Metrics has its own CollectorRegistry (not the process-global one), so several servers or
tests in one process never collide. prometheus_client is thread-safe: render() may run on the
event loop while the engine thread updates. `_last_stats` and `_last_output_time` are touched by
the engine thread only.
"""

from __future__ import annotations

from dataclasses import replace

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

# EngineStats field -> the counter it advances (attribute names on Metrics).
_COUNTED_STATS = {
    "num_prompt_tokens_total": "prompt_tokens",
    "num_generation_tokens_total": "generation_tokens",
    "num_prefix_cache_query_tokens_total": "prefix_cache_query_tokens",
    "num_prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
    "num_preemptions_total": "preemptions",
}


class Metrics:
    """The onecall_* metrics in one registry; `render()` is the body of GET /metrics."""

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
        self._last_stats = EngineStats()
        self._last_output_time: dict[str, float] = {}  # request id -> when its last output came

    def update_engine(self, engine: Engine) -> None:
        """Gauges from the engine's state, counters by the EngineStats delta. Engine thread only."""
        self.requests_running.set(engine.num_running)
        self.requests_waiting.set(engine.num_waiting)
        self.kv_cache_usage.set(engine.block_manager.usage)
        stats = engine.stats
        for name, attr in _COUNTED_STATS.items():
            delta = getattr(stats, name) - getattr(self._last_stats, name)
            if delta > 0:
                getattr(self, attr).inc(delta)
        self._last_stats = replace(stats)  # a copy: the engine keeps mutating its own

    def observe_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Inter-token latency per output, and the per-request figures of those that finished."""
        for out in outputs:
            rid = out.request_id
            if out.delta_token_ids:
                last = self._last_output_time.get(rid)
                if last is not None:
                    self.inter_token_latency.observe(now - last)
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
        if trace.time_to_first_token is not None:
            self.time_to_first_token.observe(trace.time_to_first_token)
        if out.finish_reason == "abort":
            self.request_aborted.inc()
            return
        if out.finish_reason == "error":
            self.request_failed.inc()
            return
        if trace.e2e_time is not None:
            self.e2e_request_latency.observe(trace.e2e_time)
        self.request_success.labels(finish_reason=out.finish_reason or "unknown").inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
