"""One request's own parameters never cost another request anything (issue 24, items 1, 2 and 6).

Over the tiny random-weight engine (a real Engine, the embedded tokenizer):
- rows that cannot be sampled (a grammar that allows nothing, or raises) end their own request with
  a RequestFaultError naming the parameter, in consecutive steps, while the innocent requests of the
  same batches finish with exactly the tokens they get alone and the engine never dies;
- what can be decided at intake is refused there with the field named: min_tokens whose bans are the
  whole vocabulary, too many or too long stop strings, too many stop ids or logit_bias entries;
- a tokenizer larger than the model's embedding is refused at load;
- a step that fails part-way through its postprocessing commits nothing to the prefix cache;
- the grammar backend never compiles on the engine thread for a grammar the server compiled
  (held while queued), and timed-out compiles are bounded;
- static decode steps cap the context window to the pool they leave.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
import torch

import onecall.engine.engine as engine_module
import onecall.sampling.grammar as grammar_module
from onecall.engine.engine_parts import check_vocab
from onecall.errors import EngineStepError, InvalidParameterError, RequestFaultError, UnsupportedModelError
from onecall.model.decoder import DecoderLM
from onecall.sampling.grammar import GrammarBackend, GrammarBusyError, GrammarLimits
from onecall.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
)
from tests.helpers.tiny_engine import drain, embedded_tokenizer, run_all, tiny_engine

PROMPTS = {"a": "The capital of France is", "b": "One, two, three,", "c": "def fib(n):"}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class AllowsNothing:
    """A TokenConstraint whose mask is empty from output token `after` on (a grammar gone wrong)."""

    def __init__(self, after: int = 0, *, raises: bool = False) -> None:
        self.after, self.raises, self.seen = after, raises, 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.seen < self.after:
            return False  # unconstrained for now
        if self.raises:
            raise RuntimeError("matcher broke")
        bitmask[row] = 0
        return True

    def advance(self, token_id: int) -> None:
        self.seen += 1

    def is_finished(self) -> bool:
        return False


# ---- rows with no legal token: their request ends alone ---------------------------------------------------
def test_rows_with_no_token_end_alone_in_consecutive_steps_and_innocents_are_untouched() -> None:
    alone = {rid: out.token_ids for rid, out in run_all(tiny_engine(), PROMPTS, GREEDY).items()}
    engine = tiny_engine(max_num_seqs=6)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    # offenders whose rows empty at output tokens 0, 1 and 2 (steps in a row), one whose grammar raises
    offenders = {"x0": AllowsNothing(0), "x1": AllowsNothing(1), "x2": AllowsNothing(2), "xr": AllowsNothing(1, raises=True)}  # fmt: skip
    for rid, constraint in offenders.items():
        engine.add_request(rid, "Hello there", GREEDY, constraint=constraint)
    final = drain(engine)
    assert engine.dead_reason is None
    assert {rid: final[rid].token_ids for rid in PROMPTS} == alone
    for rid in offenders:
        err = final[rid].error
        assert final[rid].finish_reason == "error" and isinstance(err, RequestFaultError)
        assert err.param == "structured_outputs"
    assert final["x0"].error.stage == "sampler" and "allows no token" in str(final["x0"].error)  # type: ignore[union-attr]
    assert final["xr"].error.stage == "grammar" and "matcher broke" in str(final["xr"].error)  # type: ignore[union-attr]
    assert [len(final[rid].token_ids) for rid in ("x0", "x1", "x2")] == [0, 1, 2]
    # nothing of the offenders stayed behind; the engine still serves the same tokens
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    again = run_all(engine, {f"again-{rid}": p for rid, p in PROMPTS.items()}, GREEDY)
    assert {rid: again[f"again-{rid}"].token_ids for rid in PROMPTS} == alone


def test_restart_ends_every_known_request_as_finished_and_serves_the_same_tokens() -> None:
    alone = {rid: out.token_ids for rid, out in run_all(tiny_engine(), PROMPTS, GREEDY).items()}
    engine = tiny_engine(max_num_seqs=1)  # one runs, the others wait: a restart must end them all
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    outs = engine.restart()
    assert sorted(o.request_id for o in outs) == sorted(PROMPTS)
    assert all(o.finished and o.finish_reason == "error" and o.error is not None for o in outs)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
    again = run_all(engine, PROMPTS, GREEDY)
    assert {rid: out.token_ids for rid, out in again.items()} == alone


# ---- refused at intake, naming the field ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": {t: -100.0 for t in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
    ids=["stop_count", "stop_length", "stop_token_ids_count", "logit_bias_count"],
)
def test_per_token_costs_are_bounded_at_intake(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
    at_limit = {k: (v[:-1] if isinstance(v, list) else dict(list(v.items())[:-1])) for k, v in kw.items()}
    if param == "stop" and len(kw["stop"]) == 1:
        at_limit = {"stop": ["x" * MAX_STOP_STRING_CHARS]}
    SamplingParams(**at_limit)  # the limit itself is allowed


def test_min_tokens_whose_bans_are_the_whole_vocabulary_is_refused() -> None:
    p = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[0, 1, 3])
    p.validate_vocab(5)  # EOS unknown: id 2 and 4 are left
    with pytest.raises(InvalidParameterError) as e:
        p.validate_vocab(4, eos_token_ids=[2])  # {0, 1, 3} + EOS 2: all four ids
    assert e.value.param == "min_tokens" and "whole vocabulary" in str(e.value)
    SamplingParams(max_tokens=4, stop_token_ids=[0, 1, 3]).validate_vocab(4, [2])  # no min_tokens: fine


def test_ids_past_the_vocabulary_are_refused_before_anything_runs() -> None:
    engine = tiny_engine()
    vocab = engine.tokenizer.vocab_size
    for prompt, params, param in [
        ([1, vocab], GREEDY, "prompt"),
        ("hi", SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={vocab + 7: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            engine.add_request("r", prompt, params)
        assert e.value.param == param
    assert not engine.has_unfinished_requests()


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load() -> None:
    tok = embedded_tokenizer()
    mc = tiny_engine().model_config
    smaller = dataclasses.replace(mc, vocab_size=tok.vocab_size - 100)
    with pytest.raises(UnsupportedModelError, match=rf"{tok.vocab_size} tokens .* {tok.vocab_size - 100} rows"):
        check_vocab(tok, smaller, "m.gguf")
    check_vocab(tok, dataclasses.replace(mc, vocab_size=tok.vocab_size + 64), "padded.gguf")  # fine


def test_ids_past_the_embedding_are_refused_even_when_the_tokenizer_has_them() -> None:
    """A test-sized model under the embedded tokenizer: intake bounds ids by the smaller of the two."""
    ours = tiny_engine().parts.model
    small = dataclasses.replace(ours.config, vocab_size=300)
    engine = tiny_engine(model=DecoderLM(small, dtype=torch.float32, device="cpu").eval())
    for prompt, params, param in [
        ([1, 300], GREEDY, "prompt"),
        ([1, 2], SamplingParams(logit_bias={299: 1.0, 300: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            engine.add_request("r", prompt, params)
        assert e.value.param == param and "[0, 300)" in str(e.value)


# ---- a failed step commits nothing ------------------------------------------------------------------------
def test_a_step_that_fails_in_postprocess_commits_no_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts finish prefill in one step; postprocessing the second raises (not the request's own
    fault): the whole batch fails and neither prompt may be in the prefix cache afterwards."""
    real = engine_module.postprocess_token
    calls = {"n": 0}

    def second_raises(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("postprocess bug")
        return real(*args, **kwargs)

    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"]}
    for fail in (False, True):
        calls["n"] = 0
        engine = tiny_engine(max_num_seqs=2)
        if fail:
            monkeypatch.setattr(engine_module, "postprocess_token", second_raises)
        for rid, p in prompts.items():
            engine.add_request(rid, p, GREEDY)
        outs = engine.step()
        monkeypatch.setattr(engine_module, "postprocess_token", real)
        if fail:
            assert all(isinstance(o.error, EngineStepError) for o in outs) and len(outs) == 2
        drain(engine)
        again = run_all(engine, {"again": prompts["a"]}, GREEDY)["again"]
        # without the fault the first prompt is cached (the check can fail); with it, nothing is
        assert (again.num_cached_tokens == 0) == fail


# ---- grammars: never compiled on the engine thread, timeouts bounded ---------------------------------------
def test_a_held_grammar_is_found_after_eviction_without_compiling() -> None:
    backend = GrammarBackend(embedded_tokenizer(), GrammarLimits(cache_size=1))
    first = StructuredOutputsParams(regex="[a-c]{3}")
    held, _ = backend.compile(first)  # the server holds it until the request is queued
    backend.compile(StructuredOutputsParams(regex="[x-z]{4}"))  # evicts the first from the LRU
    compiles = backend.num_compiles
    constraint = backend.new_constraint(first)  # what add_request does on the engine thread
    assert backend.num_compiles == compiles and constraint.trace.cache_hit
    assert held is not None
    # a schema whose closed form failed before: the as-written variant held by the caller is used
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    held_schema, _ = backend.compile(schema)
    backend.compile(StructuredOutputsParams(regex="q+"))  # evicts it
    compiles = backend.num_compiles
    backend.new_constraint(schema)
    assert backend.num_compiles == compiles and held_schema is not None


class SlowMatcher:
    """llguidance.LLMatcher, whose construction (the compile) waits for `release`."""

    def __init__(self, real: Any, release: threading.Event) -> None:
        self.real, self.release = real, release

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.release.wait(30)
        return self.real(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _wait_for_threads(backend: GrammarBackend) -> None:
    for _ in range(300):
        if backend.num_compile_threads == 0:
            return
        time.sleep(0.05)
    raise AssertionError("compile threads still alive")


@pytest.mark.slow
def test_timed_out_compiles_are_refused_again_at_once_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    limits = GrammarLimits(compile_timeout_s=0.05, max_compile_threads=2, timeout_memory_s=1.0)
    backend = GrammarBackend(embedded_tokenizer(), limits)
    backend.ll_tokenizer  # noqa: B018  (built outside the patch)
    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", SlowMatcher(grammar_module.llguidance.LLMatcher, release))
    try:
        for i in range(2):
            with pytest.raises(InvalidParameterError, match="took longer than"):
                backend.compile(StructuredOutputsParams(regex=f"a{{{i + 1}}}"))
        with pytest.raises(InvalidParameterError, match="took longer than"):  # cached: no new thread
            backend.compile(StructuredOutputsParams(regex="a{1}"))
        assert backend.num_compiles == 2 and backend.num_compile_threads == 2
        with pytest.raises(GrammarBusyError):  # both slots held by running threads: no third one
            backend.compile(StructuredOutputsParams(regex="b+"))
        assert backend.num_compile_threads == 2
    finally:
        release.set()
    monkeypatch.undo()
    _wait_for_threads(backend)
    backend.compile(StructuredOutputsParams(regex="b+"))  # they ended: compiles run again
    with pytest.raises(InvalidParameterError, match="took longer than"):  # still remembered
        backend.compile(StructuredOutputsParams(regex="a{1}"))
    time.sleep(1.05)  # past timeout_memory_s: a grammar that was only slow on a busy machine compiles
    backend.compile(StructuredOutputsParams(regex="a{1}"))


def test_concurrent_compiles_never_pass_the_thread_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight callers at once (the server compiles in worker threads): at most two compile threads
    ever exist; the others wait for a slot, then are refused."""
    release = threading.Event()
    backend = GrammarBackend(embedded_tokenizer(), GrammarLimits(compile_timeout_s=0.2, max_compile_threads=2))
    backend.ll_tokenizer  # noqa: B018
    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", SlowMatcher(grammar_module.llguidance.LLMatcher, release))
    peak, outcomes = [0], []

    def one(i: int) -> None:
        try:
            backend.compile(StructuredOutputsParams(regex=f"c{{{i + 1}}}"))
            outcomes.append("ok")
        except GrammarBusyError:
            outcomes.append("busy")
        except InvalidParameterError:
            outcomes.append("timeout")
        peak[0] = max(peak[0], backend.num_compile_threads)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        release.set()
    monkeypatch.undo()
    _wait_for_threads(backend)
    assert peak[0] <= 2 and sorted(outcomes) == ["busy"] * 6 + ["timeout"] * 2


def test_two_callers_compiling_one_grammar_get_the_one_that_stays_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = GrammarBackend(embedded_tokenizer(), GrammarLimits(cache_size=1))
    barrier = threading.Barrier(2)
    real = backend._compile_bounded

    def both_compile(*args: Any) -> Any:
        out = real(*args)
        barrier.wait(10)  # neither stores its result before both compiled
        return out

    monkeypatch.setattr(backend, "_compile_bounded", both_compile)
    so = StructuredOutputsParams(regex="[a-c]{5}")
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(backend.compile(so)[0])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.undo()
    assert len(got) == 2 and got[0] is got[1]  # one object, which the pin keeps findable
    compiles = backend.num_compiles
    backend.compile(StructuredOutputsParams(regex="z+"))  # evicts it from the LRU
    backend.new_constraint(so)  # a holder's add_request: found pinned, not compiled again
    assert backend.num_compiles == compiles + 1


# ---- the context window fits the pool that static decode steps leave -------------------------------------
def test_static_decode_caps_the_window_to_the_smaller_pool() -> None:
    engine = tiny_engine(num_blocks=8, block_size=4)
    assert engine.max_model_len == 32
    engine.enable_static_decode(capture=False, backend="triton")
    assert engine.max_model_len == 28  # one block is the padding rows' scratch block
    with pytest.raises(InvalidParameterError):
        engine.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=1))
