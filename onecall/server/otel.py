"""OpenTelemetry export: each HTTP request's trace as OTLP spans (`onecall serve --otlp-traces-endpoint URL`).

One OtlpTraceExporter per server (ServerState makes it, only when the flag is given): a TracerProvider
of its own (never the process-global one) whose BatchSpanProcessor hands finished spans to the
OTLP/HTTP protobuf exporter on its own thread, so a request never waits on the collector; the
server's shutdown flushes it. The opentelemetry packages (the `otel` extra) are imported here, lazily:
a server without the flag never loads them.

What goes out for one HTTP request (chat, completions, responses; streamed or not), built when its
Generation closes (serving_common.py) from the same redacted dicts Generation.trace() returns
(a divergence read in the namespace tenants share has its cached token nulled there, so here too):

    "{gen_ai.operation.name} {model}"  SERVER    received by the route -> closed; a child of the
                                                 caller's span when a W3C `traceparent` came in
      "choice {i}"                     INTERNAL  one per engine request when there are several
                                                 (n > 1, best_of, a prompt batch); else the stages
                                                 hang from the request span itself
        "queue"                        INTERNAL  arrival -> first scheduled
        "prefill"                      INTERNAL  first scheduled -> prefill done; events:
                                                 prefix_cache.match (cached tokens, the divergence),
                                                 one prefill.chunk per chunk (tokens, seconds, batch)
        "decode"                       INTERNAL  prefill done -> finish: token count, step-time and
                                                 batch statistics (no span per token)
      events on the choice (or request) span: grammar (kind, compile time, cache hit);
      on its last stage: preempted (the trace counts preemptions but does not stamp them)

Attributes: the GenAI semantic conventions where they name the figure (gen_ai.operation.name,
gen_ai.request.model / temperature / top_p / top_k / max_tokens / seed / presence_penalty /
frequency_penalty / choice.count / stream, gen_ai.response.model / id / finish_reasons,
gen_ai.usage.input_tokens / output_tokens / cache_read.input_tokens: the response's usage), and
onecall.* for the rest. Times: the trace's stamps are time.perf_counter() seconds, turned into epoch
nanoseconds with one offset taken at export. A prefill chunk's event is stamped at its step's end
(StepRecord.end_time). No prompt or output text goes out, only counts and the divergence's two tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onecall.errors import InvalidParameterError
from onecall.server.protocol import Usage

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

logger = logging.getLogger("onecall.server")

TraceDict = dict[str, Any]  # one engine request's trace as Generation.trace_dicts() gives it
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
MAX_CHUNK_EVENTS = 100  # prefill.chunk events per span (the SDK keeps 128 events a span)


def require_sdk() -> None:
    """Raise InvalidParameterError unless the SDK and the OTLP/HTTP exporter can be imported."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise InvalidParameterError(
            "otlp_traces_endpoint",
            f"needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http ({e}): "
            "pip install -e '.[otel]'",
        ) from None


def check_endpoint(endpoint: str) -> None:
    if not endpoint.startswith(("http://", "https://")):
        raise InvalidParameterError(
            "otlp_traces_endpoint",
            f"must be an http:// or https:// URL (OTLP over HTTP), e.g. http://localhost:4318/v1/traces; "
            f"got {endpoint!r}",
        )


@dataclass(frozen=True)
class SpanRequest:
    """What the route knows of one HTTP request, for its span."""

    operation: str  # gen_ai.operation.name: "chat" or "text_completion"
    model: str  # the served name: request and response model (check_model made them one)
    response_id: str  # gen_ai.response.id: chatcmpl-..., cmpl-..., resp_...
    path: str  # url.path
    stream: bool
    n: int  # choices asked for per prompt
    received: float | None  # perf_counter when the route got the request; None: the first arrival
    carrier: Mapping[str, str]  # the W3C trace context headers as received
    tenant: str | None = None


