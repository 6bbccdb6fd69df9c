"""AsyncEngine: the Engine driven by one thread, fed and read from asyncio.

    event loop (HTTP handlers)                     engine thread (owns the Engine)
    --------------------------                     -------------------------------
    add_request()  -- _Add -->    command queue -> engine.add_request; typed errors come back
                   <-- concurrent Future --          through the future, before any token
    RequestStream  <-- call_soon_threadsafe --     loop: drain commands; step() while there is
      (an asyncio.Queue of RequestOutput)                work; block on the queue when idle
    stream.abort() -- _Abort -->  ...           -> engine.abort: KV blocks freed, then the future
    reset_prefix_cache() -- _ResetPrefixCache -->  -> engine.reset_prefix_cache, then the future

Invariants:
- Every call into the Engine (add_request, abort, step, the reads behind the metrics) happens in
  the engine thread. The Engine is not thread-safe and never has to be.
- A step never runs on the event loop; the loop only awaits futures and reads stream queues.
- `_streams` (request id -> stream) belongs to the engine thread. A stream leaves it when its
  finished output (stop, length or abort) or its step's EngineStepError is sent, or when the
  engine dies.
- Commands are queued only while `_closed` and `_dead` are False, checked under `_lock`; shutdown
  and death set them under the same lock, so no command is queued behind either and never answered.
- A step that fails its batch (Engine.step's recovered fault) ends just those streams, each with its
  EngineStepError; the engine serves on.
- If step() raises (the engine stopped: a fault right after a recovery, inconsistent books), or
  anything at all, a BaseException included, escapes the thread's loop, the engine is dead: every
  open stream raises EngineDeadError saying why, every command taken or queued is answered (adds
  with EngineDeadError), later adds are refused with it, and the thread ends. `dead_reason` says why.
- Under tensor parallel the idle thread does not block for good: it wakes every second to poll the
  other ranks' processes, and a rank found dead kills the engine as a failed step would (/health
  503 naming the rank before any request comes). Without a group it blocks on the queue alone.
- `max_waiting` counts requests: an add of n (n > 1 choices) needs room for all n.
- A step that does not return (a hung kernel, a deadlock: nothing raises) is caught by the watchdog
  thread when `step_timeout` is set: after that many seconds in one step the engine is declared dead
  exactly as above ("hung" in `dead_reason`, /health 503), except that the stuck thread cannot answer
  anyone: the watchdog answers the queued commands itself, and every open stream is failed on the
  event loop through `_open_streams`, the loop's own registry (the stuck thread owns `_streams`).
  Should the step return after all, its outputs are dropped and the thread ends. shutdown() then
  does not wait for the thread (a daemon; the process can still exit).

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
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
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
_TP_CHECK_PERIOD = 1.0  # seconds an idle engine thread waits for commands before checking the TP ranks


class RequestStream:
    """One request's outputs, in order; the last has finished=True, or reading it raises the
    EngineStepError of a step that failed it (or EngineDeadError)."""

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
        """On the event loop: queue an output or the engine's death (nothing after the last item: a
        watchdog's EngineDeadError and a late output from the stuck step may both arrive)."""
        if self._finished:
            return
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
class _ResetPrefixCache:
    future: Future[None] = field(default_factory=Future)


@dataclass
class _Shutdown:
    pass


_Command = _Add | _Abort | _ResetPrefixCache | _Shutdown


