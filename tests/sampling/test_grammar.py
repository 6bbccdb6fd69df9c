"""Structured outputs on the tiny random-weight engine: the grammar alone must make the output valid.

A random model has no idea what JSON or a regex is, so every valid output here
is the mask's doing. References are llguidance's own masks (compute_logit_bias:
one byte per id, computed independently of our bitmask path) and a batch
without constraints (for the rows that have none).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from onecall.engine.engine import Engine
from onecall.errors import InvalidParameterError
from onecall.sampling import masks
from onecall.sampling.bitmask import unpack_bitmask
from onecall.sampling.grammar import GrammarBackend, GrammarLimits
from onecall.sampling.sampler import sample
from onecall.sampling.types import SamplingRequest
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.tiny_engine import embedded_tokenizer, run_all, tiny_engine

SO = StructuredOutputsParams
EOS = 2  # the embedded tokenizer's only EOS id (checked by test_eos_is_the_tokenizers)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def engine_with(backend: GrammarBackend, **kwargs: Any) -> Engine:
    """A tiny engine that reuses the session's grammar backend (`grammar_backend`, tests/conftest.py:
    its llguidance tokenizer takes ~0.6 s)."""
    engine = tiny_engine(**kwargs)
    engine._grammar = backend
    return engine


def llguidance_allowed(constraint: Any) -> set[int]:
    """The ids llguidance itself allows now, from its byte-per-id mask (200 = allowed)."""
    bias = constraint._matcher.compute_logit_bias()
    return {i for i, b in enumerate(bias) if b}


def test_eos_is_the_tokenizers() -> None:
    assert embedded_tokenizer().eos_token_ids == frozenset({EOS})


# ---------------------------------------------------------------- valid output from random weights


@pytest.mark.parametrize(
    "so, check",
    [
        (SO(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (SO(regex=r"(yes|no|maybe)!"), lambda t: t in ("yes!", "no!", "maybe!")),
        (SO(choice=["red", "green", "blue sky"]), lambda t: t in ("red", "green", "blue sky")),
        (
            SO(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
            lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t),
        ),
        (SO(json=SCHEMA), lambda t: set(json.loads(t)) == {"name", "age"}),
    ],
)
def test_constraint_forces_valid_output(
    grammar_backend: GrammarBackend, so: StructuredOutputsParams, check: Any
) -> None:
    engine = engine_with(grammar_backend)
    prompts = {f"r{i}": f"prompt number {i}" for i in range(6)}
    params = {
        rid: SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so)
        for i, rid in enumerate(prompts)
    }
    params["r0"] = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    finished = 0
    for out in run_all(engine, prompts, params).values():
        if out.finish_reason == "stop":
            finished += 1
            assert check(out.text), out.text
            assert EOS not in out.token_ids[:-1]
        else:  # a random model may ramble inside a repetition until max_tokens: still a valid prefix
            assert out.finish_reason == "length"
    assert finished >= 4


def test_grammar_completion_stops_without_eos(grammar_backend: GrammarBackend) -> None:
    engine = engine_with(grammar_backend)
    so = SO(choice=["alpha", "beta"])
    out = run_all(
        engine, {"a": "hello"}, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so)
    )["a"]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert EOS not in out.token_ids  # nothing may follow: the request ended when the matcher stopped
    steps = [s for s in out.trace.steps if s.token_id is not None]
    assert steps[0].num_allowed is not None and steps[0].num_allowed + steps[0].num_masked == 49152
    assert 2 <= steps[0].num_allowed <= 12 and all(s.mask_time > 0 for s in steps)  # "a", "al", "b", ...
    g = out.trace.grammar
    assert g is not None and g.kind == "choice" and g.activated_at == 0 and g.error is None
    d = out.trace.to_dict()
    assert d["grammar"]["kind"] == "choice" and d["steps"][0]["num_allowed"] == steps[0].num_allowed


def test_eos_allowed_exactly_when_the_grammar_can_end(grammar_backend: GrammarBackend) -> None:
    c = grammar_backend.new_constraint(SO(regex="a{2,3}"))
    a = embedded_tokenizer().encode("a")[0]
    bitmask = torch.full((1, 1536), -1, dtype=torch.int32)
    expect = [(False, False), (False, False), (True, False), (True, True)]  # (EOS allowed, finished)
    for n, (eos_ok, done) in enumerate(expect):
        assert c.fill_bitmask(bitmask, 0)
        assert bool((int(bitmask[0, EOS // 32]) >> (EOS % 32)) & 1) is eos_ok, f"after {n} 'a'"
        assert c.is_finished() is done
        if n < 3:
            c.advance(a)


# ---------------------------------------------------------------- the mask itself


def test_bitmask_masks_exactly_what_llguidance_disallows(grammar_backend: GrammarBackend) -> None:
    tok = embedded_tokenizer()
    c = grammar_backend.new_constraint(SO(json=SCHEMA))
    path = tok.encode('{"name": "Bob", "age": 42}')
    g = torch.Generator().manual_seed(0)
    for token in path:
        allowed = llguidance_allowed(c)
        logits = torch.randn(1, 49152 + 64, generator=g)  # a vocab padded past the tokenizer's
        req = SamplingRequest(SamplingParams(temperature=0.0, logprobs=0), [], [], None, c)
        out = sample(logits, [req])
        masked = logits.clone()
        keep = torch.zeros(49152 + 64, dtype=torch.bool)
        keep[list(allowed)] = True
        masked[0, ~keep] = -torch.inf
        assert out.num_allowed == [len(allowed)] and out.num_masked == [49152 + 64 - len(allowed)]
        assert out.token_ids[0] == int(masked.argmax()) and out.token_ids[0] in allowed
        assert out.logprobs[0] == pytest.approx(
            float(torch.log_softmax(masked, -1)[0, out.token_ids[0]]), abs=1e-5
        )
        assert token in allowed
        c.advance(token)
    assert c.is_finished()


def test_unconstrained_rows_are_bit_identical(
    grammar_backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 49152, generator=g)

    def rows(with_grammar: bool) -> list[SamplingRequest]:
        c = grammar_backend.new_constraint(SO(regex="[a-z]+")) if with_grammar else None
        plain = [
            SamplingParams(temperature=0.0, logprobs=3),
            SamplingParams(temperature=0.9, seed=7, logprobs=3),
        ]
        return [
            SamplingRequest(SamplingParams(temperature=0.5, seed=1), [], [], None, c),
            SamplingRequest(plain[0], [], [], None),
            SamplingRequest(SamplingParams(temperature=0.5, seed=2), [], [], None, c),
            SamplingRequest(plain[1], [], [], torch.Generator().manual_seed(7)),
        ]

    calls: list[tuple[int, int]] = []
    real = masks.allocate_bitmask

    def counting(num_rows: int, vocab_size: int) -> torch.Tensor:
        calls.append((num_rows, vocab_size))
        return real(num_rows, vocab_size)

    monkeypatch.setattr(masks, "allocate_bitmask", counting)
    base = sample(logits.clone(), rows(False), inplace=True)
    assert calls == []  # a batch without constraints allocates no bitmask
    mixed_logits = logits.clone()
    mixed = sample(mixed_logits, rows(True), inplace=True)
    assert calls == [(2, 49152)]  # one bitmask, for the two constrained rows only
    for i in (1, 3):
        assert mixed.token_ids[i] == base.token_ids[i] and mixed.logprobs[i] == base.logprobs[i]
        assert mixed.top_logprobs[i] == base.top_logprobs[i] and mixed.num_allowed[i] is None
        assert torch.equal(mixed_logits[i], logits[i])  # inplace: untouched rows are not even rewritten
    assert mixed.num_allowed[0] is not None and mixed.num_masked[1] == 0


def test_unconstrained_requests_unchanged_in_a_mixed_engine_batch(grammar_backend: GrammarBackend) -> None:
    prompts = {"a": "one two three", "b": "four five", "c": "six seven eight nine"}
    plain = {
        "a": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        "b": SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
    }
    base = run_all(
        tiny_engine(),
        prompts,
        {**plain, "c": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)},
    )
    so = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=SO(regex="[0-9]{4}"))
    mixed = run_all(engine_with(grammar_backend), prompts, {**plain, "c": so})
    assert re.fullmatch("[0-9]{4}", mixed["c"].text)
    for rid in ("a", "b"):
        assert mixed[rid].token_ids == base[rid].token_ids
        assert all(s.num_allowed is None for s in mixed[rid].trace.steps)


def test_preemption_keeps_grammar_state(grammar_backend: GrammarBackend) -> None:
    # 96 slots for 6 requests of ~40 tokens: must preempt
    engine = engine_with(grammar_backend, num_blocks=24)
    prompts = {f"r{i}": "word " * (8 + i) for i in range(6)}
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex="([a-z]+ ){5,}x"))
    outs = run_all(engine, prompts, params)
    assert engine.stats.num_preemptions_total > 0
    for out in outs.values():
        assert out.finish_reason == "length" or re.fullmatch("([a-z]+ ){5,}x", out.text)
        assert re.fullmatch("([a-z]+ ?)*x?", out.text), out.text


# ---------------------------------------------------------------- compile: cache, errors, limits


def test_second_compile_is_a_cache_hit() -> None:
    backend = GrammarBackend(embedded_tokenizer())
    so = SO(json={"type": "object", "properties": {"q": {"type": "boolean"}}})
    first, second = backend.new_constraint(so), backend.new_constraint(SO(json=json.dumps(so.json)))
    assert (first.trace.cache_hit, second.trace.cache_hit) == (False, True)
    # a hit reports the original compile's duration (the server compiles before admission)
    assert backend.num_compiles == 1 and second.trace.compile_time == first.trace.compile_time > 0
    engine = tiny_engine()
    for rid in ("x", "y"):
        engine.add_request(rid, "hi", SamplingParams(max_tokens=4, structured_outputs=SO(regex="[xy]+")))
    traces = [engine._seqs[r].trace.grammar for r in ("x", "y")]
    assert [t.cache_hit for t in traces if t] == [False, True]


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"json": {"type": "strin"}}, "structured_outputs.json", "strin"),
        (
            {"json": '{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}'},
            "structured_outputs.json",
            "nope",
        ),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": {"type": "string", "pattern": "(("}}, "structured_outputs.json", "unclosed group"),
        ({"regex": "[a-"}, "structured_outputs.regex", "unclosed character class"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar", "unknown name"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice", "string"),
        ({"json": {}, "regex": "a"}, "structured_outputs", "exactly one"),
        ({}, "structured_outputs", "exactly one"),
        ({"regex": "a", "reasoning_end": ""}, "structured_outputs.reasoning_end", "non-empty"),
        (
            {"regex": "a", "reasoning_start": "<think>"},
            "structured_outputs.reasoning_start",
            "needs reasoning_end",
        ),
        ({"regex": "a", "color": "red"}, "structured_outputs", "unknown field"),
    ],
)
def test_bad_input_is_refused_before_any_token(
    grammar_backend: GrammarBackend, kwargs: dict[str, Any], param: str, message: str
) -> None:
    engine = engine_with(grammar_backend)
    with pytest.raises(InvalidParameterError, match=re.escape(message)) as info:
        engine.add_request("bad", "hello", SamplingParams(structured_outputs=SO.from_dict(kwargs)))
    assert info.value.param == param
    assert not engine.has_unfinished_requests()  # nothing was queued
    run_all(engine, {"ok": "hello"}, SamplingParams(max_tokens=2))  # and the engine still serves


def test_over_limit_grammars_are_refused_quickly() -> None:
    # 1. over our text cap: refused before llguidance sees it
    backend = GrammarBackend(embedded_tokenizer(), GrammarLimits(max_grammar_bytes=10_000))
    t0 = time.perf_counter()
    with pytest.raises(InvalidParameterError, match="too large"):
        backend.compile(SO(json={"enum": [f"item{i}" for i in range(2000)]}))
    # 2. over llguidance's lexer fuel: llguidance's own refusal
    small_fuel = GrammarBackend(embedded_tokenizer(), GrammarLimits(initial_lexer_fuel=2_000))
    with pytest.raises(InvalidParameterError, match="too big"):
        small_fuel.compile(SO(json={"enum": [f"item{i}" for i in range(500)]}))
    # 3. past the compile timeout: refused without waiting for the compile
    impatient = GrammarBackend(embedded_tokenizer(), GrammarLimits(compile_timeout_s=0.001))
    impatient.ll_tokenizer  # noqa: B018 (built outside the timed part)
    with pytest.raises(InvalidParameterError, match="longer than"):
        impatient.compile(SO(grammar="start: " + " | ".join(f'"w{i}"' for i in range(5000))))
    assert time.perf_counter() - t0 < 5.0


def test_deep_rule_chain_compiles_on_the_big_stack() -> None:
    """4,000 nested rules overflowed the default 8 MiB stack inside llguidance 1.9.1 (a segfault); our
    compile thread's 256 MiB stack holds them. In a subprocess (with a 257-id byte tokenizer, so it
    starts fast), so a regression cannot take pytest down with it."""
    code = """
