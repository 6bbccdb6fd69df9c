"""trace_level "full": each token's logit provenance, and proof that recording it changes nothing.

Three levels: the sampler alone (direct sample() calls on random logits, every stage in one
mixed batch), the tiny random-weight engine (greedy, seeded sampling with truncation, penalties
and logit_bias, and a grammar, where only some rows ask for "full"), and the server in-process
(the request field, its 400, and the provenance in the returned trace). The invariant checked
everywhere: the same tokens with and without "full"; the snapshots agree with what the sampler
saw (raw top-1 is the raw argmax, the mask stage's num_allowed is the trace's, the chosen token
survives truncation).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest
import torch

from onecall.engine.engine import Engine
from onecall.errors import InvalidParameterError
from onecall.sampling import sampler
from onecall.sampling.bitmask import pack_bitmask
from onecall.sampling.grammar import GrammarBackend
from onecall.sampling.provenance import STAGES, TOP_N, TokenProvenance
from onecall.sampling.sampler import sample
from onecall.sampling.types import SamplingRequest
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from onecall.server.app import create_app
from onecall.server.async_engine import AsyncEngine
from onecall.trace_view import format_trace
from tests.helpers.server_process import assert_error
from tests.helpers.tiny_engine import embedded_tokenizer, run_all, tiny_engine

VOCAB = 500
ALLOWED = [3, 17, 42, 99, 250]


class AllowSet:
    """A constraint that allows a fixed set of ids (the sampler's TokenConstraint protocol)."""

    def __init__(self, allowed: Sequence[int], vocab: int) -> None:
        mask = torch.zeros(1, vocab, dtype=torch.bool)
        mask[0, list(allowed)] = True
        self.words = pack_bitmask(mask)[0]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = 0
        bitmask[row, : self.words.numel()] = self.words
        return True

    def advance(self, token_id: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False


ROWS: list[dict[str, Any]] = [  # one of each sampler path; the constraint row also has a ban
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "seed": 1},
    {"temperature": 1.3, "min_p": 0.05, "seed": 2},
    {
        "temperature": 0.7,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.4,
        "logit_bias": {7: 9.0, 8: -50.0},
        "seed": 3,
    },
    {"temperature": 1.0, "seed": 4, "constraint": True},
    {"temperature": 0.0, "logit_bias": {11: 30.0}},
]


def batch(full: set[int]) -> list[SamplingRequest]:
    """ROWS as requests (fresh generators); rows in `full` ask for trace_level full."""
    out = []
    for i, row in enumerate(ROWS):
        kw = {k: v for k, v in row.items() if k != "constraint"}
        p = SamplingParams(**kw, trace_level="full" if i in full else "basic")
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        constraint = AllowSet(ALLOWED, VOCAB) if row.get("constraint") else None
        banned = [ALLOWED[0]] if constraint else []
        out.append(SamplingRequest(p, [5, 6, 7, 8], [9, 9, 10], gen, constraint, banned))
    return out


def steps_of(requests: list[SamplingRequest], num_steps: int = 8, inplace: bool = False) -> list[Any]:
    g = torch.Generator().manual_seed(123)
    results = []
    for _ in range(num_steps):
        logits = torch.randn(len(requests), VOCAB, generator=g) * 3
        results.append((logits.clone(), sample(logits, requests, inplace=inplace)))
    return results


@pytest.mark.parametrize("inplace", [False, True])
def test_full_rows_sample_the_same_tokens(inplace: bool) -> None:
    plain = steps_of(batch(set()), inplace=inplace)
    mixed = steps_of(batch({1, 3, 4, 5}), inplace=inplace)
    every = steps_of(batch(set(range(len(ROWS)))), inplace=inplace)
    for (_, a), (_, b), (_, c) in zip(plain, mixed, every, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.provenance == [None] * len(ROWS)
        assert [p is not None for p in b.provenance] == [i in {1, 3, 4, 5} for i in range(len(ROWS))]


def test_a_basic_batch_builds_no_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("a basic batch must not record provenance")

    monkeypatch.setattr(sampler, "ProvenanceRecorder", refuse)
    (_, result), *_ = steps_of(batch(set()), num_steps=1)
    assert result.provenance == [None] * len(ROWS)


def test_snapshots_agree_with_what_the_sampler_saw() -> None:
    full = set(range(len(ROWS)))
    for raw_logits, result in steps_of(batch(full), inplace=True):  # raw must be taken before edits
        for i, prov in enumerate(result.provenance):
            assert isinstance(prov, TokenProvenance)
            token = result.token_ids[i]
            check_token(prov, token, raw_logits[i], ROWS[i], result.num_allowed[i])
            json.dumps(prov.to_dict(), allow_nan=False)


def check_token(
    prov: TokenProvenance, token: int, raw: torch.Tensor, row: dict[str, Any], num_allowed: int | None
) -> None:
    assert prov.token_id == token and [s.stage for s in prov.stages] == list(STAGES)
    # raw: the model's logits, before any edit
    r = prov.stage("raw")
    assert r.top[0].token_id == int(raw.argmax()) and len(r.top) == TOP_N
    assert r.chosen_logit == pytest.approx(float(raw[token]))
    assert r.chosen_rank == int((raw > raw[token]).sum()) + 1
    assert [c.logit for c in r.top] == sorted((c.logit for c in r.top), reverse=True)
    # penalties: a big logit_bias moves its token to the top
    pen = prov.stage("penalties")
    if row.get("logit_bias", {}).get(11):
        assert pen.top[0].token_id == 11 and r.top[0].token_id != 11
    # mask: only allowed ids survive; num_allowed is what the sampler reported
    m = prov.stage("mask")
    assert m.num_allowed == num_allowed
    if row.get("constraint"):
        assert num_allowed == len(ALLOWED) - 1 and m.num_masked == VOCAB - num_allowed  # minus the ban
        assert {c.token_id for c in m.top} <= set(ALLOWED) - {ALLOWED[0]} and token in ALLOWED[1:]
    if row["temperature"] == 0.0:  # greedy: argmax of the mask stage; no temperature, no truncation
        assert prov.mode == "greedy" and m.chosen_rank == 1 and m.top[0].token_id == token
        assert prov.stage("temperature").skipped and prov.stage("truncation").skipped
        assert prov.stage("truncation").chosen_rank is None
        assert prov.probability == m.chosen_prob
        return
    t, tr = prov.stage("temperature"), prov.stage("truncation")
    assert prov.mode == "sample" and not t.skipped and not tr.skipped
    assert t.chosen_logit == pytest.approx(m.chosen_logit / row["temperature"], rel=1e-5)
    assert t.chosen_rank == m.chosen_rank  # dividing by a positive number keeps the order
    assert tr.num_surviving is not None and 1 <= tr.chosen_rank <= tr.num_surviving  # type: ignore[operator]
    if "top_k" in row:
        assert tr.num_surviving <= row["top_k"]
    assert sum(c.prob for c in tr.top) <= 1.0 + 1e-5 and prov.probability == tr.chosen_prob
    assert prov.probability is not None and 0.0 < prov.probability <= 1.0


def test_trace_level_is_validated_and_traced() -> None:
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(trace_level="everything")
    assert e.value.param == "trace_level"
    assert SamplingParams(trace_level="full").trace_dict()["trace_level"] == "full"
    assert SamplingParams().trace_level == "basic"


# ---------------------------------------------------------------- the engine


ENGINE_PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=8),
    "nucleus": SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, seed=11, max_tokens=8),
    "penalized": SamplingParams(
        temperature=0.8,
        seed=12,
        max_tokens=8,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={28: 5.0, 29: -100.0},
    ),
    "grammar": SamplingParams(
        temperature=1.0,
        seed=13,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]{3}"),
    ),
    "greedy_grammar": SamplingParams(
        temperature=0.0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]),
    ),
}
FULL = {"nucleus", "grammar", "greedy_grammar"}  # the rest stay basic in the mixed run


