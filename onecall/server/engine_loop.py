"""EngineLoop: the thread that owns the Engine, the commands it takes, and the step watchdog. The
asyncio side (AsyncEngine, RequestStream) is server/async_engine.py; the contract both keep is in its
docstring; the commands it takes are in server/engine_commands.py. This module is everything
that runs off the event loop.

The loop: take every queued command, handle them in order, then one step while there is work;
when idle, block on the queue. Outputs go back to the event loop in one call_soon_threadsafe per
step. Death (_die): `dead` is set under `_lock`, the lock `submit` queues under, so no command
is queued behind it unanswered; every open stream gets EngineDeadError, every command taken or
queued is answered. Under tensor parallel the idle wait wakes every _TP_CHECK_PERIOD seconds to
poll the other ranks (a rank that died while idle kills the engine now, not at the next request).

The watchdog (with step_timeout) polls the step in progress; past the timeout it declares the
engine hung. The stuck thread can answer nobody, so the watchdog answers the queued commands and
asks the event loop to fail every open stream (`open_streams`, the loop's own registry).
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
from concurrent.futures import InvalidStateError

from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import EngineDeadError, InvalidParameterError, QueueFullError
from onecall.server.engine_commands import (
    Abort,
    Add,
    Command,
    Item,
    ResetPrefixCache,
    Shutdown,
    StreamSink,
)
from onecall.server.metrics import Metrics

logger = logging.getLogger("onecall.server")

_TP_CHECK_PERIOD = 1.0  # seconds an idle engine thread waits for commands before checking the TP ranks


class EngineLoop:
    """The engine thread and its watchdog; AsyncEngine submits commands to it (see the docstring)."""

    def __init__(
        self, engine: Engine, max_waiting: int, metrics: Metrics | None, step_timeout: float | None
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # time.monotonic() of the step in progress (engine thread)
        self.hung = False  # the watchdog declared the engine dead
        self.open_streams: weakref.WeakSet[StreamSink] = weakref.WeakSet()  # event loop only
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards closed and dead against _commands.put
        self.closed = False
        self.dead = False
        self.dead_reason: str | None = None  # why the engine died (set with dead)
        self.thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, StreamSink] = {}  # engine thread only
        self._taken: deque[Command] = deque()  # engine thread only: taken off the queue, not yet handled

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread (and the watchdog, with a step_timeout); outputs go to `loop`."""
        self._loop = loop
        self.thread = threading.Thread(target=self._run, name="onecall-engine", daemon=True)
        self.thread.start()
        if self.step_timeout is not None:
            threading.Thread(target=self._watch, name="onecall-watchdog", daemon=True).start()

    def submit(self, command: Command) -> bool:
        """Queue a command unless the loop is not started, shut down or dead (then False)."""
        with self._lock:
            if self.thread is None or self.closed or self.dead:
                return False
            self._commands.put(command)
            return True

    def close(self) -> None:
        """Queue Shutdown once (idempotent); nothing can be queued behind it."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._commands.put(Shutdown())

    def dead_message(self) -> str:
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
        while not self.dead:
            idle = not self.engine.has_unfinished_requests()
            self._taken.extend(self._take_commands(block=idle))
            while self._taken:
                command = self._taken[0]  # stays in _taken while handled: _die answers it if need be
                if isinstance(command, Shutdown):
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

    def _answer_dead(self, command: Command) -> None:
        if isinstance(command, Shutdown):
            return
        with contextlib.suppress(InvalidStateError):  # answered already, or cancelled by its caller
            if isinstance(command, Add | ResetPrefixCache):
                command.future.set_exception(EngineDeadError(self.dead_message()))
            else:
                command.future.set_result(None)  # an abort still "succeeded": nothing runs any more

    def _take_commands(self, *, block: bool) -> list[Command]:
        """Every queued command; with `block`, wait for one first (see _wait_for_command)."""
        commands: list[Command] = []
        if block and (first := self._wait_for_command()) is not None:
            commands.append(first)
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _wait_for_command(self) -> Command | None:
        """Block until a command comes. Under tensor parallel, wake every _TP_CHECK_PERIOD seconds
        to look at the other ranks: one that died while the server is idle takes the engine down
        now (None returned, `dead` set), not at the next request. No group: one plain blocking get."""
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

    def _handle(self, command: Add | Abort | ResetPrefixCache) -> None:
        # An add whose caller was cancelled before we got here is skipped; an abort always runs.
        wanted = command.future.set_running_or_notify_cancel()
        if isinstance(command, Abort):
            outputs = self._abort_now(command.request_id)
            self._update_metrics(outputs)
            self._publish(outputs)
            if wanted:
                command.future.set_result(None)
            return
        if not wanted:
            return
        if isinstance(command, ResetPrefixCache):
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

    def _add_now(self, command: Add) -> None:
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
            if self.hung:
                return  # the watchdog answered everyone already

            reason = (
                str(e) if isinstance(e, EngineDeadError) else f"engine.step() raised {type(e).__name__}: {e}"
            )
            self._die(reason, e)
            return
        finally:
            self._step_started = None
        if self.hung:
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
        batch: list[tuple[StreamSink, Item]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # already ended (an abort raced a finish), or the engine died
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out if out.error is None else out.error))
        self._send(batch)

    def _send(self, batch: list[tuple[StreamSink, Item]]) -> None:
        if not batch or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is left to read them
            self._loop.call_soon_threadsafe(_deliver_all, batch)

    def _die(self, reason: str, exc: BaseException) -> None:
        """The engine cannot go on: refuse later commands, fail every open stream and every command
        taken or queued. Nothing can be queued after this: `dead` is set under `_lock`."""
        logger.error(
            "%s; the engine is dead, failing %d open requests", reason, len(self._streams), exc_info=exc
        )
        with self._lock:
            self.dead, self.dead_reason = True, reason
        self._send([(stream, EngineDeadError(self.dead_message())) for stream in self._streams.values()])
        self._streams.clear()
        unanswered = [*self._taken, *self._take_commands(block=False)]
        self._taken.clear()
        for command in unanswered:
            self._answer_dead(command)

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
        if self.metrics is None or self.dead:
            return
        try:
            self.metrics.observe_outputs(outputs, time.perf_counter())
            self.metrics.update_engine(self.engine)
        except Exception:  # metrics are worth a log line, never a dead engine
            logger.exception("updating the metrics failed")

    # ---- the watchdog thread ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Poll the step in progress; past step_timeout seconds, declare the engine hung."""
        assert self.step_timeout is not None
        period = min(1.0, self.step_timeout / 4)
        while not (self.closed or self.dead):
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
            if self.dead or self.closed:
                return
            self.hung = True
            self.dead, self.dead_reason = True, reason
        logger.error("%s; failing every open request", reason)
        for command in self._take_commands(block=False):
            self._answer_dead(command)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
                self._loop.call_soon_threadsafe(self._fail_open_streams)

    def _fail_open_streams(self) -> None:
        """On the event loop: every stream not yet finished gets the engine's death."""
        for stream in list(self.open_streams):
            stream._deliver(EngineDeadError(self.dead_message()))


def _deliver_all(batch: list[tuple[StreamSink, Item]]) -> None:
    for stream, item in batch:
        stream._deliver(item)
