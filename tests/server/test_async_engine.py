"""AsyncEngine and Metrics on the tiny random-weight engine: the engine-loop side of the server.

What is checked: concurrent streams give the synchronous LLM's greedy tokens; typed errors come
at add time (and leave nothing queued); the waiting-queue limit; aborts (explicit, `async with`
plus break, a cancelled consumer) free every KV block; the event loop keeps ticking through a
slow step; with restarts off, a step that raises kills the engine cleanly (streams and new
requests get EngineDeadError, the traceback is logged; the restarts themselves are
tests/server/test_supervisor.py's); shutdown ends open streams; the metrics add up; an idle engine
thread sleeps, and so does one whose waiting requests cannot be scheduled.
Each test runs its own event loop with asyncio.run (no pytest plugin needed).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from onecall.engine.engine import Engine, RequestOutput
from onecall.engine.scheduler import SchedulerOutput
from onecall.errors import ContextLengthExceededError, EngineDeadError, InvalidParameterError, QueueFullError
from onecall.llm import LLM
from onecall.sampling_params import SamplingParams
from onecall.server.async_engine import AsyncEngine, RequestStream
from onecall.server.metrics import Metrics
from tests.helpers.tiny_engine import tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # runs far longer than a test waits
PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fib(n):",
    "Once upon a time",
    "Hello",
    "a b c d e f",
]


def run(
    test: Callable[[AsyncEngine], Coroutine[Any, Any, None]], engine: Engine | None = None, **kw: Any
) -> None:
    """Start an AsyncEngine on a fresh loop, run `test`, always shut it down."""

    async def main() -> None:
        ae = AsyncEngine(engine or tiny_engine(), **kw)
        ae.start()
        try:
            await asyncio.wait_for(test(ae), timeout=60)
        finally:
            await ae.shutdown()

    asyncio.run(main())


async def collect(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} missing from the registry"
    return value


def test_concurrent_streams_match_the_synchronous_llm() -> None:
    expected = LLM(engine=tiny_engine()).generate(PROMPTS, GREEDY)

    async def body(ae: AsyncEngine) -> None:
        streams = await asyncio.gather(*(ae.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        results = await asyncio.gather(*(collect(s) for s in streams))
        for want, outs in zip(expected, results, strict=True):
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].token_ids == want.token_ids and outs[-1].text == want.text
            assert [t for o in outs for t in o.delta_token_ids] == want.token_ids  # deltas add up
            assert "".join(o.delta_text for o in outs) == want.text
            assert outs[-1].finish_reason == want.finish_reason
        assert ae.engine.block_manager.num_used_blocks == 0 and not ae.engine.has_unfinished_requests()

    run(body)


def test_typed_errors_at_add_time_leave_nothing_queued() -> None:
    async def body(ae: AsyncEngine) -> None:
        vocab = ae.engine.tokenizer.vocab_size
        with pytest.raises(InvalidParameterError) as e:
            await ae.add_request("bias", "hi", SamplingParams(logit_bias={vocab + 5: 1.0}))
        assert e.value.param == "logit_bias"
        with pytest.raises(InvalidParameterError) as e:
            await ae.add_request("ids", [1, vocab], GREEDY)
        assert e.value.param == "prompt"
        with pytest.raises(ContextLengthExceededError) as ctx:
            await ae.add_request("long", "hi", SamplingParams(max_tokens=ae.engine.max_model_len))
        assert ctx.value.max_model_len == ae.engine.max_model_len
        # all or nothing: the good requests before the bad one are withdrawn too
        with pytest.raises(InvalidParameterError):
            await ae.add_requests([("n0", "hi", LONG), ("n1", "there", LONG), ("n2", [vocab + 1], LONG)])
        assert not ae.engine.has_unfinished_requests() and ae.engine.block_manager.num_used_blocks == 0
        # the same ids are free again, and a good request still works
        streams = await ae.add_requests([("n0", "hi", GREEDY), ("n1", "there", GREEDY)])
        for s in streams:
            assert (await collect(s))[-1].finished

    run(body)


def test_queue_full_when_waiting_reaches_the_limit() -> None:
    async def body(ae: AsyncEngine) -> None:
        running = await ae.add_request("running", "hello", LONG)
        await running.__anext__()  # it holds the only running slot (max_num_seqs=1)
        waiting = [await ae.add_request(f"w{i}", "hello", GREEDY) for i in range(2)]
        with pytest.raises(QueueFullError) as e:
            await ae.add_request("refused", "hello", GREEDY)
        assert (e.value.num_waiting, e.value.max_waiting) == (2, 2) and e.value.retry_after >= 1
        await running.abort()  # frees the slot: the waiting two run to completion
        for s in waiting:
            assert (await collect(s))[-1].finish_reason in ("stop", "length")

    run(body, tiny_engine(max_num_seqs=1), max_waiting=2)


def test_abort_mid_stream_frees_blocks_and_is_idempotent() -> None:
    metrics = Metrics()

    async def body(ae: AsyncEngine) -> None:
        kv = ae.engine.block_manager
        stream = await ae.add_request("a", "The capital of France is", LONG)
        for _ in range(3):
            assert not (await stream.__anext__()).finished
        assert kv.num_used_blocks > 0
        await stream.abort()
        assert kv.num_used_blocks == 0 and not ae.engine.has_unfinished_requests()
        rest = await collect(stream)  # then the stream ends with the abort output
        assert rest[-1].finished and rest[-1].finish_reason == "abort" and len(rest[-1].token_ids) < 400
        await stream.abort()  # idempotent
        assert sample(metrics, "onecall_requests_running") == 0
        assert sample(metrics, "onecall_kv_cache_usage") == 0
        assert sample(metrics, "onecall_request_aborted_total") == 1

    run(body, metrics=metrics)


def test_async_with_aborts_on_break_and_on_cancellation() -> None:
    async def body(ae: AsyncEngine) -> None:
        kv = ae.engine.block_manager
        async with await ae.add_request("brk", "Once upon a time", LONG) as stream:
            async for out in stream:
                if len(out.token_ids) == 2:
                    break
        assert kv.num_used_blocks == 0 and stream.finished

        started = asyncio.Event()

        async def consumer() -> None:
            async with await ae.add_request("cancelled", "Once upon a time", LONG) as s:
                async for _ in s:
                    started.set()

        task = asyncio.create_task(consumer())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kv.num_used_blocks == 0 and not ae.engine.has_unfinished_requests()

    run(body)


def test_the_event_loop_keeps_ticking_through_a_slow_step() -> None:
    engine = tiny_engine()
    real_step = engine.step
    slow_once = threading.Event()

    def step() -> list[RequestOutput]:
        if not slow_once.is_set():
            slow_once.set()
            time.sleep(0.3)  # a step as slow as a big CPU prefill; would freeze a loop running it
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    # What is measured is the step off the loop thread, not the collector: late in a full test run
    # a full collection of this process's heap took 0.3 s once on the loop thread. The server freezes
    # its heap after loading for the same reason (server/state.py).
    gc.collect()
    gc.freeze()

    async def body(ae: AsyncEngine) -> None:
        done = asyncio.Event()
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        outs = await collect(
            await ae.add_request("long", "Hello", SamplingParams(max_tokens=150, ignore_eos=True))
        )
        done.set()
        await tick
        assert len(outs) == 150 and slow_once.is_set()
        assert len(gaps) >= 25, gaps  # the 0.3 s step alone spans ~30 ticks
        assert max(gaps) < 0.2, f"the loop stalled for {max(gaps):.3f} s"

    try:
        run(body, engine)
    finally:
        gc.unfreeze()


def test_with_restarts_off_a_step_that_raises_kills_the_engine_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = tiny_engine()
    real_step = engine.step
    calls = 0

    def step() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("boom: a bug in the step")
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        streams = [await ae.add_request(f"r{i}", "Hello", LONG) for i in range(2)]
        for s in streams:
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
            with pytest.raises(EngineDeadError):  # and again on the next read: no silent end
                await s.__anext__()
            await s.abort()  # a no-op, never an error, on a dead engine
        assert not ae.is_running and ae.dead_reason is not None
        assert "not restarted: restarts are turned off" in ae.dead_reason
        with pytest.raises(EngineDeadError):
            await ae.add_request("after", "Hello", GREEDY)

    with caplog.at_level(logging.ERROR, logger="onecall.server"):
        run(body, engine, max_restarts=0)
    logged = [r for r in caplog.records if r.name == "onecall.server" and r.exc_info]
    assert logged and "boom" in str(logged[0].exc_info[1])  # type: ignore[index]


def test_a_hung_step_is_declared_dead_by_the_watchdog(caplog: pytest.LogCaptureFixture) -> None:
    """A step that never returns (nothing raises): after step_timeout every open stream and every
    queued add gets EngineDeadError saying "hung", new requests are refused, and when the step finally
    returns its outputs are dropped and shutdown still completes."""
    engine = tiny_engine()
    real_step = engine.step
    release, stuck = threading.Event(), threading.Event()
    calls = 0

    def step() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        if calls == 3:
            stuck.set()
            release.wait(timeout=30)  # hangs until the test lets it go
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        stream = await ae.add_request("r", "Hello", LONG)
        await asyncio.to_thread(stuck.wait, 10)
        # an add queued behind the stuck step: the engine thread never takes it
        queued = asyncio.create_task(ae.add_request("queued", "Hello", GREEDY))
        with pytest.raises(EngineDeadError, match="hung"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="hung"):
            await queued
        assert not ae.is_running and ae.dead_reason is not None and "0.3 s" in ae.dead_reason
        assert "not restarted" in ae.dead_reason  # the thread that would rebuild it is stuck
        with pytest.raises(EngineDeadError):
            await ae.add_request("after", "Hello", GREEDY)
        release.set()  # the step returns late: nothing more reaches the stream
        await asyncio.sleep(0.2)
        with pytest.raises(EngineDeadError):
            await stream.__anext__()

    with caplog.at_level(logging.ERROR, logger="onecall.server"):
        run(body, engine, step_timeout=0.3)
    assert any("hung" in r.getMessage() for r in caplog.records if r.name == "onecall.server")


def test_the_watchdog_leaves_slow_but_finishing_steps_alone() -> None:
    engine = tiny_engine()
    real_step = engine.step

    def step() -> list[RequestOutput]:
        time.sleep(0.05)  # slow, well under the timeout
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        outs = await collect(
            await ae.add_request("r", "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
        )
        assert len(outs) == 8 and ae.is_running

    run(body, engine, step_timeout=1.0)
    with pytest.raises(InvalidParameterError, match="step_timeout"):
        AsyncEngine(tiny_engine(), step_timeout=0)


def test_shutdown_ends_open_streams_and_refuses_new_requests() -> None:
    async def main() -> None:
        ae = AsyncEngine(tiny_engine())
        ae.start()
        assert ae.is_running
        stream = await ae.add_request("a", "Hello", LONG)
        await stream.__anext__()
        await ae.shutdown()
        assert (await collect(stream))[-1].finish_reason == "abort"
        assert ae.engine.block_manager.num_used_blocks == 0 and not ae.is_running
        await ae.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            await ae.add_request("b", "Hello", GREEDY)

    asyncio.run(main())


def test_metrics_after_a_run() -> None:
    metrics = Metrics()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def body(ae: AsyncEngine) -> None:
        streams = await asyncio.gather(
            *(ae.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:3]))
        )
        finals = [(await collect(s))[-1] for s in streams]
        num_prompt = sum(f.num_prompt_tokens for f in finals)
        assert sample(metrics, "onecall_prompt_tokens_total") == num_prompt
        assert sample(metrics, "onecall_prefix_cache_query_tokens_total") == num_prompt
        assert sample(metrics, "onecall_prefix_cache_hit_tokens_total") == sum(
            f.num_cached_tokens for f in finals
        )
        assert sample(metrics, "onecall_generation_tokens_total") == 3 * 8
        assert sample(metrics, "onecall_request_success_total", finish_reason="length") == 3
        assert sample(metrics, "onecall_time_to_first_token_seconds_count") == 3
        assert sample(metrics, "onecall_e2e_request_latency_seconds_count") == 3
        assert sample(metrics, "onecall_inter_token_latency_seconds_count") == 3 * 7
        e2e_sum = sum(f.trace.e2e_time or 0.0 for f in finals)
        assert sample(metrics, "onecall_e2e_request_latency_seconds_sum") == pytest.approx(e2e_sum)
        for gauge in ("onecall_requests_running", "onecall_requests_waiting", "onecall_kv_cache_usage"):
            assert sample(metrics, gauge) == 0
        body_bytes, content_type = metrics.render()
        text = body_bytes.decode()
        assert content_type.startswith("text/plain")
        for name in ("onecall_requests_running", "onecall_kv_cache_usage", "onecall_prefix_cache_hit_tokens_total",
                     "onecall_time_to_first_token_seconds_bucket", "onecall_inter_token_latency_seconds_bucket",
                     "onecall_e2e_request_latency_seconds_bucket", "onecall_preemptions_total"):  # fmt: skip
            assert f"\n{name}" in text

    run(body, metrics=metrics)


def test_metrics_registries_are_independent() -> None:
    first, second = Metrics(), Metrics()  # no "Duplicated timeseries" from the global registry
    first.generation_tokens.inc(5)
    assert sample(second, "onecall_generation_tokens_total") == 0


def _idle_polls(engine: Engine, window_s: float) -> tuple[int, bool]:
    """After one request, how many times the engine thread checked for work during `window_s` of
    idleness, and whether the engine was still running then."""
    real_check = engine.has_unfinished_requests
    calls = 0

    def counted() -> bool:
        nonlocal calls
        calls += 1
        return real_check()

    engine.has_unfinished_requests = counted  # type: ignore[method-assign]
    seen: list[tuple[int, bool]] = []

    async def body(ae: AsyncEngine) -> None:
        nonlocal calls
        await collect(await ae.add_request("a", "Hello", GREEDY))
        await asyncio.sleep(0.05)  # let the thread settle into its idle wait
        calls = 0
        await asyncio.sleep(window_s)
        seen.append((calls, ae.is_running))

    run(body, engine)
    return seen[0]


def test_an_idle_engine_thread_sleeps() -> None:
    calls, _ = _idle_polls(tiny_engine(), 0.2)
    assert calls <= 1, f"the idle engine thread polled {calls} times in 0.2 s"


def test_an_engine_that_cannot_schedule_waits_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting request the scheduler cannot place (here: it schedules nothing at all, as when
    nothing runs and the request fits no free KV block) leaves the engine with unfinished work
    that no step advances: the thread waits on its queue between tries (10 to 50 ms) instead of
    spinning through empty steps, and a command (the abort) still reaches it."""
    engine = tiny_engine()
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: SchedulerOutput())
    real_step = engine.step
    steps = 0

    def step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        nonlocal steps
        stream = await ae.add_request("stuck", "Hello", GREEDY)
        await asyncio.sleep(0.1)  # into the longest wait
        steps = 0
        await asyncio.sleep(0.3)
        counted = steps
        # about 6 at one per 50 ms; a spinning thread makes thousands
        assert 1 <= counted <= 15, f"{counted} empty steps in 0.3 s"
        assert ae.is_running and ae.engine.num_waiting == 1 and not stream.finished
        await stream.abort()
        assert (await collect(stream))[-1].finish_reason == "abort"

    run(body, engine)


