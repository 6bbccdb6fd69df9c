"""The supervisor: an engine that stops is rebuilt in place on the same weights, within a budget.

Over the tiny random-weight engine, through the AsyncEngine and the in-process server app. Two
model-forward faults in a row stop the engine: the first step's requests get their EngineStepError,
the second's (and every other open stream) the retryable EngineRestartingError (on the wire a 503
with Retry-After, or an error event, code engine_restarting); /health answers 503 "restarting"
while the rebuild runs and 200 after it; /metrics counts the restart and the outage; then every
prompt runs to exactly the tokens a fresh engine gives. A command whose handling raised is
answered, not retried. What is not restarted: past the budget (it refills after the window),
under tensor parallel; each stays dead as before, the reason saying why.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

import onecall.engine.engine as engine_module
from onecall.engine.engine import RequestOutput
from onecall.errors import EngineDeadError, EngineStepError, InvalidParameterError
from onecall.sampling_params import SamplingParams
from onecall.server.async_engine import AsyncEngine, EngineRestartingError, RequestStream
from onecall.server.metrics import Metrics
from tests.engine.test_faults import (
    IDS,
    LONG,
    PROMPTS,
    Fault,
    InjectedFault,
    assert_pool_drains,
    completion,
    fault_free,
    in_process,
    inject,
    params,
    run,
    streamed,
)
from tests.helpers.server_process import assert_error, metric
from tests.helpers.tiny_engine import run_all, tiny_engine
from tests.server.test_async_engine import _FakeGroup


async def outcome(stream: RequestStream) -> list[int] | EngineStepError | EngineDeadError:
    """The request's tokens, or the error its stream raised."""
    outs: list[RequestOutput] = []
    try:
        async for out in stream:
            outs.append(out)
    except (EngineStepError, EngineDeadError) as e:
        return e
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")
    return outs[-1].token_ids


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, f"{name} missing from the registry"
    return value


# ---- a stopped engine comes back -----------------------------------------------------------------------
def test_two_faults_in_a_row_restart_the_engine_and_it_serves_again(monkeypatch: pytest.MonkeyPatch) -> None:
    want = fault_free()
    engine = tiny_engine(max_num_seqs=2)
    fault = Fault(engine, lambda out: True, repeat=True)  # every step fails until the rebuild, which
    inject("forward", engine, fault, monkeypatch)  # replaces the runner and scheduler it patches
    metrics = Metrics()

    async def body(ae: AsyncEngine) -> None:
        streams = await ae.add_requests([(rid, PROMPTS[i], params(i)) for i, rid in enumerate(IDS[:4])])
        got = dict(zip(IDS[:4], await asyncio.gather(*(outcome(s) for s in streams)), strict=True))
        # 1. the first step's two fail with the fault; the second step's two stop the engine
        assert fault.batches == [{"r0", "r1"}, {"r2", "r3"}]
        for rid in ("r0", "r1"):
            err = got[rid]
            assert isinstance(err, EngineStepError) and not isinstance(err, EngineDeadError)
            assert err.stage == "model forward" and isinstance(err.cause, InjectedFault)
        for rid in ("r2", "r3"):
            err = got[rid]
            assert isinstance(err, EngineRestartingError) and err.retry_after >= 1
            assert "right after another fault" in str(err) and "is restarting; retry" in str(err)
        # 2. it serves again: every prompt to its fault-free tokens, the faulty ones included
        assert ae.is_running and ae.dead_reason is None and ae.dead_error() is None
        again = await ae.add_requests([(f"again-{rid}", PROMPTS[i], params(i)) for i, rid in enumerate(IDS)])
        results = await asyncio.gather(*(outcome(s) for s in again))
        assert dict(zip(IDS, results, strict=True)) == want
        # 3. the metrics: one restart, its outage, why; the four requests failed
        assert sample(metrics, "onecall_engine_restarts_total") == 1
        assert sample(metrics, "onecall_engine_restarting") == 0
        assert 0 < sample(metrics, "onecall_engine_last_outage_seconds") < 10
        assert sample(metrics, "onecall_request_failed_total") == 4
        (info,) = [
            s for m in metrics.registry.collect() for s in m.samples if s.name.endswith("restart_info")
        ]
        assert "right after another fault" in info.labels["reason"]

    run(body, engine, metrics=metrics)
    assert_pool_drains(engine)