class AsyncEngine:
    """An Engine served to asyncio by its own thread. See the module docstring for the contract."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 256,
        metrics: Metrics | None = None,
        step_timeout: float | None = None,
    ) -> None:
        """`step_timeout`: seconds one step may run before the watchdog declares the engine hung
        (None: no watchdog)."""
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise InvalidParameterError("max_waiting", f"must be an integer >= 1, got {max_waiting!r}")
        if step_timeout is not None and not step_timeout > 0:
            raise InvalidParameterError(
                "step_timeout", f"must be > 0 seconds (or None), got {step_timeout!r}"
            )
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # time.monotonic() of the step in progress (engine thread)
        self._hung = False  # the watchdog declared the engine dead
        self._open_streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # event loop only
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed and _dead against _commands.put
        self._closed = False
        self._dead = False
        self.dead_reason: str | None = None  # why the engine died (set with _dead)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._taken: deque[_Command] = deque()  # engine thread only: taken off the queue, not yet handled

    # ---- the event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will use it."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="onecall-engine", daemon=True)
        self._thread.start()
        if self.step_timeout is not None:
            threading.Thread(target=self._watch, name="onecall-watchdog", daemon=True).start()

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
        before any token; on success the stream yields its outputs (or raises EngineStepError if a
        step that ran it failed, EngineDeadError if the engine died)."""
        now = time.perf_counter()
        (stream,) = await self._add([_NewRequest(request_id, prompt, params, constraint, now)])
        return stream

    async def add_requests(self, items: list[tuple[str, Prompt, SamplingParams]]) -> list[RequestStream]:
        """Queue several requests at once (n > 1), all or nothing: if one fails, none stays queued.
        They count as len(items) waiting requests against max_waiting."""
        now = time.perf_counter()
        return await self._add([_NewRequest(rid, p, sp, None, now) for rid, p, sp in items])

    async def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, on the engine thread between steps (running requests keep their
        blocks). Raises EngineDeadError when the engine is not running."""
        await asyncio.wrap_future(self._submit(_ResetPrefixCache()))

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
        if not self._hung:  # a stuck thread would never join; it is a daemon
            await asyncio.to_thread(thread.join)

    async def _add(self, requests: list[_NewRequest]) -> list[RequestStream]:
        streams = [RequestStream(r.request_id, self) for r in requests]
        self._open_streams.update(streams)
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

    def _submit(self, command: _Add | _ResetPrefixCache) -> Future[None]:
        if not self._submit_if_open(command):
            if self._dead:
                raise EngineDeadError(self._dead_message())
            raise EngineDeadError("the engine is not running (not started, or shut down)")
        return command.future

    def _submit_if_open(self, command: _Command) -> bool:
        with self._lock:
            if self._thread is None or self._closed or self._dead:
                return False
            self._commands.put(command)
            return True

    def dead_error(self) -> EngineDeadError | None:
        """The error every request gets once the engine died, saying why; None while it has not."""
        return None if self.dead_reason is None else EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        return f"the engine stopped: {self.dead_reason}; restart the server"

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        """The thread: the loop below until shutdown; whatever ends it otherwise, a BaseException
        included, fails every waiter (_die) instead of leaving it hanging."""
        try:
            self._loop_until_shutdown()
        except BaseException as e:  # KeyboardInterrupt, SystemExit, ...: nobody above us would answer
            self._die(f"the engine thread stopped on {type(e).__name__}: {e}", e)

    def _loop_until_shutdown(self) -> None:
        """Commands first, then one step; block for commands only when idle. Returns on shutdown or
        once dead (everything was answered then)."""
        self._update_metrics([])  # initial gauges
        while not self._dead:
            idle = not self.engine.has_unfinished_requests()
            self._taken.extend(self._take_commands(block=idle))
            while self._taken:
                command = self._taken[0]  # stays in _taken while handled: _die answers it if need be
                if isinstance(command, _Shutdown):
                    self._taken.clear()  # nothing is queued behind it
                    self._shutdown_now()
                    return
                try:
                    self._handle(command)
                except Exception as e:  # a bug outside the engine's typed errors
                    self._die(f"handling {type(command).__name__} raised {type(e).__name__}: {e}", e)
                    return
                self._taken.popleft()
            if self.engine.has_unfinished_requests():
                self._step()

    def _answer_dead(self, command: _Command) -> None:
        if isinstance(command, _Shutdown):
            return
        with contextlib.suppress(InvalidStateError):  # answered already, or cancelled by its caller
            if isinstance(command, _Add | _ResetPrefixCache):
                command.future.set_exception(EngineDeadError(self._dead_message()))
            else:
                command.future.set_result(None)  # an abort still "succeeded": nothing runs any more

    def _take_commands(self, *, block: bool) -> list[_Command]:
        """Every queued command; with `block`, wait for one first (see _wait_for_command)."""
        commands: list[_Command] = []
        if block and (first := self._wait_for_command()) is not None:
            commands.append(first)
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _wait_for_command(self) -> _Command | None:
        """Block until a command comes. Under tensor parallel, wake every _TP_CHECK_PERIOD seconds
        to look at the other ranks: one that died while the server is idle takes the engine down
        now (None returned, `_dead` set), not at the next request. No group: one plain blocking get."""
        group = self.engine.parts.tp_group
        if group is None:
            return self._commands.get()
        while True:
            try:
                return self._commands.get(timeout=_TP_CHECK_PERIOD)
            except queue.Empty:
                group.check_workers()  # polls the worker processes; no collective, no step
                if group.dead_reason is not None:
                    self._die(group.dead_reason, EngineDeadError(group.dead_reason))
                    return None

    def _handle(self, command: _Add | _Abort | _ResetPrefixCache) -> None:
        # An add whose caller was cancelled before we got here is skipped; an abort always runs.
        wanted = command.future.set_running_or_notify_cancel()
        if isinstance(command, _Abort):
            outputs = self._abort_now(command.request_id)
            self._update_metrics(outputs)
            self._publish(outputs)
            if wanted:
                command.future.set_result(None)
            return
        if not wanted:
            return
        if isinstance(command, _ResetPrefixCache):
            self.engine.reset_prefix_cache()
            command.future.set_result(None)
            self._update_metrics([])
            return
        try:
            self._add_now(command)
        except Exception as e:  # typed errors for the caller; the engine validated before changing state
            command.future.set_exception(e)
        else:
            command.future.set_result(None)
        self._update_metrics([])

    def _add_now(self, command: _Add) -> None:
        n, num_waiting = len(command.requests), self.engine.num_waiting
        if n > self.max_waiting:  # would never fit: not worth a retry
            raise InvalidParameterError(
                "n", f"asks for {n} choices, but at most {self.max_waiting} requests may wait at once"
            )
        if num_waiting + n > self.max_waiting:
            raise QueueFullError(num_waiting, self.max_waiting, num_requested=n)
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
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            if self._hung:
                return  # the watchdog answered everyone already

            reason = (
                str(e) if isinstance(e, EngineDeadError) else f"engine.step() raised {type(e).__name__}: {e}"
            )
            self._die(reason, e)
            return
        finally:
            self._step_started = None
        if self._hung:
            return  # a step the watchdog gave up on came back: its streams were failed already
        self._log_faults(outputs)
        self._update_metrics(outputs)  # first, so a consumer that sees an output sees its metrics
        self._publish(outputs)

    @staticmethod
    def _log_faults(outputs: list[RequestOutput]) -> None:
        """One line (and the traceback) per failed step, however many requests it failed."""
        errors = [out.error for out in outputs if out.error is not None]
        if errors:
            logger.error(
                "%s; failed its %d requests, serving on", errors[0], len(errors), exc_info=errors[0].cause
            )

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Send outputs to their streams: one wake-up of the event loop per call, not per output.
        A failed request's stream gets its EngineStepError instead of the output."""
        batch: list[tuple[RequestStream, _Item]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # already ended (an abort raced a finish), or the engine died
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out if out.error is None else out.error))
        self._send(batch)

    def _send(self, batch: list[tuple[RequestStream, _Item]]) -> None:
        if not batch or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is left to read them
            self._loop.call_soon_threadsafe(_deliver_all, batch)

    def _die(self, reason: str, exc: BaseException) -> None:
        """The engine cannot go on: refuse later commands, fail every open stream and every command
        taken or queued. Nothing can be queued after this: `_dead` is set under `_lock`."""
        logger.error(
            "%s; the engine is dead, failing %d open requests", reason, len(self._streams), exc_info=exc
        )
        with self._lock:
            self._dead, self.dead_reason = True, reason
        self._send([(stream, EngineDeadError(self._dead_message())) for stream in self._streams.values()])
        self._streams.clear()
        unanswered = [*self._taken, *self._take_commands(block=False)]
        self._taken.clear()
        for command in unanswered:
            self._answer_dead(command)

    # ---- the watchdog thread ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Poll the step in progress; past step_timeout seconds, declare the engine hung."""
        assert self.step_timeout is not None
        period = min(1.0, self.step_timeout / 4)
        while not (self._closed or self._dead):
            time.sleep(period)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                self._declare_hung(time.monotonic() - started)
                return

    def _declare_hung(self, elapsed: float) -> None:
        """_die for a thread that cannot run it: the watchdog answers the queued commands, the event
        loop fails the open streams (module docstring)."""
        reason = (
            f"a step has not returned after {elapsed:.0f} s (step timeout {self.step_timeout:g} s): "
            "the engine is hung"
        )
        with self._lock:
            if self._dead or self._closed:
                return
            self._hung = True
            self._dead, self.dead_reason = True, reason
        logger.error("%s; failing every open request", reason)
        for command in self._take_commands(block=False):
            self._answer_dead(command)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
                self._loop.call_soon_threadsafe(self._fail_open_streams)

    def _fail_open_streams(self) -> None:
        """On the event loop: every stream not yet finished gets the engine's death."""
        for stream in list(self._open_streams):
            stream._deliver(EngineDeadError(self._dead_message()))

    def _shutdown_now(self) -> None:
        outputs: list[RequestOutput] = []
        try:
            for request_id in list(self._streams):
                outputs += self._abort_now(request_id)
        except Exception as e:
            self._die(f"engine.abort() raised during shutdown: {type(e).__name__}: {e}", e)
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