def engine_run(backend: GrammarBackend, full: set[str]) -> dict[str, Any]:
    engine: Engine = tiny_engine()
    engine._grammar = backend  # share the session's llguidance tokenizer (0.6 s to build; tests/conftest.py)
    prompts = {rid: f"prompt {rid}" for rid in ENGINE_PARAMS}
    params = {
        rid: replace(p, trace_level="full" if rid in full else "basic") for rid, p in ENGINE_PARAMS.items()
    }
    return run_all(engine, prompts, params)


def test_engine_tokens_unchanged_and_provenance_traced(grammar_backend: GrammarBackend) -> None:
    basic = engine_run(grammar_backend, set())
    mixed = engine_run(grammar_backend, FULL)
    for rid in ENGINE_PARAMS:
        assert mixed[rid].token_ids == basic[rid].token_ids, rid
        sampled_steps = [s for s in mixed[rid].trace.steps if s.token_id is not None]
        if rid not in FULL:
            assert all(s.provenance is None for s in mixed[rid].trace.steps)
            continue
        assert mixed[rid].trace.sampling["trace_level"] == "full"
        assert all(s.provenance is not None for s in sampled_steps)
        for s in sampled_steps:
            p = s.provenance
            assert p is not None and p["token_id"] == s.token_id
            stages = {st["stage"]: st for st in p["stages"]}
            assert stages["mask"]["num_allowed"] == s.num_allowed  # the trace's own count
            if s.num_allowed is not None:
                assert stages["mask"]["chosen_rank"] <= s.num_allowed
            final = stages["mask"] if p["mode"] == "greedy" else stages["truncation"]
            assert final["chosen_rank"] is not None
            if p["mode"] == "sample":
                assert final["chosen_rank"] <= final["num_surviving"]
        assert any(s.num_allowed is not None for s in sampled_steps) == (rid != "nucleus")
    json.dumps(mixed["grammar"].trace.to_dict(), allow_nan=False)
    table = format_trace(mixed["nucleus"].trace, embedded_tokenizer())
    assert "logit provenance" in table and "trunc" in table
    assert "logit provenance" not in format_trace(mixed["greedy"].trace, embedded_tokenizer())


