"""OTLP trace export (`onecall serve --otlp-traces-endpoint`, server/otel.py) against a real receiver.

A small OTLP/HTTP receiver runs in a thread (POST /v1/traces, bodies decoded with opentelemetry-proto's
ExportTraceServiceRequest); the server runs in process over the tiny engine with the receiver as its
endpoint, and its shutdown flushes the batch processor. What the exporter really sent is checked:

1. a chat completion with a W3C `traceparent`: its request span is a child of the caller's span in
   the caller's trace; queue, prefill and decode are children of the request span, in time order;
   the GenAI attributes carry the response's usage; a second request with the same prompt shows the
   cache match (its cached tokens) and a diverging prompt shows where the match broke;
2. every route exports, streamed or not: completions (n = 2: one choice span each, a prompt batch),
   a streamed chat (no traceparent: a root span), the Responses API;
3. a divergence read in the namespace tenants share goes out as Generation.trace() shows it: the
   cached side is missing;
4. a server without the flag never imports the SDK; a bad endpoint is refused; the CLI flag reaches
   the server's config; a real `onecall serve` with the flag sends its spans by the time it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from onecall.errors import InvalidParameterError
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from onecall.server.tenants import Tenant
from tests.helpers.server_process import ServerProcess
from tests.helpers.tiny_engine import tiny_engine

ROOT = Path(__file__).resolve().parents[2]
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
SERVER, INTERNAL = 2, 1  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
SECRET = "The vault PIN is 4711. Keep it safe."
PROBE = "The vault PIN is 0"  # SECRET's prefix, then another digit: the cache match breaks there


# ---- the receiver -------------------------------------------------------------------------------------
def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces endpoint on a free loopback port; `spans` is every span received, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        self.posts += 1
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append({
                        "name": s.name,
                        "kind": s.kind,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "events": [
                            {"name": e.name, "time": e.time_unix_nano,
                             "attributes": {a.key: _value(a.value) for a in e.attributes}}
                            for e in s.events
                        ],
                        "resource": resource,
                    })  # fmt: skip

    def request_span(self, response_id: str) -> dict[str, Any]:
        (span,) = [s for s in self.spans if s["attributes"].get("gen_ai.response.id") == response_id]
        return span

    def children(self, span: dict[str, Any]) -> dict[str, dict[str, Any]]:
        found = [
            s for s in self.spans if s["parent"] == span["span_id"] and s["trace_id"] == span["trace_id"]
        ]
        by_name = {s["name"]: s for s in found}
        assert len(by_name) == len(found), [s["name"] for s in found]
        return by_name

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def _serve(config: ServerConfig, test: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """Run `test` against the app in process; leaving the lifespan flushes the exporter."""

    async def main() -> None:
        app = create_app(AsyncEngine(tiny_engine()), config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall", timeout=60) as http:
                await asyncio.wait_for(test(http), timeout=120)

    asyncio.run(main())


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = await http.post(path, json={"model": "tiny", "temperature": 0, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _check_stages(receiver: Receiver, parent: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
    """queue -> prefill -> decode under `parent`, in time order within it; returns the stages."""
    stages = receiver.children(parent)
    assert set(stages) == {"queue", "prefill", "decode"}, set(stages)
    queue, prefill, decode = stages["queue"], stages["prefill"], stages["decode"]
    assert all(s["kind"] == INTERNAL and s["trace_id"] == parent["trace_id"] for s in stages.values())
    assert parent["start"] <= queue["start"] <= queue["end"] == prefill["start"] <= prefill["end"]
    assert prefill["end"] == decode["start"] <= decode["end"] <= parent["end"]
    # the first token comes with the last prefill chunk; decode made the rest, no span per token
    assert decode["attributes"]["onecall.decode.tokens"] == completion_tokens - 1
    assert decode["attributes"]["onecall.decode.steps"] == completion_tokens - 1
    chunks = [e for e in prefill["events"] if e["name"] == "prefill.chunk"]
    assert (
        chunks
        and sum(e["attributes"]["onecall.tokens"] for e in chunks)
        == (prefill["attributes"]["onecall.prefill.tokens"])
    )
    assert all(prefill["start"] <= e["time"] <= prefill["end"] for e in chunks)
    return stages


def _cache_match(stages: dict[str, Any]) -> dict[str, Any]:
    (event,) = [e for e in stages["prefill"]["events"] if e["name"] == "prefix_cache.match"]
    return dict(event["attributes"])


# ---- 1. one chat completion, its stages, the cache --------------------------------------------------
def test_a_chat_completion_joins_the_callers_trace_with_its_stages(receiver: Receiver) -> None:
    responses: list[dict[str, Any]] = []

    async def test(http: httpx.AsyncClient) -> None:
        body = {"messages": MESSAGES, "max_tokens": 5, "top_p": 0.9}
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            responses.append(await _post(http, "/v1/chat/completions", body, traceparent=TRACEPARENT))
        await _post(http, "/v1/completions", {"prompt": SECRET, "max_tokens": 1})
        responses.append(await _post(http, "/v1/completions", {"prompt": PROBE, "max_tokens": 2}))

    _serve(ServerConfig(served_model_name="tiny", otlp_traces_endpoint=receiver.url), test)
    first, second, probe = responses
    assert receiver.posts >= 1
    for r in (first, second):
        span = receiver.request_span(r["id"])
        assert span["name"] == "chat tiny" and span["kind"] == SERVER
        assert span["trace_id"] == CALLER_TRACE and span["parent"] == CALLER_SPAN  # the caller's tree
        assert span["resource"]["service.name"] == "onecall"
        a, usage = span["attributes"], r["usage"]
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
        assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert a["gen_ai.response.finish_reasons"] == [r["choices"][0]["finish_reason"]]
        assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.max_tokens"] == 5
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9) and a["gen_ai.request.stream"] is False
        assert a["url.path"] == "/v1/chat/completions" and a["onecall.output_tokens"] == 5
        stages = _check_stages(receiver, span, 5)
        match = _cache_match(stages)
        assert match["onecall.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert match["onecall.prompt_tokens"] == usage["prompt_tokens"]
    first_match = _cache_match(_check_stages(receiver, receiver.request_span(first["id"]), 5))
    second_match = _cache_match(_check_stages(receiver, receiver.request_span(second["id"]), 5))
    assert first_match["onecall.cached_tokens"] == 0
    assert (
        second_match["onecall.cached_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    # a prompt that leaves the cache: where and on which tokens, as the trace tells it
    span = receiver.request_span(probe["id"])
    assert span["name"] == "text_completion tiny" and span["parent"] == ""  # no traceparent: a root
    match = _cache_match(_check_stages(receiver, span, 2))
    assert match["onecall.cached_tokens"] == probe["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert match["onecall.divergence.index"] == match["onecall.cached_tokens"]
    assert match["onecall.divergence.prompt_token_text"] == "0"
    assert match["onecall.divergence.cached_token_text"] == "4"


# ---- 2. every route, streamed or not, n > 1 ---------------------------------------------------------
def test_every_route_exports_streamed_or_not(receiver: Receiver) -> None:
    ids: dict[str, tuple[str, dict[str, Any]]] = {}

    async def test(http: httpx.AsyncClient) -> None:
        r = await _post(http, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, "n": 2, "seed": 1,
                                                  "temperature": 0.7})  # fmt: skip
        ids["n2"] = (r["id"], r["usage"])
        r = await _post(http, "/v1/completions", {"prompt": ["One", "Two three"], "max_tokens": 2})
        ids["batch"] = (r["id"], r["usage"])
        r = await _post(http, "/v1/responses", {"input": "Hello", "max_output_tokens": 3})
        usage = {
            "prompt_tokens": r["usage"]["input_tokens"],
            "completion_tokens": r["usage"]["output_tokens"],
        }
        ids["responses"] = (r["id"], usage)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with http.stream("POST", "/v1/chat/completions", json=body) as s:
            events = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")]
        ids["stream"] = (events[0]["id"], events[-1]["usage"])
        body = {"model": "tiny", "input": "Hello again", "max_output_tokens": 2, "stream": True}
        async with http.stream("POST", "/v1/responses", json=body) as s:
            done = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")][-1]
        usage = done["response"]["usage"]
        ids["responses_stream"] = (done["response"]["id"],
                                   {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]})  # fmt: skip

    _serve(ServerConfig(served_model_name="tiny", otlp_traces_endpoint=receiver.url), test)
    for key, (response_id, usage) in ids.items():
        span = receiver.request_span(response_id)
        a = span["attributes"]
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"], key
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"], key
        assert span["status"] != STATUS_ERROR and span["parent"] == "", key
        expected = "text_completion tiny" if key in ("n2", "batch") else "chat tiny"
        assert span["name"] == expected, key
        assert a["gen_ai.request.stream"] is key.endswith("stream"), key
    # n = 2: one span per choice, each with its own stages
    span = receiver.request_span(ids["n2"][0])
    assert span["attributes"]["gen_ai.request.choice.count"] == 2
    assert span["attributes"]["gen_ai.request.temperature"] == pytest.approx(0.7)
    choices = receiver.children(span)
    assert set(choices) == {"choice 0", "choice 1"}
    for i, choice in enumerate(choices[f"choice {k}"] for k in range(2)):
        assert choice["attributes"]["onecall.choice.index"] == i
        assert span["start"] <= choice["start"] <= choice["end"] <= span["end"]
        _check_stages(receiver, choice, 3)
    # a batch of two prompts: each counted once in the usage, one choice span per prompt
    assert set(receiver.children(receiver.request_span(ids["batch"][0]))) == {"choice 0", "choice 1"}
    _check_stages(receiver, receiver.request_span(ids["stream"][0]), 3)


# ---- 3. tenants sharing a cache ----------------------------------------------------------------------
def test_a_shared_namespace_divergence_goes_out_redacted(receiver: Receiver) -> None:
    alice, bob = Tenant("alice", "sk-alice-0123"), Tenant("bob", "sk-bob-4567")
    probe_id: list[str] = []

    async def test(http: httpx.AsyncClient) -> None:
        await _post(http, "/v1/completions", {"prompt": SECRET, "max_tokens": 1},
                    authorization=f"Bearer {alice.key}")  # fmt: skip
        r = await _post(http, "/v1/completions", {"prompt": PROBE, "max_tokens": 1},
                        authorization=f"Bearer {bob.key}")  # fmt: skip
        probe_id.append(r["id"])

    config = ServerConfig(served_model_name="tiny", tenants=(alice, bob), shared_prefix_cache=True,
                          otlp_traces_endpoint=receiver.url)  # fmt: skip
    _serve(config, test)
    span = receiver.request_span(probe_id[0])
    assert span["attributes"]["onecall.tenant"] == "bob"
    (event,) = [
        e for s in receiver.spans if s["name"] == "prefill" and s["parent"] == span["span_id"]
        for e in s["events"] if e["name"] == "prefix_cache.match"
    ]  # fmt: skip
    match = event["attributes"]
    assert match["onecall.cached_tokens"] > 0 and match["onecall.divergence.prompt_token_text"] == "0"
    assert "onecall.divergence.cached_token" not in match  # another tenant's token: never sent
    assert "onecall.divergence.cached_token_text" not in match
    assert not any("4711" in json.dumps(s, default=str) for s in receiver.spans)


# ---- 4. without the flag, a bad flag, the CLI ---------------------------------------------------------
_NO_FLAG = """
import asyncio, sys
import httpx
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.server_process import ServerProcess
from tests.helpers.tiny_engine import tiny_engine