class OtlpTraceExporter:
    """The server's exporter: `spans(request)` binds one HTTP request to it; `shutdown()` flushes."""

    def __init__(self, endpoint: str) -> None:
        check_endpoint(endpoint)
        require_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        )
        resource = Resource.create({} if named else {"service.name": "onecall"})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("onecall.server")
        self._propagator = TraceContextTextMapPropagator()

    def spans(self, request: SpanRequest) -> RequestSpans:
        return RequestSpans(self, request)

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocks up to the exporter's timeout)."""
        self._provider.shutdown()

    def export(
        self, req: SpanRequest, traces: Sequence[TraceDict | None], usage: Usage | None, closed_at: float
    ) -> None:
        """The spans of one HTTP request: `traces` one per engine request (None: none of its outputs
        was read: the client left before),
        `usage` as the response counted it, `closed_at` when the generation closed (perf_counter)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        clock = _Clock()
        done = [t for t in traces if t is not None]
        starts = [t["arrival_time"] for t in done] + ([req.received] if req.received is not None else [])
        start = min(starts, default=closed_at)
        end = max([closed_at] + [t["finish_time"] for t in done if t["finish_time"] is not None])
        root = self._tracer.start_span(
            f"{req.operation} {req.model}",
            context=self._propagator.extract(req.carrier),
            kind=SpanKind.SERVER,
            start_time=clock.ns(start),
            attributes=_request_attributes(req, traces, usage),
        )
        if len(traces) == 1 and traces[0] is not None:
            root.set_attributes(_choice_attributes(traces[0]))
            self._stages(root, set_span_in_context(root), traces[0], clock, end)
        elif len(traces) > 1:
            root_context = set_span_in_context(root)
            for i, t in enumerate(traces):
                choice_start = t["arrival_time"] if t is not None else start
                choice_end = (t["finish_time"] if t is not None else None) or end
                choice = self._tracer.start_span(
                    f"choice {i}",
                    context=root_context,
                    start_time=clock.ns(choice_start),
                    attributes={"onecall.choice.index": i, **(_choice_attributes(t) if t else {})},
                )
                if t is None:
                    choice.set_status(Status(StatusCode.ERROR, "did not finish: the client left"))
                else:
                    self._stages(choice, set_span_in_context(choice), t, clock, choice_end)
                choice.end(end_time=clock.ns(choice_end))
        if len(done) < len(traces):
            root.set_status(Status(StatusCode.ERROR, "a choice did not finish: the client left"))
        elif any(t["finish_reason"] == "error" for t in done):
            root.set_status(Status(StatusCode.ERROR, "an engine step that ran it failed"))
        root.end(end_time=clock.ns(end))

    def _stages(self, parent: Span, context: Context, t: TraceDict, clock: _Clock, end: float) -> None:
        """queue, prefill, decode under `parent` (whose context is `context`), and its events."""
        arrival, scheduled = t["arrival_time"], t["first_scheduled_time"]
        prefill_done, finish = t["prefill_done_time"], t["finish_time"] or end
        grammar = t.get("grammar")
        if grammar:
            parent.add_event("grammar", _grammar_attributes(grammar), timestamp=clock.ns(arrival))
        queue = self._tracer.start_span(
            "queue",
            context=context,
            start_time=clock.ns(arrival),
            attributes={"onecall.scheduled": scheduled is not None},
        )
        queue.end(end_time=clock.ns(scheduled if scheduled is not None else finish))
        if scheduled is None:
            return
        steps: list[dict[str, Any]] = t["steps"]
        first_decode = next((k for k, s in enumerate(steps) if s["kind"] == "decode"), len(steps))
        chunks = [s for s in steps[:first_decode] if s["kind"] == "prefill"]
        prefill_end = prefill_done if prefill_done is not None else finish
        prefill = self._tracer.start_span(
            "prefill",
            context=context,
            start_time=clock.ns(scheduled),
            attributes={
                "onecall.prompt_tokens": t["num_prompt_tokens"],
                "onecall.cached_tokens": t["num_cached_tokens"],
                "onecall.prefill.tokens": sum(s["num_tokens"] for s in chunks),
                "onecall.prefill.chunks": len(chunks),
                "onecall.prefill.compute_seconds": sum(s["duration"] for s in chunks),
            },
        )
        prefill.add_event("prefix_cache.match", _cache_match_attributes(t), timestamp=clock.ns(scheduled))
        elapsed = scheduled
        for s in chunks[:MAX_CHUNK_EVENTS]:
            elapsed += s["duration"]
            at = s.get("end_time") or min(elapsed, prefill_end)  # a trace from before end_time: estimated
            prefill.add_event("prefill.chunk", _step_attributes(s), timestamp=clock.ns(at))
        last: Span = prefill
        if prefill_done is None:
            last_end = prefill_end
        else:
            prefill.end(end_time=clock.ns(prefill_end))
            rest = steps[first_decode:]
            last = self._tracer.start_span(
                "decode",
                context=context,
                start_time=clock.ns(prefill_done),
                attributes=_decode_attributes(
                    [s for s in rest if s["kind"] == "decode"], [s for s in rest if s["kind"] == "prefill"]
                ),
            )
            last_end = finish
        if t["num_preemptions"]:
            last.add_event(
                "preempted", {"onecall.num_preemptions": t["num_preemptions"]}, timestamp=clock.ns(last_end)
            )
        last.end(end_time=clock.ns(last_end))


@dataclass(frozen=True)
class RequestSpans:
    """One HTTP request bound to the server's exporter; Generation calls `export` once, when it closes."""

    exporter: OtlpTraceExporter
    request: SpanRequest

    def export(self, traces: Sequence[TraceDict | None], usage: Usage | None, closed_at: float) -> None:
        self.exporter.export(self.request, traces, usage, closed_at)


