"""Faults: a step that raises fails only the requests of its batch, and the engine serves on.

Faults are injected with monkeypatch at each stage of a step (the model forward, the sampler, the
grammar's mask fill and its advance, the detokenizer) while several requests are in flight, through
the AsyncEngine and through the in-process server app, over the tiny random-weight engine. A fault
in a request's own grammar or detokenizer ends that request alone (a RequestFaultError), even in
consecutive steps. A fault in the forward or the sampler: the requests of the failing step's batch
get an EngineStepError naming the stage and the cause (on the wire a 500 body or an error event), every other request finishes with exactly its
fault-free greedy tokens, the failed prompts run again to their fault-free tokens (the forward's
fault leaves garbage in the KV it wrote: none of it entered the prefix cache), and the KV pool
drains to all-free. Then what does stop the engine: a fault in the step right after a recovery,
books found inconsistent, a BaseException on the engine thread (each: EngineDeadError, 503, and
/health saying why, when restarts are off or, for the BaseException, always; the in-place restart
is tests/server/test_supervisor.py's); and an n > 1 request counts as n against the waiting-queue limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest
import torch

import onecall.engine.engine as engine_module
from onecall.engine.engine import Engine, RequestOutput
from onecall.engine.scheduler import SchedulerOutput
from onecall.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidParameterError,
    QueueFullError,
    RequestFaultError,
)
from onecall.llm import LLM
from onecall.sampling.grammar_constraint import GrammarConstraint
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from onecall.server.app import create_app
from onecall.server.async_engine import AsyncEngine, RequestStream
from onecall.server.metrics import Metrics
from onecall.text.detokenizer import IncrementalDetokenizer
from tests.helpers.server_process import assert_error, sse_payloads
from tests.helpers.tiny_engine import run_all, tiny_engine

PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fib(n):",
    "Once upon a time",
    "Hello there",
    "a b c d e f",
]
IDS = [f"r{i}" for i in range(len(PROMPTS))]
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # runs far longer than a test waits


def params(i: int, grammar: bool = False) -> SamplingParams:
    """Request i: greedy, staggered lengths (so a new prompt joins requests that decode); with
    `grammar`, the odd ones are constrained by a regex."""
    so = StructuredOutputsParams(regex="[a-z ]{60}") if grammar and i % 2 else None
    return SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True, structured_outputs=so)


def fault_free(grammar: bool = False) -> dict[str, list[int]]:
    finals = run_all(
        tiny_engine(max_num_seqs=3),
        dict(zip(IDS, PROMPTS, strict=True)),
        {rid: params(i, grammar) for i, rid in enumerate(IDS)},
    )
    return {rid: out.token_ids for rid, out in finals.items()}


# ---- fault injection -----------------------------------------------------------------------------------
class InjectedFault(RuntimeError):
    pass


class Fault:
    """Wraps the engine's scheduler to see each step's batch; `check()`, called from the patched
    stage, raises InjectedFault at the first call in a step whose batch `fires_on` accepts (then at
    every later call if `repeat`). `batches` lists the request ids of each batch it failed."""

    def __init__(
        self, engine: Engine, fires_on: Callable[[SchedulerOutput], bool], *, repeat: bool = False
    ) -> None:
        self.fires_on, self.repeat = fires_on, repeat
        self.batches: list[set[str]] = []
        self._ids: set[str] = set()
        self._armed = False
        real = engine.scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = real()
            self._ids = {s.seq.request_id for s in out.scheduled}
            if self.batches:  # fired already: again only with `repeat`, then at every step
                self._armed = self.repeat and bool(out.scheduled)
            else:
                self._armed = bool(out.scheduled) and self.fires_on(out)
            return out

        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    def check(self) -> None:
        if self._armed:
            self._armed = False  # once per step
            self.batches.append(self._ids)
            raise InjectedFault("injected fault")


def mixed(out: SchedulerOutput) -> bool:
    """A prompt being prefilled in the same step as a request that decodes."""
    kinds = {s.seq.is_prefilling for s in out.scheduled}
    return kinds == {True, False}


class FaultyModel:
    """The runner's model: the real forward, then, on a fault, garbage over the K/V this step wrote
    (a half-written cache) and the error."""

    def __init__(self, model: Any, fault: Fault) -> None:
        self.model, self.fault = model, fault

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: Any) -> Any:
        hidden = self.model(input_ids, positions, kv_cache, meta)
        try:
            self.fault.check()
        except InjectedFault:
            kv_cache.k[:, meta.slot_mapping] = 50.0
            kv_cache.v[:, meta.slot_mapping] = -50.0
            raise
        return hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def inject(stage: str, engine: Engine, fault: Fault, monkeypatch: pytest.MonkeyPatch) -> str:
    """Patch `stage` to call fault.check(); returns the stage name the error should carry."""
    if stage == "forward":
        monkeypatch.setattr(engine.runner, "model", FaultyModel(engine.runner.model, fault))
        return "model forward"
    if stage == "sampler":
        real_sample = engine_module.sample

        def sample(*args: Any, **kwargs: Any) -> Any:
            fault.check()
            return real_sample(*args, **kwargs)

        monkeypatch.setattr(engine_module, "sample", sample)
        return "sampler"
    if stage == "grammar mask":  # runs on the mask-prefetch worker; the sampler re-raises it
        real_fill = GrammarConstraint.fill_bitmask

        def fill_bitmask(self: GrammarConstraint, bitmask: torch.Tensor, row: int) -> bool:
            fault.check()
            return real_fill(self, bitmask, row)

        monkeypatch.setattr(GrammarConstraint, "fill_bitmask", fill_bitmask)
        return "grammar"
    if stage == "grammar advance":
        real_advance = GrammarConstraint.advance

        def advance(self: GrammarConstraint, token_id: int) -> None:
            fault.check()
            real_advance(self, token_id)

        monkeypatch.setattr(GrammarConstraint, "advance", advance)
        return "grammar"
    assert stage == "detokenizer"
    real_add = IncrementalDetokenizer.add

    def add(self: IncrementalDetokenizer, token_id: int) -> str:
        fault.check()
        return real_add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    return "detokenizer"


# ---- driving the AsyncEngine --------------------------------------------------------------------------
def run(test: Callable[[AsyncEngine], Coroutine[Any, Any, None]], engine: Engine, **kw: Any) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine, **kw)
        ae.start()
        try:
            await asyncio.wait_for(test(ae), timeout=60)
        finally:
            await ae.shutdown()

    asyncio.run(main())


async def outcome(stream: RequestStream) -> list[int] | EngineStepError:
    """The request's tokens, or the EngineStepError its stream raised."""
    outs: list[RequestOutput] = []
    try:
        async for out in stream:
            outs.append(out)
    except EngineStepError as e:
        return e
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")
    return outs[-1].token_ids


