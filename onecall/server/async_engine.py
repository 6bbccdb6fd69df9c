"""AsyncEngine: the Engine driven by one thread, fed and read from asyncio.

    event loop (HTTP handlers)                     engine thread (owns the Engine)
    --------------------------                     -------------------------------
    add_request()  -- _Add -->    command queue -> engine.add_request; typed errors come back
                   <-- concurrent Future --          through the future, before any token
    RequestStream  <-- call_soon_threadsafe --     loop: drain commands; step() while there is
      (an asyncio.Queue of RequestOutput)                work; block on the queue when idle
    stream.abort() -- _Abort -->  ...           -> engine.abort: KV blocks freed, then the future

Invariants:
- Every call into the Engine (add_request, abort, step, the reads behind the metrics) happens in
  the engine thread. The Engine is not thread-safe and never has to be.
- A step never runs on the event loop; the loop only awaits futures and reads stream queues.
- `_streams` (request id -> stream) belongs to the engine thread. A stream leaves it when its
  finished output (stop, length or abort) is sent, or when the engine dies.
- Commands are queued only while `_closed` is False, checked under `_lock`; shutdown sets it under
  the same lock, so nothing can be queued behind the shutdown command and never be answered.
- If step() raises, the engine is dead: every open stream raises EngineDeadError, and the thread
  stays up only to refuse later commands with EngineDeadError, until shutdown.

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
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType

from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import EngineDeadError, InvalidParameterError, QueueFullError
from onecall.sampling.types import TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.server.metrics import Metrics
from onecall.text.chat_template import RenderedPrompt

logger = logging.getLogger("onecall.server")

Prompt = str | list[int] | RenderedPrompt
_Item = RequestOutput | BaseException  # what a stream's queue holds: outputs, then maybe an error
_DEAD = "the engine loop died after an internal error (logged by the server); restart it"


class RequestStream:
    """One request's outputs, in order; the last has finished=True (or the engine died)."""

    def __init__(self, request_id: str, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
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

    def _deliver(self, item: _Item) -> None:
        """On the event loop: queue an output or the engine's death."""
        if isinstance(item, BaseException) or item.finished:
            self._finished = True
        self._queue.put_nowait(item)
        self._has_output.set()


# ---- commands (event loop -> engine thread) -------------------------------------------------------
@dataclass
class _NewRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    constraint: TokenConstraint | None
    arrival_time: float


@dataclass
class _Add:
    requests: list[_NewRequest]
    streams: list[RequestStream]
    future: Future[None] = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str
    future: Future[None] = field(default_factory=Future)


@dataclass
class _Shutdown:
    pass


_Command = _Add | _Abort | _Shutdown


class AsyncEngine:
    """An Engine served to asyncio by its own thread. See the module docstring for the contract."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256, metrics: Metrics | None = None) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise InvalidParameterError("max_waiting", f"must be an integer >= 1, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed against _commands.put
        self._closed = False
        self._dead = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only

    # ---- the event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will use it."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="onecall-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._dead and not self._closed

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        constraint: TokenConstraint | None = None,
    ) -> RequestStream:
        """Queue one request. Raises the engine's typed errors, QueueFullError or EngineDeadError
        before any token; on success the stream yields its outputs."""
        now = time.perf_counter()
        (stream,) = await self._add([_NewRequest(request_id, prompt, params, constraint, now)])
        return stream

    async def add_requests(self, items: list[tuple[str, Prompt, SamplingParams]]) -> list[RequestStream]:
        """Queue several requests at once (n > 1), all or nothing: if one fails, none stays queued."""
        now = time.perf_counter()
        return await self._add([_NewRequest(rid, p, sp, None, now) for rid, p, sp in items])

    async def shutdown(self) -> None:
        """Abort everything in flight (each open stream ends with finish_reason "abort"), stop and
        join the thread. Idempotent; later adds raise EngineDeadError."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(_Shutdown())
        await asyncio.to_thread(thread.join)

    async def _add(self, requests: list[_NewRequest]) -> list[RequestStream]:
        streams = [RequestStream(r.request_id, self) for r in requests]
        future = self._submit(_Add(requests, streams))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller left while the add was in flight: if the thread took the command already,
            # the requests are running for nobody. Abort them (a no-op for ids never added).
            for s in streams:
                self._submit_if_open(_Abort(s.request_id))
            raise
        return streams

    async def _abort(self, request_id: str) -> None:
        command = _Abort(request_id)
        if not self._submit_if_open(command):
            return  # shut down: everything was aborted already
        # shield: a cancelled caller must not cancel the command (the thread runs it regardless).
        await asyncio.shield(asyncio.wrap_future(command.future))

    def _submit(self, command: _Add) -> Future[None]:
        if self._dead:
            raise EngineDeadError(_DEAD)
        if not self._submit_if_open(command):
            raise EngineDeadError("the engine is not running (not started, or shut down)")
        return command.future

    def _submit_if_open(self, command: _Command) -> bool:
        with self._lock:
            if self._thread is None or self._closed:
                return False
            self._commands.put(command)
            return True

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        """The thread's loop: commands first, then one step; block for commands only when idle."""
        self._update_metrics([])  # initial gauges
        while True:
            idle = self._dead or not self.engine.has_unfinished_requests()
            for command in self._take_commands(block=idle):
                if isinstance(command, _Shutdown):
                    self._shutdown_now()
                    return
                try:
                    self._handle(command)
                except Exception:  # a bug outside the engine's typed errors: never leave a caller hanging
                    self._die(f"handling {type(command).__name__} raised")
                    self._answer_dead(command)
            if not self._dead and self.engine.has_unfinished_requests():
                self._step()

    @staticmethod
    def _answer_dead(command: _Add | _Abort) -> None:
        if command.future.done():
            return
        if isinstance(command, _Add):
            command.future.set_exception(EngineDeadError(_DEAD))
        else:
            command.future.set_result(None)  # an abort still "succeeded": nothing runs any more

    def _take_commands(self, *, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: _Add | _Abort) -> None:
        # An add whose caller was cancelled before we got here is skipped; an abort always runs.
        wanted = command.future.set_running_or_notify_cancel()
        if isinstance(command, _Abort):
            outputs = [] if self._dead else self._abort_now(command.request_id)
            self._update_metrics(outputs)
            self._publish(outputs)
            if wanted:
                command.future.set_result(None)
            return
        if not wanted:
            return
        try:
            self._add_now(command)
        except Exception as e:  # typed errors for the caller; the engine validated before changing state
            command.future.set_exception(e)
        else:
            command.future.set_result(None)
        self._update_metrics([])

    def _add_now(self, command: _Add) -> None:
        if self._dead:
            raise EngineDeadError(_DEAD)
        if self.engine.num_waiting >= self.max_waiting:
            raise QueueFullError(self.engine.num_waiting, self.max_waiting)
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(
                    r.request_id, r.prompt, r.params, constraint=r.constraint, arrival_time=r.arrival_time
                )
                added.append(r.request_id)
        except BaseException:
            for rid in added:  # all or nothing
                self.engine.abort(rid)
            raise
        for stream in command.streams:
            self._streams[stream.request_id] = stream

    def _abort_now(self, request_id: str) -> list[RequestOutput]:
        """Abort in the engine (its KV blocks are freed now); the output ends the stream once published."""
        output = self.engine.abort(request_id)
        return [] if output is None else [output]  # None: finished already, or never added

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            self._die("engine.step() raised")
            return
        self._update_metrics(outputs)  # first, so a consumer that sees an output sees its metrics
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Send outputs to their streams: one wake-up of the event loop per call, not per output."""
        batch: list[tuple[RequestStream, _Item]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # already ended (an abort raced a finish), or the engine died
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        self._send(batch)

    def _send(self, batch: list[tuple[RequestStream, _Item]]) -> None:
        if not batch or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is left to read them
            self._loop.call_soon_threadsafe(_deliver_all, batch)

    def _die(self, what: str) -> None:
        logger.exception("%s; the engine is dead, failing %d open requests", what, len(self._streams))
        self._dead = True
        self._send([(stream, EngineDeadError(_DEAD)) for stream in self._streams.values()])
        self._streams.clear()

    def _shutdown_now(self) -> None:
        outputs: list[RequestOutput] = []
        try:
            for request_id in [] if self._dead else list(self._streams):
                outputs += self._abort_now(request_id)
        except Exception:
            self._die("engine.abort() raised during shutdown")
        self._update_metrics(outputs)
        self._publish(outputs)

    def _update_metrics(self, outputs: list[RequestOutput]) -> None:
        if self.metrics is None or self._dead:
            return
        try:
            self.metrics.observe_outputs(outputs, time.perf_counter())
            self.metrics.update_engine(self.engine)
        except Exception:  # metrics are worth a log line, never a dead engine
            logger.exception("updating the metrics failed")


def _deliver_all(batch: list[tuple[RequestStream, _Item]]) -> None:
    for stream, item in batch:
        stream._deliver(item)