from onecall.sampling.grammar import GrammarBackend
from onecall.sampling_params import StructuredOutputsParams as SO

class ByteTokenizer:
    vocab_size, bos_token_id, eos_token_ids, special_ids = 257, None, frozenset({256}), frozenset({256})
    def token_bytes(self, i): return bytes([i]) if i < 256 else b"<eos>"
    def encode(self, text): return list(text.encode())

rules = "".join(f'r{i}: "x" r{i + 1}?\\n' for i in range(4000))
compiled, hit = GrammarBackend(ByteTokenizer()).compile(SO(grammar="start: r0\\n" + rules + 'r4000: "z"'))
print("compiled", hit)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "compiled False" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


# ---------------------------------------------------------------- reasoning: the grammar waits


def test_marker_split_across_tokens_activates_the_grammar(grammar_backend: GrammarBackend) -> None:
    tok = embedded_tokenizer()
    c = grammar_backend.new_constraint(SO(regex="[0-9]+", reasoning_end="</think>"))
    bitmask = torch.full((1, 1536), -1, dtype=torch.int32)
    thinking = tok.encode("<think>Let me think: </thin k> is not it.</think>")
    # the token that completes "</think>" (it spans several tokens in this vocabulary)
    last = next(n for n in range(len(thinking)) if "</think>" in tok.decode(thinking[: n + 1]))
    assert len(thinking) - last == 1 and tok.decode([thinking[last]]) != "</think>"
    for n, token in enumerate(thinking):
        assert c.fill_bitmask(bitmask, 0) is False  # unconstrained: everything allowed
        assert not c.is_finished()
        c.advance(token)
        assert c.is_active is (n >= last)
    assert c.trace.activated_at == len(thinking)
    assert c.fill_bitmask(bitmask, 0) is True
    allowed = llguidance_allowed(c)
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)