def test_on_the_wire_a_restart_is_a_retryable_503_and_health_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params16 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    fresh = run_all(tiny_engine(), {"r0": PROMPTS[0]}, params16)["r0"].text
    engine = tiny_engine(max_num_seqs=2)
    armed = threading.Event()
    fault = Fault(engine, lambda out: armed.is_set(), repeat=True)
    inject("forward", engine, fault, monkeypatch)
    entered, release = threading.Event(), threading.Event()
    real_restart = engine.restart

    def restart() -> list[RequestOutput]:  # holds the rebuild open while the test looks
        entered.set()
        release.wait(timeout=30)
        return real_restart()

    engine.restart = restart  # type: ignore[method-assign]
    long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def test(client: httpx.AsyncClient) -> None:
        # 1. four requests in flight: two run, two wait (max_num_seqs=2); then the faults
        streams = [False, True, False, True]
        body = [{**completion(i, s), **long} for i, s in enumerate(streams)]
        pending = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in body]
        t0 = time.monotonic()
        while (engine.num_running, engine.num_waiting) != (2, 2) and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)
        assert (engine.num_running, engine.num_waiting) == (2, 2)
        armed.set()  # the running two fail; the waiting two run next, fail too: the engine stops
        assert await asyncio.to_thread(entered.wait, 10)
        # 2. during the rebuild: 503 "restarting" with Retry-After, on /health and on a request
        r = await client.get("/health")
        err = assert_error(r, 503, type="service_unavailable_error", code="engine_restarting")
        assert "restarting" in err["message"] and int(r.headers["retry-after"]) >= 1
        r = await client.post("/v1/completions", json=completion(0, False))
        assert_error(r, 503, type="service_unavailable_error", code="engine_restarting")
        assert metric((await client.get("/metrics")).text, "onecall_engine_restarting") == 1
        release.set()
        # 3. the requests in flight: two failed with the fault (500 or an error event), two were cut
        #    off by the restart (a 503 with Retry-After, or an error event), all retryable
        codes = []
        for r, is_stream in zip(await asyncio.gather(*pending), streams, strict=True):
            if is_stream:
                _, error = streamed(r)
                assert error is not None
                codes.append(error["code"])
            elif r.status_code == 500:
                codes.append(assert_error(r, 500, type="server_error")["code"])
            else:
                codes.append(assert_error(r, 503, type="service_unavailable_error")["code"])
                assert int(r.headers["retry-after"]) >= 1
        assert sorted(codes) == ["engine_restarting"] * 2 + ["engine_step_failed"] * 2
        assert len(fault.batches) == 2
        # 4. after it: /health 200, and a request gets what a fresh engine gives
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json=completion(0, False))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == fresh
        text = (await client.get("/metrics")).text
        assert metric(text, "onecall_engine_restarts_total") == 1
        assert metric(text, "onecall_engine_restarting") == 0
        assert metric(text, "onecall_engine_last_outage_seconds") > 0
        assert "onecall_engine_last_restart_info{reason=" in text

    in_process(test, AsyncEngine(engine, metrics=Metrics()))
    assert_pool_drains(engine)


def test_a_command_whose_handling_raised_is_answered_and_the_engine_restarts() -> None:
    engine = tiny_engine()
    real_reset, calls = engine.reset_prefix_cache, [0]

    def reset_prefix_cache() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug in reset")
        real_reset()

    engine.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        running = await ae.add_request("running", "Hello", LONG)
        await running.__anext__()
        with pytest.raises(EngineRestartingError, match="handling ResetPrefixCache raised RuntimeError"):
            await ae.reset_prefix_cache()
        with pytest.raises(EngineRestartingError):
            async for _ in running:
                pass
        await ae.reset_prefix_cache()  # the fresh engine handles it
        outs = [out async for out in await ae.add_request("after", "Hello", params(1))]
        assert outs[-1].finish_reason == "length" and ae.is_running

    run(body, engine)
    assert_pool_drains(engine)


# ---- what stays dead -----------------------------------------------------------------------------------
def always_failing_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler that raises at every step, on the old engine and on the rebuilt one alike."""

    def sample(*args: Any, **kwargs: Any) -> Any:
        raise InjectedFault("injected fault")

    monkeypatch.setattr(engine_module, "sample", sample)


async def stop_engine(ae: AsyncEngine, tag: str) -> Any:
    """Two requests, one at a time (max_num_seqs=1): the first step fails the first, the next step
    the second, which stops the engine. Returns what the second stream raised."""
    first, second = await ae.add_requests([(f"{tag}0", "Hello", LONG), (f"{tag}1", "Hi", LONG)])
    assert isinstance(await outcome(first), EngineStepError)
    return await outcome(second)


@pytest.mark.slow
def test_past_the_restart_budget_the_engine_stays_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    always_failing_sampler(monkeypatch)
    metrics = Metrics()

    async def body(ae: AsyncEngine) -> None:
        assert isinstance(await stop_engine(ae, "a"), EngineRestartingError)  # 1 of 1 in the window
        await asyncio.sleep(1.1)  # the window passes: the budget is back
        assert isinstance(await stop_engine(ae, "b"), EngineRestartingError)
        dead = await stop_engine(ae, "c")  # the second within the window: no more
        assert isinstance(dead, EngineDeadError) and not isinstance(dead, EngineRestartingError)
        assert "not restarted: the budget of 1 restarts in 1 s is spent" in str(dead)
        assert "restart the server" in str(dead)
        assert not ae.is_running and ae.dead_reason is not None
        assert type(ae.dead_error()) is EngineDeadError
        with pytest.raises(EngineDeadError, match="budget") as e:
            await ae.add_request("after", "Hello", LONG)
        assert not isinstance(e.value, EngineRestartingError)
        assert sample(metrics, "onecall_engine_restarts_total") == 2

    run(body, tiny_engine(max_num_seqs=1), metrics=metrics, max_restarts=1, restart_window=1.0)


def test_under_tensor_parallel_a_stopped_engine_stays_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    always_failing_sampler(monkeypatch)
    engine = tiny_engine(max_num_seqs=1)
    engine.parts.tp_group = _FakeGroup()  # type: ignore[assignment]  # the runner stays single-process

    async def body(ae: AsyncEngine) -> None:
        dead = await stop_engine(ae, "a")
        assert isinstance(dead, EngineDeadError) and not isinstance(dead, EngineRestartingError)
        assert "not restarted: a tensor-parallel engine cannot restart in place" in str(dead)
        assert not ae.is_running

    run(body, engine)


def test_the_restart_settings_are_checked() -> None:
    for kw in ({"max_restarts": -1}, {"max_restarts": True}, {"restart_window": 0}):
        with pytest.raises(InvalidParameterError, match=next(iter(kw))):
            AsyncEngine(tiny_engine(), **kw)  # type: ignore[arg-type]