class _Clock:
    """perf_counter seconds -> epoch nanoseconds, by one offset taken now."""

    def __init__(self) -> None:
        self.offset = time.time_ns() - time.perf_counter_ns()

    def ns(self, t: float) -> int:
        return round(t * 1e9) + self.offset


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OTel attributes take no None."""
    return {k: v for k, v in attributes.items() if v is not None}


def _request_attributes(
    req: SpanRequest, traces: Sequence[TraceDict | None], usage: Usage | None
) -> dict[str, Any]:
    done = [t for t in traces if t is not None]
    sampling: dict[str, Any] = done[0]["sampling"] if done else {}
    a: dict[str, Any] = {
        "gen_ai.operation.name": req.operation,
        "gen_ai.request.model": req.model,
        "gen_ai.response.model": req.model,
        "gen_ai.response.id": req.response_id,
        "gen_ai.request.stream": req.stream,
        "gen_ai.request.temperature": sampling.get("temperature"),
        "gen_ai.request.top_p": sampling.get("top_p"),
        "gen_ai.request.top_k": sampling.get("top_k"),
        "gen_ai.request.max_tokens": sampling.get("max_tokens"),
        "gen_ai.request.seed": sampling.get("seed"),
        "gen_ai.request.presence_penalty": sampling.get("presence_penalty"),
        "gen_ai.request.frequency_penalty": sampling.get("frequency_penalty"),
        "gen_ai.request.choice.count": req.n if req.n != 1 else None,
        "http.request.method": "POST",
        "url.path": req.path,
        "onecall.tenant": req.tenant,
        "onecall.engine_requests": len(traces),
    }
    if done:
        a["gen_ai.response.finish_reasons"] = [t["finish_reason"] or "unknown" for t in done]
        a["onecall.num_preemptions"] = sum(t["num_preemptions"] for t in done)
    if usage is not None:
        a["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        a["gen_ai.usage.output_tokens"] = usage.completion_tokens
        a["gen_ai.usage.cache_read.input_tokens"] = usage.prompt_tokens_details.cached_tokens
    return _clean(a)


def _choice_attributes(t: TraceDict) -> dict[str, Any]:
    stop = t.get("stop_reason")
    return _clean(
        {
            "onecall.request_id": t["request_id"],
            "onecall.finish_reason": t["finish_reason"],
            "onecall.stop_reason": str(stop) if stop is not None else None,
            "onecall.prompt_tokens": t["num_prompt_tokens"],
            "onecall.cached_tokens": t["num_cached_tokens"],
            "onecall.prefilled_tokens": t["num_prefilled_tokens"],
            "onecall.output_tokens": t["num_output_tokens"],
            "onecall.num_preemptions": t["num_preemptions"],
            "onecall.queue_seconds": t["queue_time"],
            "onecall.time_to_first_token_seconds": t["time_to_first_token"],
            "onecall.e2e_seconds": t["e2e_time"],
            "onecall.device": t.get("device") or None,
            "onecall.dtype": t.get("dtype") or None,
            "onecall.trace_level": t["sampling"].get("trace_level"),
        }
    )


def _cache_match_attributes(t: TraceDict) -> dict[str, Any]:
    a: dict[str, Any] = {
        "onecall.cached_tokens": t["num_cached_tokens"],
        "onecall.prompt_tokens": t["num_prompt_tokens"],
        "onecall.cache_match_capped": t["cache_match_capped"],
        "onecall.dropped_cache_tokens": t["num_dropped_cache_tokens"],
        "onecall.kv_matched_tokens": t.get("num_kv_matched_tokens"),
        "onecall.state_resumed_at": t.get("state_resumed_at"),
        "onecall.cache_salt_sha256": t["sampling"].get("cache_salt_sha256"),
    }
    divergence = t.get("divergence")
    if divergence:  # redacted already (Generation.trace_dicts): a shared namespace's cached side is null
        for key in ("index", "prompt_token", "prompt_token_text", "cached_token", "cached_token_text"):
            a[f"onecall.divergence.{key}"] = divergence.get(key)
    return _clean(a)


def _step_attributes(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "onecall.step": s["step"],
        "onecall.tokens": s["num_tokens"],
        "onecall.duration_seconds": s["duration"],
        "onecall.batch_size": s["batch_size"],
        "onecall.batch_tokens": s["num_batched_tokens"],
    }


def _decode_attributes(decode: list[dict[str, Any]], recomputed: list[dict[str, Any]]) -> dict[str, Any]:
    durations = [s["duration"] for s in decode]
    total = sum(durations)
    a: dict[str, Any] = {
        "onecall.decode.steps": len(decode),
        "onecall.decode.tokens": sum(1 for s in decode if s["token_id"] is not None),
        "onecall.decode.compute_seconds": total,
        "onecall.decode.recomputed_tokens": sum(s["num_tokens"] for s in recomputed),
    }
    if durations:
        a["onecall.decode.step_seconds.mean"] = total / len(durations)
        a["onecall.decode.step_seconds.min"] = min(durations)
        a["onecall.decode.step_seconds.max"] = max(durations)
        a["onecall.decode.batch_size.mean"] = sum(s["batch_size"] for s in decode) / len(decode)
        a["onecall.decode.batch_size.max"] = max(s["batch_size"] for s in decode)
        if total > 0:
            a["onecall.decode.tokens_per_second"] = len(decode) / total
    mask = sum(s["mask_time"] for s in decode)
    if mask > 0:
        a["onecall.decode.grammar_mask_seconds"] = mask
    return a


def _grammar_attributes(g: dict[str, Any]) -> dict[str, Any]:
    return _clean(
        {
            "onecall.grammar.kind": g.get("kind"),
            "onecall.grammar.compile_seconds": g.get("compile_time"),
            "onecall.grammar.cache_hit": g.get("cache_hit"),
            "onecall.grammar.activated_at": g.get("activated_at"),
            "onecall.grammar.error": g.get("error"),
        }
    )