async def main():
    app = create_app(AsyncEngine(tiny_engine()), ServerConfig(served_model_name="tiny"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2}, headers={"traceparent": sys.argv[1]})
            assert r.status_code == 200, r.text
        await asyncio.sleep(0)

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""


@pytest.mark.slow
def test_a_server_without_the_flag_never_imports_the_sdk() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_FLAG, TRACEPARENT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.server
def test_onecall_serve_flushes_its_spans_when_it_stops(receiver: Receiver) -> None:
    """The real command: the flag, the loader path, SIGTERM's shutdown flushing the batch."""
    server = ServerProcess("--otlp-traces-endpoint", receiver.url).start()
    try:
        r = httpx.post(server.url("/v1/chat/completions"), json={"messages": MESSAGES, "max_tokens": 2},
                       headers={"traceparent": TRACEPARENT}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        # a streaming client that leaves after its first chunk: its request is aborted, and exported
        body = {"messages": MESSAGES, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=60) as s:
            first = next(json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {"))
        for _ in range(100):  # the server notices the disconnect, aborts, closes the generation
            if any(x["attributes"].get("gen_ai.response.id") == first["id"] for x in receiver.spans):
                break
            time.sleep(0.1)
    finally:
        assert server.stop() == 0, server.log()
    span = receiver.request_span(r.json()["id"])
    assert span["trace_id"] == CALLER_TRACE and span["parent"] == CALLER_SPAN
    assert span["name"] == f"chat {r.json()['model']}"
    assert set(receiver.children(span)) == {"queue", "prefill", "decode"}
    left = receiver.request_span(first["id"])
    assert left["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
    assert 0 < left["attributes"]["onecall.output_tokens"] < 500
    assert set(receiver.children(left)) == {"queue", "prefill", "decode"}


def test_a_bad_endpoint_is_refused_and_the_flag_reaches_the_config() -> None:
    with pytest.raises(InvalidParameterError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint="localhost:4318")
    from onecall.cli.serve import _server_config, add_serve_command

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    a = parser.parse_args(["serve", "--otlp-traces-endpoint", "http://localhost:4318/v1/traces"])
    assert (
        _server_config(a, "http://127.0.0.1:8000").otlp_traces_endpoint == "http://localhost:4318/v1/traces"
    )
    assert _server_config(parser.parse_args(["serve"]), "x").otlp_traces_endpoint is None