def test_engine_defers_the_grammar_until_the_marker(grammar_backend: GrammarBackend) -> None:
    tok = embedded_tokenizer()
    (marker,) = tok.encode(" answer")
    so = SO(regex="[0-9]{3}", reasoning_end=" answer")
    # logit_bias forces the marker at the first (unconstrained) step; after it the grammar masks it out
    params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={marker: 100.0}, structured_outputs=so)
    out = run_all(engine_with(grammar_backend), {"r": "question"}, params)["r"]
    assert out.token_ids[0] == marker and out.finish_reason == "stop"
    assert re.fullmatch(" answer[0-9]{3}", out.text), out.text
    steps = [s for s in out.trace.steps if s.token_id is not None]
    assert steps[0].num_allowed is None and steps[0].num_masked == 0  # reasoning: nothing masked
    assert all(s.num_allowed is not None and s.num_allowed < 100 for s in steps[1:])
    assert out.trace.grammar is not None and out.trace.grammar.activated_at == 1
    # without the marker the grammar never applies, and the request is free text
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, structured_outputs=so)
    out = run_all(engine_with(grammar_backend), {"r": "question"}, free)["r"]
    assert all(s.num_allowed is None for s in out.trace.steps) and out.trace.grammar.activated_at is None


def test_preamble_mask_is_the_grammars_plus_the_reasoning_start(grammar_backend: GrammarBackend) -> None:
    tok = embedded_tokenizer()
    (start,) = tok.encode(" answer")
    c = grammar_backend.new_constraint(SO(regex="[0-9]{3}", reasoning_start=" answer", reasoning_end=" done"))
    bitmask = torch.full((1, 1536), -1, dtype=torch.int32)
    assert c.state == c.PREAMBLE and c.fill_bitmask(bitmask, 0)
    allowed = set(unpack_bitmask(bitmask, 49152)[0].nonzero().flatten().tolist())
    assert allowed == llguidance_allowed(c) | {start} and start not in llguidance_allowed(c)
    with pytest.raises(InvalidParameterError, match="one token") as info:
        grammar_backend.new_constraint(SO(regex="x", reasoning_start="<think>", reasoning_end="</think>"))
    assert info.value.param == "structured_outputs.reasoning_start"  # 3 tokens in this vocabulary