class _FakeGroup:
    """Stands in for engine/tp/workers.py's TensorParallelGroup as the engine thread sees it while idle:
    check_workers() polls the ranks, dead_reason names the one found gone. `kill()` makes rank 1 die."""

    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self.num_checks = 0
        self._killed = threading.Event()

    def kill(self) -> None:
        self._killed.set()

    def check_workers(self) -> None:
        self.num_checks += 1
        if self._killed.is_set() and self.dead_reason is None:
            self.dead_reason = "tensor-parallel rank 1 (pid 4242) exited with code -9; the engine stopped"

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_rank_that_dies_while_idle_kills_the_engine_without_a_request() -> None:
    """The idle thread polls the group about once a second: the death shows in dead_reason (what /health
    reports) within a few seconds, no request needed; later adds are refused naming the rank."""
    engine = tiny_engine()
    group = _FakeGroup()
    engine.parts.tp_group = group  # type: ignore[assignment]  # the runner stays single-process

    async def body(ae: AsyncEngine) -> None:
        outs = await collect(await ae.add_request("a", "Hello", GREEDY))
        assert outs[-1].finished and ae.is_running
        group.kill()
        t0 = time.monotonic()
        while ae.is_running and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert not ae.is_running, "a dead rank went unnoticed by the idle engine"
        assert time.monotonic() - t0 < 3 and group.num_checks >= 1
        dead = ae.dead_error()
        assert dead is not None and "tensor-parallel rank 1" in str(dead) and "code -9" in str(dead)
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            await ae.add_request("b", "Hello", GREEDY)

    run(body, engine)


@pytest.mark.slow
def test_without_a_group_the_idle_thread_never_wakes_to_check_ranks() -> None:
    """No tensor parallel: one blocking wait, no periodic wake-up (the same counter as above)."""
    engine = tiny_engine()
    assert engine.parts.tp_group is None
    calls, running = _idle_polls(engine, 1.3)  # longer than the TP check period
    assert calls == 0 and running
