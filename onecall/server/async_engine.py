"""AsyncEngine: the Engine driven by one thread, fed and read from asyncio. This module is the event
loop's side (AsyncEngine, RequestStream); the thread is server/engine_loop.py's EngineLoop, the
commands between them server/engine_commands.py.

    event loop (HTTP handlers)                     engine thread (owns the Engine)
    --------------------------                     -------------------------------
    add_request()  -- Add -->     command queue -> engine.add_request; typed errors come back
                   <-- concurrent Future --          through the future, before any token
    RequestStream  <-- call_soon_threadsafe --     loop: drain commands; step() while there is
      (an asyncio.Queue of RequestOutput)                work; block on the queue when idle
    stream.abort() -- Abort -->   ...           -> engine.abort: KV blocks freed, then the future
    reset_prefix_cache() -- ResetPrefixCache -->   -> engine.reset_prefix_cache, then the future

Invariants:
- Every call into the Engine (add_request, abort, step, the reads behind the metrics) happens in
  the engine thread. The Engine is not thread-safe and never has to be.
- A step never runs on the event loop; the loop only awaits futures and reads stream queues.
- EngineLoop's `_streams` (request id -> stream) belongs to the engine thread. A stream leaves it when its
  finished output (stop, length or abort) or its step's EngineStepError is sent, or when the
  engine dies.
- Commands are queued only while `closed` and `dead` are False, checked under EngineLoop's lock; shutdown
  and death set them under the same lock, so no command is queued behind either and never answered.
- A step that fails its batch (Engine.step's recovered fault) ends just those streams, each with its
  EngineStepError; the engine serves on.
- If step() raises (the engine stopped: a fault right after a recovery, inconsistent books), or an
  Exception escapes the handling of a command or the thread's loop, the supervisor rebuilds the
  engine in place (Engine.restart(): fresh KV bookkeeping and scheduler on the same weights) at
  most `max_restarts` times in `restart_window` seconds: while it runs, is_running is False and
  dead_error() is an EngineRestartingError (/health 503 "restarting", Retry-After), and commands
  keep queuing to run on the fresh engine. Once it is rebuilt every stream open at the stop
  raises EngineRestartingError (retryable: a retry now is served; an EngineDeadError subclass),
  the metrics count the restart and the outage, and it serves again.
- Otherwise the engine is dead: past the restart budget, under tensor parallel (Engine.restart()
  refuses), when the restart itself raises, or when a BaseException that is not an Exception
  escapes the loop. Every open stream raises EngineDeadError saying why, every command taken or
  queued is answered (adds with EngineDeadError), later adds are refused with it, and the thread
  ends. `dead_reason` says why, and why there was no restart.
- Under tensor parallel the idle thread does not block for good: it wakes every second to poll the
  other ranks' processes, and a rank found dead kills the engine as a failed step would (/health
  503 naming the rank before any request comes). Without a group it blocks on the queue alone.
- `max_waiting` counts requests: an add of n (n > 1 choices) needs room for all n.
- A step that does not return (a hung kernel, a deadlock: nothing raises) is caught by the watchdog
  thread when `step_timeout` is set: after that many seconds in one step the engine is declared dead
  exactly as above ("hung" in `dead_reason`, /health 503), except that the stuck thread cannot answer
  anyone: the watchdog answers the queued commands itself, and every open stream is failed on the
  event loop through `open_streams`, the loop's own registry (the stuck thread owns `_streams`).
  Should the step return after all, its outputs are dropped and the thread ends. shutdown() then
  does not wait for the thread (a daemon; the process can still exit). A hung engine is never
  restarted: the thread that would rebuild it is stuck in the step.
- An idle thread blocks on the queue; so does, for 10 to 50 ms at a time, one whose last step
  scheduled nothing although requests wait (they fit no free KV block while nothing runs): it
  never spins through empty steps, and a command wakes it at once.

Cleanup is the consumer's job: a consumer that stops iterating (break, cancellation, a client that
disconnected) must abort its stream, or the request runs on to max_tokens. Either

    async with await engine.add_request(rid, prompt, params) as stream:   # aborts on exit
        async for out in stream:
            ...

or `try: ... finally: await stream.abort()`. abort() is idempotent, a no-op once the request
finished, and queues its command before its first await: it takes effect even if the awaiting
task is cancelled again.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import TracebackType

from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import EngineDeadError, EngineRestartingError, InvalidParameterError
from onecall.sampling.types import TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.server.engine_commands import (
    Abort,
    Add,
    Item,
    NewRequest,
    Prompt,
    ResetPrefixCache,
)
from onecall.server.engine_loop import EngineLoop
from onecall.server.metrics import Metrics

__all__ = ["AsyncEngine", "EngineRestartingError", "Prompt", "RequestStream"]


class RequestStream:
    """One request's outputs, in order; the last has finished=True, or reading it raises the
    EngineStepError of a step that failed it (or EngineRestartingError, EngineDeadError)."""

    def __init__(self, request_id: str, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._finished = False  # the last item was delivered (set on the loop, by _deliver)
        self._error: BaseException | None = None
        self._exhausted = False  # the iterator returned (or raised) its last item
        self._has_output = asyncio.Event()  # set with the first item delivered

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._exhausted:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._exhausted, self._error = True, item
            raise item
        self._exhausted = item.finished
        return item

    async def ready(self) -> None:
        """Wait until the first output (or the engine's death) is there to read, without taking it."""
        await self._has_output.wait()

    async def abort(self) -> None:
        """Stop the request and free its KV blocks (in the engine thread); idempotent."""
        if not self._finished:
            await self._owner._abort(self.request_id)

    aclose = abort  # the async-generator name for the same cleanup

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.abort()

    def _deliver(self, item: Item) -> None:
        """On the event loop: queue an output or the engine's death (nothing after the last item: a
        watchdog's EngineDeadError and a late output from the stuck step may both arrive)."""
        if self._finished:
            return
        if isinstance(item, BaseException) or item.finished:
            self._finished = True
        self._queue.put_nowait(item)
        self._has_output.set()


class AsyncEngine:
    """An Engine served to asyncio by its own thread (server/engine_loop.py's EngineLoop). See the
    module docstring for the contract."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 256,
        metrics: Metrics | None = None,
        step_timeout: float | None = None,
        max_restarts: int = 3,
        restart_window: float = 300.0,
    ) -> None:
        """`step_timeout`: seconds one step may run before the watchdog declares the engine hung
        (None: no watchdog). `max_restarts`: how many times the stopped engine may be rebuilt in
        place within any `restart_window` seconds (0: never; it stays dead)."""
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise InvalidParameterError("max_waiting", f"must be an integer >= 1, got {max_waiting!r}")
        if step_timeout is not None and not step_timeout > 0:
            raise InvalidParameterError(
                "step_timeout", f"must be > 0 seconds (or None), got {step_timeout!r}"
            )
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise InvalidParameterError("max_restarts", f"must be an integer >= 0, got {max_restarts!r}")
        if not restart_window > 0:
            raise InvalidParameterError("restart_window", f"must be > 0 seconds, got {restart_window!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.step_timeout = step_timeout
        self._loop = EngineLoop(engine, max_waiting, metrics, step_timeout, max_restarts, restart_window)

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will use it."""
        if self._loop.thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop.start(asyncio.get_running_loop())

    @property
    def is_running(self) -> bool:
        """Serving: started, not shut down, not dead, not in the middle of a restart."""
        loop = self._loop
        thread = loop.thread
        alive = thread is not None and thread.is_alive()
        return alive and not (loop.dead or loop.closed or loop.restarting)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died; None while it has not (a restart is not a death)."""
        return self._loop.dead_reason

    def dead_error(self) -> EngineDeadError | None:
        """Why a request cannot be served now: EngineDeadError once the engine died, saying why;
        EngineRestartingError (retryable) while it is rebuilt in place; None otherwise."""
        if self.dead_reason is not None:
            return EngineDeadError(self._loop.dead_message())
        return self._loop.restarting_error() if self._loop.restarting else None

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        constraint: TokenConstraint | None = None,
    ) -> RequestStream:
        """Queue one request. Raises the engine's typed errors, QueueFullError or EngineDeadError
        before any token; on success the stream yields its outputs (or raises EngineStepError if a
        step that ran it failed, EngineRestartingError if the engine stopped and is rebuilt,
        EngineDeadError if it died)."""
        now = time.perf_counter()
        (stream,) = await self._add([NewRequest(request_id, prompt, params, constraint, now)])
        return stream

    async def add_requests(self, items: list[tuple[str, Prompt, SamplingParams]]) -> list[RequestStream]:
        """Queue several requests at once (n > 1), all or nothing: if one fails, none stays queued.
        They count as len(items) waiting requests against max_waiting."""
        now = time.perf_counter()
        return await self._add([NewRequest(rid, p, sp, None, now) for rid, p, sp in items])

    async def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, on the engine thread between steps (running requests keep their
        blocks). Raises EngineDeadError when the engine is not running."""
        await asyncio.wrap_future(self._submit(ResetPrefixCache()))

    async def shutdown(self) -> None:
        """Abort everything in flight (each open stream ends with finish_reason "abort"), stop and
        join the thread. Idempotent; later adds raise EngineDeadError."""
        thread = self._loop.thread
        if thread is None:
            return
        self._loop.close()
        if not self._loop.hung:  # a stuck thread would never join; it is a daemon
            await asyncio.to_thread(thread.join)

    async def _add(self, requests: list[NewRequest]) -> list[RequestStream]:
        streams = [RequestStream(r.request_id, self) for r in requests]
        self._loop.open_streams.update(streams)
        future = self._submit(Add(requests, list(streams)))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller left while the add was in flight: if the thread took the command already,
            # the requests are running for nobody. Abort them (a no-op for ids never added).
            for s in streams:
                self._loop.submit(Abort(s.request_id))
            raise
        return streams

    async def _abort(self, request_id: str) -> None:
        command = Abort(request_id)
        if not self._loop.submit(command):
            return  # shut down: everything was aborted already
        # shield: a cancelled caller must not cancel the command (the thread runs it regardless).
        await asyncio.shield(asyncio.wrap_future(command.future))

    def _submit(self, command: Add | ResetPrefixCache) -> Future[None]:
        if not self._loop.submit(command):  # during a restart it queues: it runs on the fresh engine
            if self._loop.dead:
                raise EngineDeadError(self._loop.dead_message())
            raise EngineDeadError("the engine is not running (not started, or shut down)")
        return command.future
