"""create_app(engine, config): the OpenAI-compatible HTTP API over one AsyncEngine.

    route                        auth   handler
    GET  /                       open   the trace viewer (static/viewer.html; its API calls carry the key)
    POST /v1/chat/completions    key    serving_chat.create_chat_completion
    POST /v1/completions         key    serving_completion.create_completion
    POST /v1/responses           key    serving_responses.create_response (the chat pipeline, stateless)
    GET  /v1/models[/{model}]    key    here
    POST /tokenize, /detokenize  key    serving_tokens
    GET  /tokenizer_info         key    serving_tokens
    GET  /health                 open   200 when the engine runs; 503 while loading or once dead (and why)
    GET  /metrics                key*   Prometheus text (server/metrics.py); *open with --open-metrics
    GET  /model_info, /get_model_info    key   serving_info: the model's identity and limits (SGLang's names)
    GET  /server_info, /get_server_info  key   serving_info: settings and the engine's live state
    GET  /get_load               key    serving_info: running + waiting requests, KV tokens held
    POST /v1/chat/completions/render, /v1/completions/render
                                 key    serving_info: the prompt's token ids, nothing generated (vLLM's)
    POST /flush_cache            key    serving_info: drop the prefix cache (SGLang's name)
    GET  /openapi.json           open   the OpenAPI 3.1 document (server/openapi.py: bodies from protocol*.py)
    GET  /docs                   open   a self-contained page that lists /openapi.json's routes (works offline)

/openapi.json and /docs are open, like /health: they describe the API's shape, which is public
(the same for every onecall), and hold nothing from the model or the requests. The info and load
routes carry the key: they show the served model and live load. A router in front of keyed
replicas sends the key (sgl-router: --api-key). /metrics carries it too (as llama.cpp's does):
its counters are every tenant's traffic together; a Prometheus scrape sends it as a bearer token,
and --open-metrics serves it without one (vLLM's behaviour). "key" is any tenant's key
(server/tenants.py); a server without keys is open everywhere.

Every route goes through `_route`, which stamps when the request came in (the start of its OTLP
span, server/otel.py), checks the API key first (before the body is read), gives the request its id,
and turns any exception into the OpenAI error body (http_errors.py):
a typed error into its 4xx, anything else into a logged 500. The engine is given either ready
(an AsyncEngine, started in the app's lifespan) or as a loader run after the socket is up (what
`onecall serve` does, so /health says "loading" instead of refusing connections).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from onecall.server.async_engine import AsyncEngine
from onecall.server.http_errors import http_error, install_error_handlers
from onecall.server.metrics import Metrics
from onecall.server.openapi import DOCS_HTML, openapi_schema
from onecall.server.protocol import HealthResponse, ModelCard, ModelList
from onecall.server.serving_chat import create_chat_completion
from onecall.server.serving_common import ClientDisconnected, random_id
from onecall.server.serving_completion import create_completion
from onecall.server.serving_info import (
    flush_cache,
    get_load,
    get_model_info,
    get_server_info,
    render_chat_completion,
    render_completion,
)
from onecall.server.serving_responses import create_response
from onecall.server.serving_tokens import detokenize, tokenize, tokenizer_info
from onecall.server.state import EngineLoader, ServerConfig, ServerState

__all__ = ["ServerConfig", "create_app"]

Handler = Callable[[ServerState, Request, str], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(
    async_engine: AsyncEngine | EngineLoader,
    config: ServerConfig | None = None,
    *,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The app. `metrics` defaults to the engine's own (a loader should build its engine with the
    same Metrics it passes here)."""
    if metrics is None and isinstance(async_engine, AsyncEngine):
        metrics = async_engine.metrics
    state = ServerState(async_engine, config or ServerConfig(), metrics)
    app = FastAPI(title="onecall", lifespan=state.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def route(handler: Handler, *, is_open: bool = False) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            request.scope["onecall.received"] = time.perf_counter()  # the request span's start (otel.py)
            request_id = random_id()
            try:
                if not is_open:
                    state.authenticate(request)
                return await handler(state, request, request_id)
            except ClientDisconnected:
                return Response(status_code=499)  # nobody is left to read it
            except Exception as e:
                return http_error(e, request_id).response()

        return endpoint

    app.add_api_route("/v1/chat/completions", route(create_chat_completion), methods=["POST"])
    app.add_api_route("/v1/completions", route(create_completion), methods=["POST"])
    app.add_api_route("/v1/responses", route(create_response), methods=["POST"])
    app.add_api_route("/v1/models", route(_list_models), methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", route(_get_model), methods=["GET"])
    app.add_api_route("/tokenize", route(tokenize), methods=["POST"])
    app.add_api_route("/detokenize", route(detokenize), methods=["POST"])
    app.add_api_route("/tokenizer_info", route(tokenizer_info), methods=["GET"])
    app.add_api_route("/", route(_viewer, is_open=True), methods=["GET"])
    app.add_api_route("/health", route(_health, is_open=True), methods=["GET"])
    app.add_api_route("/metrics", route(_metrics, is_open=state.config.open_metrics), methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, route(get_model_info), methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, route(get_server_info), methods=["GET"])
    app.add_api_route("/get_load", route(get_load), methods=["GET"])
    app.add_api_route("/v1/chat/completions/render", route(render_chat_completion), methods=["POST"])
    app.add_api_route("/v1/completions/render", route(render_completion), methods=["POST"])
    app.add_api_route("/flush_cache", route(flush_cache), methods=["POST"])
    app.add_api_route("/openapi.json", route(_openapi, is_open=True), methods=["GET"])
    app.add_api_route("/docs", route(_docs, is_open=True), methods=["GET"])
    return app


def _model_card(state: ServerState) -> ModelCard:
    engine = state.ready_engine()
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=engine.engine.parts.model_name,
        max_model_len=engine.engine.max_model_len,
    )


async def _list_models(state: ServerState, request: Request, request_id: str) -> Response:
    return _json(ModelList(data=[_model_card(state)]))


async def _get_model(state: ServerState, request: Request, request_id: str) -> Response:
    card = _model_card(state)
    name = request.path_params["model"]
    if name != card.id:
        state.check_model(name)  # raises the 404
    return _json(card)


async def _health(state: ServerState, request: Request, request_id: str) -> Response:
    state.ready_engine()  # 503 while loading or once dead
    return _json(HealthResponse())


async def _metrics(state: ServerState, request: Request, request_id: str) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, headers={"Content-Type": content_type})


@functools.cache
def _openapi_json() -> bytes:
    return json.dumps(openapi_schema()).encode()


async def _openapi(state: ServerState, request: Request, request_id: str) -> Response:
    return Response(_openapi_json(), media_type="application/json")


async def _docs(state: ServerState, request: Request, request_id: str) -> Response:
    return Response(
        DOCS_HTML, media_type="text/html; charset=utf-8", headers={"Content-Security-Policy": _VIEWER_CSP}
    )


# The viewer is one self-contained page: inline script and style, no request leaves this server.
_VIEWER_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@functools.cache
def _viewer_html() -> bytes:
    return (importlib.resources.files("onecall.server") / "static" / "viewer.html").read_bytes()


async def _viewer(state: ServerState, request: Request, request_id: str) -> Response:
    return Response(
        _viewer_html(),
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": _VIEWER_CSP, "Cache-Control": "no-cache"},
    )


def _json(model: ModelCard | ModelList | HealthResponse) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