async def drive(ae: AsyncEngine, items: list[tuple[str, str, SamplingParams]]) -> dict[str, Any]:
    streams = await ae.add_requests(items)  # all in flight at once
    results = await asyncio.gather(*(outcome(s) for s in streams))
    return {rid: r for (rid, _, _), r in zip(items, results, strict=True)}


def assert_pool_drains(engine: Engine) -> None:
    kv = engine.block_manager
    assert kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    kv.check_invariants()
    engine.reset_prefix_cache()
    assert kv.num_free_blocks == kv.num_blocks


# ---- one fault: only its batch fails ----------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["forward", "sampler"])
def test_a_failed_step_fails_only_its_batch(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    grammar = stage.startswith("grammar")
    want = fault_free(grammar)
    engine = tiny_engine(max_num_seqs=3)
    fault = Fault(engine, mixed)
    stage_name = inject(stage, engine, fault, monkeypatch)
    metrics = Metrics()

    async def body(ae: AsyncEngine) -> None:
        got = await drive(ae, [(rid, PROMPTS[i], params(i, grammar)) for i, rid in enumerate(IDS)])
        # 1. exactly the failing step's batch failed, each with the stage and the cause
        assert len(fault.batches) == 1, "the fault fired once"
        failed = {rid for rid, r in got.items() if isinstance(r, EngineStepError)}
        assert failed == fault.batches[0] and len(failed) >= 2 and failed != set(IDS)
        for rid in failed:
            err = got[rid]
            assert err.stage == stage_name and isinstance(err.cause, InjectedFault)
            assert str(err) == f"the engine step failed in the {stage_name}: InjectedFault: injected fault"
        # 2. the others: exactly their fault-free tokens
        assert {rid: got[rid] for rid in set(IDS) - failed} == {rid: want[rid] for rid in set(IDS) - failed}
        # 3. the engine serves on: the failed prompts again, to their fault-free tokens
        again = [(f"again-{rid}", PROMPTS[IDS.index(rid)], params(IDS.index(rid), grammar)) for rid in failed]
        assert await drive(ae, again) == {f"again-{rid}": want[rid] for rid in failed}
        assert ae.is_running and ae.dead_reason is None
        failures = metrics.registry.get_sample_value("onecall_request_failed_total")
        assert failures == len(failed)

    run(body, engine, metrics=metrics)
    assert_pool_drains(engine)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grammar mask", "grammar advance", "detokenizer"])
def test_a_request_fault_ends_that_request_alone(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's own grammar or detokenizer raising ends that request (a RequestFaultError naming the
    stage), not its batch; two such faults in a row do not stop the engine."""
    grammar = stage.startswith("grammar")
    want = fault_free(grammar)
    engine = tiny_engine(max_num_seqs=3)
    fault = Fault(engine, mixed, repeat=True)  # two faults in consecutive steps, then no more
    real_check = fault.check

    def check_twice() -> None:
        try:
            real_check()
        finally:
            fault.repeat = len(fault.batches) < 2

    fault.check = check_twice  # type: ignore[method-assign]
    stage_name = inject(stage, engine, fault, monkeypatch)

    async def body(ae: AsyncEngine) -> None:
        got = await drive(ae, [(rid, PROMPTS[i], params(i, grammar)) for i, rid in enumerate(IDS)])
        failed = {rid for rid, r in got.items() if isinstance(r, EngineStepError)}
        assert len(fault.batches) == len(failed) == 2  # one request per firing step
        for rid in failed:
            err = got[rid]
            assert isinstance(err, RequestFaultError) and err.stage == stage_name
            assert isinstance(err.cause, InjectedFault)
            assert str(err) == f"the request was ended in the {stage_name}: injected fault"
        assert {rid: got[rid] for rid in set(IDS) - failed} == {rid: want[rid] for rid in set(IDS) - failed}
        assert ae.is_running and ae.dead_reason is None

    run(body, engine)
    assert_pool_drains(engine)


def test_the_llm_facade_raises_the_step_error_and_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    want = fault_free()
    engine = tiny_engine(max_num_seqs=3)
    fault = Fault(engine, lambda out: True)
    inject("sampler", engine, fault, monkeypatch)
    llm = LLM(engine=engine)
    with pytest.raises(EngineStepError) as e:
        llm.generate(PROMPTS[:3], params(2))
    assert e.value.stage == "sampler" and isinstance(e.value.__cause__, InjectedFault)
    assert engine.block_manager.num_used_blocks == 0  # the others of the call were aborted
    outs = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outs] == [want[rid] for rid in IDS]
    assert_pool_drains(engine)


# ---- what stops the engine --------------------------------------------------------------------------------
def test_a_fault_right_after_a_recovery_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(max_num_seqs=2)
    fault = Fault(engine, lambda out: True, repeat=True)
    inject("forward", engine, fault, monkeypatch)
    for i, rid in enumerate(IDS[:4]):
        engine.add_request(rid, PROMPTS[i], params(i))
    outs = engine.step()  # r0 and r1 fail; r2, r3 wait
    assert {o.request_id for o in outs} == {"r0", "r1"} and all(o.finish_reason == "error" for o in outs)
    assert all(isinstance(o.error, EngineStepError) and o.error.stage == "model forward" for o in outs)
    with pytest.raises(EngineDeadError) as e:
        engine.step()  # r2 and r3: the same fault again
    assert "right after another fault" in str(e.value) and "InjectedFault" in str(e.value)
    with pytest.raises(EngineDeadError):  # and on every later call
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", "Hello", params(0))


def test_inconsistent_books_after_a_fault_stop_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine()

    def execute(batch: Any) -> torch.Tensor:
        engine.block_manager.pool.refcount[0] += 1  # the fault leaves a block counted twice, too
        raise InjectedFault("injected fault")

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("a", "Hello", params(0))
    with pytest.raises(EngineDeadError) as e:
        engine.step()
    assert "model forward: InjectedFault" in str(e.value) and "left the bookkeeping inconsistent" in str(
        e.value
    )
    with pytest.raises(EngineDeadError):
        engine.step()


def test_a_step_that_stops_the_engine_fails_every_waiter() -> None:
    class Fatal(BaseException):
        pass

    engine = tiny_engine(max_num_seqs=2)
    real_step = engine.step
    calls = 0

    def step() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Fatal("out of the blue")
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        streams = await ae.add_requests([(rid, PROMPTS[i], LONG) for i, rid in enumerate(IDS[:4])])
        for s in streams:  # running and waiting alike: failed, none left hanging
            with pytest.raises(EngineDeadError) as e:
                async for _ in s:
                    pass
            assert "Fatal: out of the blue" in str(e.value)
        assert not ae.is_running and ae.dead_reason is not None and "Fatal" in ae.dead_reason
        with pytest.raises(EngineDeadError) as e:
            await ae.add_request("after", "Hello", LONG)
        assert "Fatal" in str(e.value)

    run(body, engine)


def test_a_base_exception_while_adding_answers_the_add() -> None:
    class Fatal(BaseException):
        pass

    engine = tiny_engine()
    real_add = engine.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        if request_id == "poison":
            raise Fatal("in add_request")
        real_add(request_id, *args, **kwargs)

    engine.add_request = add_request  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> None:
        running = await ae.add_request("running", "Hello", LONG)
        await running.__anext__()
        with pytest.raises(EngineDeadError) as e:
            await ae.add_request("poison", "Hello", LONG)
        assert "Fatal: in add_request" in str(e.value)
        with pytest.raises(EngineDeadError):
            async for _ in running:
                pass
        with pytest.raises(EngineDeadError):
            await ae.add_request("after", "Hello", LONG)

    run(body, engine)


# ---- n > 1 against the waiting limit ----------------------------------------------------------------------
def test_n_choices_count_as_n_waiting_requests() -> None:
    async def body(ae: AsyncEngine) -> None:
        running = await ae.add_request("running", "Hello", LONG)
        await running.__anext__()  # it holds the only running slot (max_num_seqs=1)
        waiting = await ae.add_request("w0", "Hello", LONG)
        with pytest.raises(QueueFullError) as e:  # 1 waiting + 3 > 3
            await ae.add_requests([(f"n{i}", "Hello", LONG) for i in range(3)])
        assert (e.value.num_waiting, e.value.num_requested) == (1, 3)
        with pytest.raises(InvalidParameterError) as invalid:  # could never fit: not a retry
            await ae.add_requests([(f"m{i}", "Hello", LONG) for i in range(4)])
        assert invalid.value.param == "n"
        streams = await ae.add_requests([(f"n{i}", "Hello", LONG) for i in range(2)])  # 1 + 2 fits
        assert ae.engine.num_waiting == 3
        for s in [running, waiting, *streams]:
            await s.abort()

    run(body, tiny_engine(max_num_seqs=1), max_waiting=3)


# ---- on the wire ------------------------------------------------------------------------------------------
def in_process(test: Callable[[httpx.AsyncClient], Coroutine[Any, Any, None]], engine: AsyncEngine) -> None:
    async def main() -> None:
        app = create_app(engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(main())


def completion(i: int, stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPTS[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": stream}


def streamed(r: httpx.Response) -> tuple[str, dict[str, Any] | None]:
    """A stream's text and its error event (None if it finished)."""
    events = sse_payloads(r.text.split("\n"))
    assert r.status_code == 200 and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    error = chunks[-1].get("error") if chunks else None
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, error


@pytest.mark.slow
def test_on_the_wire_a_failed_step_is_a_500_body_or_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    params16 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = {out.request_id: out.text for out in run_all(tiny_engine(), dict(zip(IDS, PROMPTS, strict=True)), params16).values()}  # fmt: skip
    engine = tiny_engine(max_num_seqs=2)
    fault = Fault(engine, lambda out: len(out.scheduled) == 2)
    inject("forward", engine, fault, monkeypatch)

    async def test(client: httpx.AsyncClient) -> None:
        streams = [i % 2 == 1 for i in range(len(PROMPTS))]
        rs = await asyncio.gather(
            *(client.post("/v1/completions", json=completion(i, s)) for i, s in enumerate(streams))
        )
        failures = 0
        for i, (r, is_stream) in enumerate(zip(rs, streams, strict=True)):
            if is_stream:
                text, error = streamed(r)
            else:
                error = None if r.status_code == 200 else assert_error(r, 500, type="server_error")
                text = r.json()["choices"][0]["text"] if error is None else ""
            if error is None:
                assert text == want[IDS[i]], i
                continue
            failures += 1
            assert error["code"] == "engine_step_failed" and error["type"] == "server_error"
            assert (
                error["message"]
                == "the engine step failed in the model forward: InjectedFault: injected fault"
            )
        assert len(fault.batches) == 1 and failures == len(fault.batches[0]) == 2
        assert (await client.get("/health")).status_code == 200  # serving on
        r = await client.post("/v1/completions", json=completion(0, False))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["r0"]

    in_process(test, AsyncEngine(engine))
    assert_pool_drains(engine)


def test_on_the_wire_a_repeated_fault_without_restarts_is_503_and_health_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = tiny_engine(max_num_seqs=2)
    fault = Fault(engine, lambda out: True, repeat=True)
    inject("forward", engine, fault, monkeypatch)

    async def test(client: httpx.AsyncClient) -> None:
        rs = await asyncio.gather(
            *(client.post("/v1/completions", json=completion(i, False)) for i in range(4))
        )
        first = [r for r in rs if r.status_code == 500]
        assert first and all(r.json()["error"]["code"] == "engine_step_failed" for r in first)
        assert all(r.status_code in (500, 503) for r in rs)
        # at most 2 ran in the first step: the next step, with the others, failed too: dead
        assert sum(r.status_code == 503 for r in rs) >= 2
        for r in rs:
            if r.status_code == 503:
                assert_error(r, 503, type="service_unavailable_error", code="engine_dead")
        err = assert_error(
            await client.get("/health"), 503, type="service_unavailable_error", code="engine_dead"
        )
        assert (
            "InjectedFault: injected fault" in err["message"]
            and "right after another fault" in err["message"]
            and "not restarted: restarts are turned off" in err["message"]
        )
        for stream in (False, True):
            r = await client.post("/v1/completions", json=completion(5, stream))
            assert_error(r, 503, type="service_unavailable_error", code="engine_dead")
        assert len(fault.batches) == 2

    in_process(test, AsyncEngine(engine, max_restarts=0))


def test_on_the_wire_a_base_exception_is_an_error_event_then_503() -> None:
    class Fatal(BaseException):
        pass

    engine = tiny_engine()
    real_step, calls = engine.step, [0]

    def step() -> list[RequestOutput]:
        calls[0] += 1
        if calls[0] == 4:
            raise Fatal("out of the blue")
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def test(client: httpx.AsyncClient) -> None:
        text, error = streamed(await client.post("/v1/completions", json=completion(0, True)))
        assert error is not None and error["code"] == "engine_dead" and "Fatal" in error["message"]
        err = assert_error(
            await client.get("/health"), 503, type="service_unavailable_error", code="engine_dead"
        )
        assert "Fatal: out of the blue" in err["message"]
        assert_error(await client.post("/v1/completions", json=completion(1, False)), 503, type="service_unavailable_error")  # fmt: skip

    in_process(test, AsyncEngine(engine))


def test_on_the_wire_n_counts_against_the_waiting_limit() -> None:
    engine = AsyncEngine(tiny_engine(max_num_seqs=1), max_waiting=2)

    async def test(client: httpx.AsyncClient) -> None:
        running = await engine.add_request("running", "Hello", LONG)
        await running.__anext__()
        waiting = await engine.add_request("waiting", "Hello", LONG)  # 1 of 2 places taken
        body = {"prompt": "Hi", "max_tokens": 2, "n": 2}
        r = await client.post("/v1/completions", json=body)
        assert_error(r, 429, type="rate_limit_error", code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
        assert_error(await client.post("/v1/completions", json={**body, "n": 3}), 400, param="n")
        await waiting.abort()
        await running.abort()
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2

    in_process(test, engine)
