"""Errors -> OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}` with the right status.

    cause                                               status  type / code
    malformed JSON, bad or missing field, out of range  400     invalid_request_error
    InvalidParameterError, TemplateError                400     invalid_request_error (param named)
    ContextLengthExceededError                          400     code context_length_exceeded
    missing or wrong API key                            401     authentication_error
    unknown model                                       404     code model_not_found
    body over the size limit                            413     invalid_request_error
    QueueFullError                                      429     rate_limit_error, Retry-After
    model still loading, engine dead                    503     service_unavailable_error (why, in the
                                                                message: the load error, the dead engine's cause)
    EngineRestartingError (rebuilt in place)            503     service_unavailable_error, code
                                                                engine_restarting, Retry-After: retry soon
    RequestFaultError naming a parameter (the request's 400     invalid_request_error, code request_fault:
      own parameters left no token, its grammar failed)         the parameter named; nobody else noticed
    EngineStepError (the step that ran it raised)       500     server_error, code engine_step_failed: the
                                                                stage and cause named; logged by the engine thread
    anything else (a bug)                               500     server_error: logged with the request
                                                                id and traceback; the body has the id only

A client's mistake is never a 5xx: the official client retries those. The same body, as an SSE
event, reports a failure after a stream has started (see sse.py).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from onecall.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineRestartingError,
    EngineStepError,
    InvalidParameterError,
    OnecallError,
    QueueFullError,
    RequestFaultError,
    TemplateError,
)
from onecall.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("onecall.server")

INVALID_REQUEST = "invalid_request_error"


class HTTPError(Exception):
    """An error response: raise it anywhere in a route; the app's handler writes it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def http_error(exc: BaseException, request_id: str) -> HTTPError:
    """Map any exception to its HTTPError; an unexpected one is logged (with the request id) as a bug."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return HTTPError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return HTTPError(400, str(exc), param=exc.param)
    if isinstance(exc, TemplateError):
        return HTTPError(400, str(exc), param="messages")
    if isinstance(exc, QueueFullError):
        return HTTPError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineRestartingError):  # before EngineDeadError, its base: this one passes
        return HTTPError(
            503,
            str(exc),
            type="service_unavailable_error",
            code="engine_restarting",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, RequestFaultError) and exc.param is not None:  # the request's own parameters
        return HTTPError(400, str(exc), param=exc.param, code="request_fault")
    if isinstance(exc, EngineStepError):  # not the caller's fault, and the engine serves on
        return HTTPError(500, str(exc), type="server_error", code="engine_step_failed")
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, OnecallError):  # a typed error we did not expect on this path: still the caller's
        return HTTPError(400, str(exc))
    logger.error("request %s failed with an internal error", request_id, exc_info=exc)
    return HTTPError(
        500,
        f"internal server error (request id {request_id}); the server logged the details",
        type="server_error",
    )


def validation_error(exc: ValidationError) -> HTTPError:
    """The first problem pydantic found, with its location; `param` is the top-level field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    if first["type"] == "json_invalid":
        return HTTPError(400, f"the body is not valid JSON: {first['msg']}")
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return HTTPError(400, f"{where}: {first['msg']}{more}", param=loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the framework itself raises (unknown route, wrong method) gets the same body."""

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPError)
        return exc.response()

    async def on_starlette(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else INVALID_REQUEST
        err = HTTPError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return err.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        return HTTPError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}").response()

    app.add_exception_handler(HTTPError, on_http_error)
    app.add_exception_handler(StarletteHTTPException, on_starlette)
    app.add_exception_handler(RequestValidationError, on_validation)