def test_engine_reasoning_block_opened_or_skipped(grammar_backend: GrammarBackend) -> None:
    tok = embedded_tokenizer()
    (start,), (end,) = tok.encode(" answer"), tok.encode(" done")
    so = SO(regex="[0-9]{3}", reasoning_start=" answer", reasoning_end=" done")
    # opened: the biases make the model think (" answer ...") and close the block (" done")
    params = SamplingParams(
        temperature=0.0, max_tokens=16, logit_bias={start: 100.0, end: 100.0}, structured_outputs=so
    )
    out = run_all(engine_with(grammar_backend), {"r": "what is it"}, params)["r"]
    assert re.fullmatch("( answer)+ done[0-9]{3}", out.text) and out.finish_reason == "stop", out.text
    n = out.token_ids.index(end) + 1
    assert out.trace.grammar is not None and out.trace.grammar.activated_at == n
    steps = [s for s in out.trace.steps if s.token_id is not None]
    assert steps[0].num_allowed is not None  # the preamble step is masked (grammar + reasoning_start)
    assert all(s.num_allowed is None for s in steps[1:n]) and all(s.num_allowed for s in steps[n:])
    # skipped: the first token is the grammar's, and the grammar applies from it on
    params = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={start: -100.0}, structured_outputs=so)
    out = run_all(engine_with(grammar_backend), {"r": "what is it"}, params)["r"]
    assert re.fullmatch("[0-9]{3}", out.text) and out.trace.grammar.activated_at == 0
