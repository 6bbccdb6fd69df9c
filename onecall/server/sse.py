"""Server-sent events: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

Events are built from the protocol's response models (never hand-built dicts). SSEResponse
streams an async generator and guarantees the generator is closed when the response ends for
any reason, a client that disconnected included: its `finally` (which aborts the engine
requests and frees their KV blocks) runs at once, not whenever the garbage collector gets to it.
The disconnect is watched for while the stream waits for tokens, so an abandoned request is
aborted within one engine step even if no token is due.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that closes its generator on completion or disconnect."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        cleanup: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._cleanup = cleanup  # runs last, even if the generator never started (its finally would not)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away while we were sending
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()  # disconnected: stop streaming now
        finally:
            try:
                await self._events.aclose()
            finally:
                if self._cleanup is not None:
                    await self._cleanup()
