"""EngineLoop: the thread that owns the Engine, the commands it takes, the supervisor that rebuilds
a stopped engine, and the step watchdog. The asyncio side (AsyncEngine, RequestStream) is
server/async_engine.py; the contract both keep is in its docstring; the commands it takes are in
server/engine_commands.py. This module is everything that runs off the event loop.

The loop: take every queued command, handle them in order, then one step while there is work.
It blocks on the queue when idle, and also, for a short wait that grows (_STALL_WAIT: 10 ms
doubling to 50 ms), after a step that scheduled nothing although requests are unfinished (a
waiting request that fits no free KV block while nothing runs): only a command (an abort, an
add) changes that, and a command ends the wait at once. Without the wait the thread would spin
through empty steps. Outputs go back to the event loop in one call_soon_threadsafe per step.

The supervisor (_fail). When the engine stops (step() raises EngineDeadError, or any Exception
escapes a step, the handling of a command or the loop), it is rebuilt in place if the budget
allows, at most `max_restarts` times in `restart_window` seconds:

    1. `restarting` is set under `_lock`: is_running False, /health 503 "restarting"
    2. Engine.restart(): every request it knows ends, fresh KV bookkeeping, scheduler and runner
       on the same weights (an empty prefix cache)
    3. `restarting` clears; the metrics count the restart and the outage
    4. every open stream gets EngineRestartingError (a retryable 503 with Retry-After): sent after
       the rebuild, so a retry finds the engine serving (and should the rebuild raise, they get
       EngineDeadError instead); the loop serves on

Commands keep queuing meanwhile and run on the fresh engine; a command whose handling raised is
answered (an add with EngineRestartingError), not retried. Otherwise the engine dies (_die), the
reason saying why it was not restarted: the budget is spent, tensor parallel (the other ranks
hold their own state: Engine.restart() refuses), or the restart itself raised. A BaseException
that is not an Exception (KeyboardInterrupt, SystemExit) kills it without a restart: the process
is going down.

Death (_die): `dead` is set under `_lock`, the lock `submit` queues under, so no command is
queued behind it unanswered; every open stream gets EngineDeadError, every command taken or
queued is answered. Under tensor parallel the idle wait wakes every _TP_CHECK_PERIOD seconds to
poll the other ranks (a rank that died while idle kills the engine now, not at the next request).

The watchdog (with step_timeout) polls the step in progress; past the timeout it declares the
engine hung. The stuck thread can answer nobody, so the watchdog answers the queued commands and
asks the event loop to fail every open stream (`open_streams`, the loop's own registry). A hung
engine is never restarted: the thread that would rebuild it is the one stuck in the step.
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
from collections.abc import Callable
from concurrent.futures import InvalidStateError

from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import (
    EngineDeadError,
    EngineRestartingError,
    EngineStepError,
    InvalidParameterError,
    QueueFullError,
    RequestFaultError,
)
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
_STALL_WAIT = (0.01, 0.05)  # seconds: the first and the longest wait after a step that scheduled nothing


class EngineLoop:
    """The engine thread, its supervisor and its watchdog; AsyncEngine submits commands to it (see
    the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        max_waiting: int,
        metrics: Metrics | None,
        step_timeout: float | None,
        max_restarts: int = 3,
        restart_window: float = 300.0,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.step_timeout = step_timeout
        self.max_restarts = max_restarts  # in place, within any restart_window seconds (the supervisor)
        self.restart_window = restart_window
        self._restart_times: deque[float] = deque()  # time.monotonic() of the restarts (engine thread)
        self.restarting = False  # an in-place restart is under way (set under _lock)
        self.restart_reason: str | None = None  # why the engine last stopped and was restarted
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

    def restarting_error(self) -> EngineRestartingError:
        return EngineRestartingError(self.restart_reason or "unknown")

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        """The thread: the loop below until shutdown. An Exception that escapes it goes to the
        supervisor (restart, then the loop again); a BaseException fails every waiter (_die)
        instead of leaving it hanging."""
        while not self.dead:
            try:
                self._loop_until_shutdown()
                return
            except Exception as e:  # a bug outside the step and the commands
                self._fail(f"the engine thread raised {type(e).__name__}: {e}", e)
            except BaseException as e:  # KeyboardInterrupt, SystemExit, ...: nobody above us would answer
                self._die(f"the engine thread stopped on {type(e).__name__}: {e}", e)

    def _loop_until_shutdown(self) -> None:
        """Commands first, then one step; block for commands when idle, wait a little after a step
        that scheduled nothing. Returns on shutdown or once dead (everything was answered then)."""
        self._update_metrics([])  # initial gauges
        stall_wait = 0.0  # seconds to wait for a command before the next step (0: step at once)
        while not self.dead:
            busy = self.engine.has_unfinished_requests()
            self._taken.extend(self._take_commands(timeout=stall_wait if busy else None))
            while self._taken and not self.dead:
                command = self._taken[0]  # stays in _taken while handled: _die answers it if need be
                if isinstance(command, Shutdown):
                    self._taken.clear()  # nothing is queued behind it
                    self._shutdown_now()
                    return
                try:
                    self._handle(command)
                except Exception as e:  # a bug outside the engine's typed errors
                    self._fail(f"handling {type(command).__name__} raised {type(e).__name__}: {e}", e)
                    if self.dead:
                        return
                    self._answer(command, self.restarting_error())  # not retried on the fresh engine
                self._taken.popleft()
            if self.dead or not self.engine.has_unfinished_requests():
                continue
            scheduled = self._step()
            # nothing scheduled: wait for a command that changes that (backing off), not spin
            stall_wait = 0.0 if scheduled else min(max(2 * stall_wait, _STALL_WAIT[0]), _STALL_WAIT[1])

    def _answer_dead(self, command: Command) -> None:
        self._answer(command, EngineDeadError(self.dead_message()))

    @staticmethod
    def _answer(command: Command, error: EngineDeadError) -> None:
        """Answer a command the engine will not handle: an add or a reset with `error`, an abort with
        None (it still "succeeded": the request runs no more)."""
        if isinstance(command, Shutdown):
            return
        with contextlib.suppress(InvalidStateError):  # answered already, or cancelled by its caller
            if isinstance(command, Add | ResetPrefixCache):
                command.future.set_exception(error)
            else:
                command.future.set_result(None)

    def _take_commands(self, *, timeout: float | None) -> list[Command]:
        """Every queued command; with a timeout other than 0, wait for one first (up to `timeout`
        seconds, None: until one comes; see _wait_for_command)."""
        commands: list[Command] = []
        if timeout != 0 and (first := self._wait_for_command(timeout)) is not None:
            commands.append(first)
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _wait_for_command(self, timeout: float | None) -> Command | None:
        """Block until a command comes or `timeout` seconds pass (None then; timeout None: no
        limit). Under tensor parallel, wake every _TP_CHECK_PERIOD seconds to look at the other
        ranks: one that died while the server is idle takes the engine down now (None returned,
        `dead` set), not at the next request. No group: one plain blocking get."""
        group = self.engine.parts.tp_group
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if group is None else _TP_CHECK_PERIOD
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            try:
                return self._commands.get(timeout=wait)
            except queue.Empty:
                pass
            if group is not None:
                group.check_workers()  # polls the worker processes; no collective, no step
                if group.dead_reason is not None:
                    self._fail(group.dead_reason, EngineDeadError(group.dead_reason))  # TP: no restart
                    return None
            if deadline is not None and time.monotonic() >= deadline:
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

    def _step(self) -> bool:
        """One engine step, its outputs published; False when it scheduled nothing (Engine.step
        counts only the steps that scheduled a batch)."""
        num_steps = self.engine.stats.num_steps_total
        failure: Exception | None = None
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            failure = e
        finally:
            self._step_started = None  # before a restart, which the watchdog must not time
        if self.hung:
            return True  # a step the watchdog gave up on came back: everyone was answered already
        if failure is not None:
            if isinstance(failure, EngineDeadError):  # the engine's own reason (engine/engine.py)
                self._fail(str(failure), failure)
            else:
                self._fail(f"engine.step() raised {type(failure).__name__}: {failure}", failure)
            return True
        self._log_faults(outputs)
        self._update_metrics(outputs)  # first, so a consumer that sees an output sees its metrics
        self._publish(outputs)
        return self.engine.stats.num_steps_total != num_steps

    @staticmethod
    def _log_faults(outputs: list[RequestOutput]) -> None:
        """One line (and the traceback) per failed step, however many requests it failed; a request
        ended for its own reasons (RequestFaultError) gets a warning line of its own, no traceback
        when its parameters were the cause."""
        step: list[EngineStepError] = []
        for out in outputs:
            e = out.error
            if isinstance(e, RequestFaultError):
                logger.warning("request %s: %s", out.request_id, e, exc_info=e.cause if e.param is None else None)
            elif e is not None:
                step.append(e)
        if step:
            logger.error("%s; failed its %d requests, serving on", step[0], len(step), exc_info=step[0].cause)

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

    # ---- the supervisor --------------------------------------------------------------------------
    def _fail(self, reason: str, exc: Exception) -> None:
        """The engine stopped: rebuild it in place if the budget allows, else _die (module docstring)."""
        refusal = self._restart_refusal()
        if refusal is not None:
            self._die(f"{reason} (not restarted: {refusal})", exc)
            return
        self._restart(reason, exc)

    def _restart_refusal(self) -> str | None:
        """Why the engine may not be rebuilt now; None when it may."""
        if self.closed:
            return "the server is shutting down"
        if self.engine.parts.tp_group is not None:
            return "a tensor-parallel engine cannot restart in place"
        if self.max_restarts == 0:
            return "restarts are turned off"
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.restart_window:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            return f"the budget of {self.max_restarts} restarts in {self.restart_window:g} s is spent"
        return None

    def _restart(self, reason: str, exc: Exception) -> None:
        """Steps 1-4 of the module docstring; a restart that raises kills the engine."""
        started = time.monotonic()
        num_open = len(self._streams)
        logger.error("%s; restarting the engine, failing %d open requests", reason, num_open, exc_info=exc)
        with self._lock:
            self.restart_reason, self.restarting = reason, True
        self._observe(lambda m: m.engine_restarting.set(1))
        try:
            outputs = self.engine.restart()
        except Exception as e:  # the open streams get EngineDeadError
            self._die(f"{reason}; restarting the engine raised {type(e).__name__}: {e}", e)
            return
        self._restart_times.append(time.monotonic())
        outage = time.monotonic() - started
        failed = list(self._streams)
        self._observe(lambda m: m.observe_restart(outputs, failed, reason, outage, time.perf_counter()))
        with self._lock:
            self.restarting = False
        self._update_metrics([])
        self._send([(stream, self.restarting_error()) for stream in self._streams.values()])
        self._streams.clear()
        num, most, window = len(self._restart_times), self.max_restarts, self.restart_window
        logger.warning(
            "the engine restarted in %.3f s (%d of %d in %g s); serving again", outage, num, most, window
        )

    def _die(self, reason: str, exc: BaseException) -> None:
        """The engine cannot go on: refuse later commands, fail every open stream and every command
        taken or queued. Nothing can be queued after this: `dead` is set under `_lock`."""
        logger.error(
            "%s; the engine is dead, failing %d open requests", reason, len(self._streams), exc_info=exc
        )
        with self._lock:
            self.dead, self.dead_reason, self.restarting = True, reason, False
        self._observe(lambda m: m.engine_restarting.set(0))
        self._send([(stream, EngineDeadError(self.dead_message())) for stream in self._streams.values()])
        self._streams.clear()
        unanswered = [*self._taken, *self._take_commands(timeout=0)]
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
        if not self.dead:
            self._observe(lambda m: m.observe_outputs(outputs, time.perf_counter()))
            self._observe(lambda m: m.update_engine(self.engine))

    def _observe(self, update: Callable[[Metrics], None]) -> None:
        """Apply `update` to the metrics, if any; a failure is worth a log line, never a dead engine."""
        if self.metrics is None:
            return
        try:
            update(self.metrics)
        except Exception:
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
            "the engine is hung (not restarted: its thread is stuck in the step)"
        )
        with self._lock:
            if self.dead or self.closed:
                return
            self.hung = True
            self.dead, self.dead_reason = True, reason
        logger.error("%s; failing every open request", reason)
        for command in self._take_commands(timeout=0):
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