# ---------------------------------------------------------------- the server


def serve(test: Any) -> None:
    async def main() -> None:
        app = create_app(AsyncEngine(tiny_engine()))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(main())


def test_server_trace_level_full() -> None:
    hi = [{"role": "user", "content": "What is the capital of France?"}]

    async def test(client: httpx.AsyncClient) -> None:
        # "full" turns the trace on by itself; every generated token has its provenance
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": hi, "max_tokens": 4, "temperature": 0, "trace_level": "full"},
        )
        assert r.status_code == 200, r.text
        trace = r.json()["trace"]
        steps = [s for s in trace["steps"] if s["token_id"] is not None]
        assert len(steps) == 4 and trace["sampling"]["trace_level"] == "full"
        assert all(s["provenance"]["token_id"] == s["token_id"] for s in steps)
        assert all(
            s["provenance"]["stages"][0]["top"][0]["token_id"] == s["token_id"] for s in steps
        )  # greedy
        # completions too, sampled; without trace_level no provenance
        body = {"prompt": "Once upon", "max_tokens": 3, "seed": 5, "top_p": 0.9}
        full = await client.post("/v1/completions", json={**body, "trace_level": "full"})
        basic = await client.post("/v1/completions", json={**body, "trace": True})
        assert full.json()["choices"][0]["text"] == basic.json()["choices"][0]["text"]
        modes = {s["provenance"]["mode"] for s in full.json()["trace"]["steps"] if s["token_id"] is not None}
        assert modes == {"sample"}
        assert all(s["provenance"] is None for s in basic.json()["trace"]["steps"])
        # a wrong value is a 400 naming the field, for both endpoints
        for path, b in (("/v1/chat/completions", {"messages": hi}), ("/v1/completions", {"prompt": "x"})):
            err = assert_error(
                await client.post(path, json={**b, "trace_level": "verbose"}), 400, param="trace_level"
            )
            assert "full" in err["message"]

    serve(test)


def test_probabilities_are_a_distribution() -> None:
    """The raw stage's candidate probabilities are the model's softmax (temperature 1)."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    p = sample(
        logits.clone(), [SamplingRequest(SamplingParams(temperature=0.0, trace_level="full"), [], [], None)]
    )
    prov = p.provenance[0]
    assert prov is not None
    expected = torch.softmax(logits[0], -1)
    for c in prov.stage("raw").top:
        assert math.isclose(c.prob, float(expected[c.token_id]), rel_tol=1e-5)


def test_stage_entropy_is_the_whole_distributions() -> None:
    """Each stage's entropy (nats) over the full vocabulary, against a float64 reference; ids a
    stage removed (-inf after top-k) contribute nothing instead of NaN."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    params = SamplingParams(temperature=0.5, top_k=7, seed=1, trace_level="full")
    gen = torch.Generator().manual_seed(1)
    prov = sample(logits.clone(), [SamplingRequest(params, [], [], gen)]).provenance[0]
    assert prov is not None

    def entropy(x: torch.Tensor) -> float:
        p = torch.softmax(x.double(), -1)
        return float(-(p[p > 0] * p[p > 0].log()).sum())

    assert math.isclose(prov.stage("raw").entropy or 0.0, entropy(logits[0]), rel_tol=1e-4)
    assert math.isclose(prov.stage("temperature").entropy or 0.0, entropy(logits[0] / 0.5), rel_tol=1e-4)
    top7 = torch.full_like(logits[0], -math.inf)
    idx = (logits[0] / 0.5).topk(7).indices
    top7[idx] = (logits[0] / 0.5)[idx]
    truncated = prov.stage("truncation").entropy
    assert truncated is not None and math.isfinite(truncated)
    assert math.isclose(truncated, entropy(top7), rel_tol=1e-4)
    assert truncated < prov.stage("temperature").entropy  # type: ignore[operator]
