"""ServerConfig and ServerState: what every route needs besides the request itself.

ServerState owns the engine's life in the server:

    1. startup    a ready AsyncEngine is started at once; a loader (a function that builds one,
                  as `onecall serve` passes) runs in a worker thread after the socket is up, so
                  /health answers 503 "loading" until the model is in memory, then 200
    2. serving    routes get the engine from `ready_engine()` (503 while loading or once dead, saying why),
                  check the API key (which names the tenant: tenants.py), the model name and the
                  body size here; `parse_body` puts a request that carries a cache_salt into its
                  tenant's prefix-cache namespace (the salt the engine sees)
    3. shutdown   the engine aborts whatever is still in flight and its thread is joined; the
                  OTLP exporter, if any, sends what it holds

Routes close over one ServerState (no app.state lookups); create_app builds it. With
`otlp_traces_endpoint` set it also makes the server's one OtlpTraceExporter (server/otel.py; without
it no opentelemetry module is imported), and `request_spans` binds a request to it for the route's
Generation. The served model's name is bound to the vllm: metrics' model_name label before the
engine thread starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from onecall.errors import OnecallError
from onecall.server.async_engine import AsyncEngine
from onecall.server.http_errors import HTTPError, validation_error
from onecall.server.metrics import Metrics
from onecall.server.otel import (
    TRACE_CONTEXT_HEADERS,
    OtlpTraceExporter,
    RequestSpans,
    SpanRequest,
    check_endpoint,
)
from onecall.server.tenants import Tenant, Tenants

logger = logging.getLogger("onecall.server")

ModelT = TypeVar("ModelT", bound=BaseModel)
EngineLoader = Callable[[], AsyncEngine]  # runs in a worker thread; returns an engine not yet started

MAX_BODY_BYTES = 4 * 1024 * 1024
_DRAIN_LIMIT = 4 * MAX_BODY_BYTES  # an over-long body is read (and dropped) up to this, then cut off


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None: the model's own name
    api_key: str | None = field(default=None, repr=False)  # the tenant "default"; none at all: open
    tenants: tuple[Tenant, ...] = ()  # named tenants, each its own key (--api-keys-file)
    shared_prefix_cache: bool = False  # tenants share one prefix-cache namespace (tenants.py)
    open_metrics: bool = False  # /metrics without a key even when keys are set
    max_body_bytes: int = MAX_BODY_BYTES
    url: str | None = None  # where the server listens, for the "serving ..." log line
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (server/otel.py); None: no export

    def __post_init__(self) -> None:
        self.auth  # noqa: B018 (an empty or duplicate key is refused here, before anything starts)
        if self.otlp_traces_endpoint is not None:
            check_endpoint(self.otlp_traces_endpoint)

    @functools.cached_property
    def auth(self) -> Tenants:
        """The keys and tenants, checked: --api-key and the keys file together."""
        return Tenants.build(self.api_key, self.tenants, shared_prefix_cache=self.shared_prefix_cache)


class ServerState:
    def __init__(
        self, engine: AsyncEngine | EngineLoader, config: ServerConfig, metrics: Metrics | None
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        endpoint = config.otlp_traces_endpoint
        self.otel = OtlpTraceExporter(endpoint) if endpoint is not None else None
        self.created = int(time.time())
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self._source = engine
        self._load_task: asyncio.Task[None] | None = None

    # ---- life ----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if isinstance(self._source, AsyncEngine):
            self._ready(self._source)
        else:
            self._load_task = asyncio.create_task(self._load(self._source))
        try:
            yield
        finally:
            if self._load_task is not None and not self._load_task.done():
                self._load_task.cancel()  # the worker thread finishes its load; the result is dropped
            if self.engine is not None:
                await self.engine.shutdown()
            if self.otel is not None:
                await asyncio.to_thread(self.otel.shutdown)  # flushes the spans it holds

    async def _load(self, loader: EngineLoader) -> None:
        try:
            engine = await asyncio.to_thread(loader)
        except Exception as e:
            self.load_error = e
            logger.error("onecall: the model failed to load: %s", e, exc_info=not isinstance(e, OnecallError))
            return
        self._ready(engine)

    def _ready(self, engine: AsyncEngine) -> None:
        # Everything loaded so far (the model's modules, FastAPI, pydantic's schemas) lives as long as
        # the server: moved out of the collector's reach, a full collection no longer walks it,
        # in the middle of some request's prefill.
        gc.collect()
        gc.freeze()
        # the vllm: series' model_name label: the served name, before the engine thread updates them
        self.metrics.bind_model(self.config.served_model_name or engine.engine.parts.model_name)
        engine.start()
        self.engine = engine
        where = f" on {self.config.url}" if self.config.url else ""
        parts = engine.engine.parts  # what the flags gave on this device: worth a line at startup
        logger.info("onecall: serving %s%s", self.model_name, where)
        logger.info(
            "onecall: %s %s, %s", parts.device, str(parts.dtype).removeprefix("torch."), parts.kernels
        )
        if self.otel is not None:
            logger.info("onecall: request traces go to %s (OTLP/HTTP)", self.otel.endpoint)

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.engine.parts.model_name if self.engine is not None else "(loading)"

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 saying why there is none."""
        if self.engine is None:
            if self.load_error is not None:
                raise HTTPError(
                    503, f"the model failed to load: {self.load_error}", type="service_unavailable_error"
                )
            raise HTTPError(
                503,
                "the model is still loading",
                type="service_unavailable_error",
                headers={"Retry-After": "1"},
            )
        if not self.engine.is_running:
            dead = self.engine.dead_error()
            if dead is not None:
                raise dead  # 503 engine_dead with the cause, or engine_restarting (http_errors.py)
            if self.engine.is_running:  # a restart ended between the two reads
                return self.engine
            raise HTTPError(
                503,
                "the engine is not running (the server is shutting down)",
                type="service_unavailable_error",
                code="engine_dead",
            )
        return self.engine

    def request_spans(
        self, request: Request, operation: str, response_id: str, *, stream: bool, n: int = 1
    ) -> RequestSpans | None:
        """The OTLP export of this request, for its Generation.spans (None: the server exports none).
        `operation` is gen_ai.operation.name ("chat", "text_completion")."""
        if self.otel is None:
            return None
        tenant = request.scope.get("onecall.tenant")
        span = SpanRequest(
            operation=operation,
            model=self.model_name,
            response_id=response_id,
            path=request.url.path,
            stream=stream,
            n=n,
            received=request.scope.get("onecall.received"),
            carrier={h: request.headers[h] for h in TRACE_CONTEXT_HEADERS if h in request.headers},
            tenant=tenant.name if tenant is not None else None,
        )
        return self.otel.spans(span)

    # ---- per-request checks --------------------------------------------------------------------
    def authenticate(self, request: Request) -> Tenant | None:
        """The tenant whose key the request's `Authorization: Bearer` header carries (None on an
        open server); a 401 when it carries none of the keys. Checked once a request: the answer is
        kept on the request (parse_body asks again for the cache namespace)."""
        if "onecall.tenant" in request.scope:
            tenant: Tenant | None = request.scope["onecall.tenant"]
            return tenant
        auth = self.config.auth
        if auth.is_open:
            return None
        tenant = auth.authenticate(request.headers.get("authorization", ""))
        if tenant is None:
            raise HTTPError(
                401,
                "missing or invalid API key: send it as 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        request.scope["onecall.tenant"] = tenant
        return tenant

    def check_model(self, name: str | None) -> None:
        """None means the served model; any other name must match it exactly."""
        if name is not None and name != self.model_name:
            raise HTTPError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def parse_body(self, request: Request, model: type[ModelT]) -> ModelT:
        """Read the body (at most max_body_bytes, else 413) and validate it (else 400). A request
        with a `cache_salt` field comes back with the salt its tenant runs under (its namespace)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
        body, received = bytearray(), 0
        if not (too_big and int(declared) > _DRAIN_LIMIT):
            async for chunk in request.stream():
                received += len(chunk)
                too_big = too_big or received > limit
                if not too_big:
                    body += chunk
                elif received > _DRAIN_LIMIT:
                    break  # stop reading; the connection is closed after our answer
                # else: drain and drop, so the client reads our 413 rather than a reset
        if too_big:
            raise HTTPError(413, f"the request body is larger than the limit of {limit} bytes")
        try:
            parsed = model.model_validate_json(bytes(body))
        except ValidationError as e:
            raise validation_error(e) from None
        if "cache_salt" not in type(parsed).model_fields:
            return parsed
        # the request's cache_salt becomes the namespace its tenant runs in (tenants.py's table)
        salt = self.config.auth.cache_salt(self.authenticate(request), getattr(parsed, "cache_salt", None))
        return parsed.model_copy(update={"cache_salt": salt})
