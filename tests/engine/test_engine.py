"""Engine behaviour on a tiny random model: batching, prefix cache, preemption, seeds, stops.

The oracle for greedy decoding is a plain loop that recomputes the whole sequence
with a fresh KV cache every step (no paging reuse, no batching, no prefix cache):
the paged engine must produce exactly its tokens in every configuration.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from onecall.errors import ContextLengthExceededError, InvalidParameterError
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.kv_cache import PagedKVCache
from onecall.sampling_params import SamplingParams
from tests.helpers.tiny_engine import embedded_tokenizer, run_all, tiny_engine, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def naive_greedy(prompt: list[int], num_tokens: int) -> list[int]:
    """Recompute everything each step: one sequence, a fresh cache, a full forward."""
    model = tiny_model()
    mc = model.config
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            n = len(ids)
            nb = (n + 3) // 4
            kv = PagedKVCache(
                mc.num_hidden_layers, nb, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu"
            )
            meta = build_attention_metadata([list(range(nb))], [n], [n], 4, "cpu")
            h = model(torch.tensor(ids), torch.arange(n), kv, meta)
            tok = int(model.compute_logits(h[-1:]).argmax(-1))
            out.append(tok)
            ids.append(tok)
    return out


def prompts_mixed(n: int = 8, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(9)]  # a shared system-prompt-like prefix
    out = {}
    for i in range(n):
        tail = [rng.randrange(100, 40000) for _ in range(rng.randint(1, 30))]
        out[f"r{i}"] = (shared if i % 2 else []) + tail
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return {rid: naive_greedy(p, GREEDY.max_tokens) for rid, p in prompts_mixed().items()}


def test_alone_equals_naive_loop(reference: dict[str, list[int]]) -> None:
    for rid, prompt in prompts_mixed().items():
        engine = tiny_engine()
        out = run_all(engine, {rid: prompt}, GREEDY)[rid]
        assert out.token_ids == reference[rid]
        assert out.finish_reason == "length"


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_of_8_equals_alone(
    reference: dict[str, list[int]], prefix_caching: bool, block_size: int
) -> None:
    engine = tiny_engine(
        num_blocks=1024 // block_size, block_size=block_size, enable_prefix_caching=prefix_caching
    )
    outs = run_all(engine, prompts_mixed(), GREEDY)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    # a second round hits the prefix cache (prompts + answers were cached) and still matches
    outs2 = run_all(engine, {f"{rid}-again": p for rid, p in prompts_mixed().items()}, GREEDY)
    for rid in reference:
        assert outs2[f"{rid}-again"].token_ids == reference[rid]
        cached = outs2[f"{rid}-again"].num_cached_tokens
        assert cached == (len(prompts_mixed()[rid]) - 1 if prefix_caching else 0)
    _assert_pool_drains(engine)


def test_chunked_prefill_matches(reference: dict[str, list[int]]) -> None:
    engine = tiny_engine(max_num_batched_tokens=7)
    outs = run_all(engine, prompts_mixed(), GREEDY)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    long_ones = [o for o in outs.values() if o.num_prompt_tokens > 7]
    assert long_ones and all(sum(s.kind == "prefill" for s in o.trace.steps) > 1 for o in long_ones)


def test_preemption_under_tiny_pool(reference: dict[str, list[int]]) -> None:
    # 24 blocks of 4 tokens: 96 slots for 8 requests needing up to ~50 tokens each -> must preempt
    engine = tiny_engine(num_blocks=24, block_size=4)
    outs = run_all(engine, prompts_mixed(), GREEDY)
    assert engine.stats.num_preemptions_total > 0
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    _assert_pool_drains(engine)


def test_new_request_joins_running_batch() -> None:
    engine = tiny_engine()
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}  # b prefilled in the same step a decoded
    assert engine.num_running == 2


def test_seed_determinism_independent_of_batch() -> None:
    seeded = SamplingParams(temperature=3.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = run_all(tiny_engine(), {"s": [11, 12, 13]}, seeded)["s"].token_ids
    others = {f"o{i}": [20 + i, 30, 40 + i] for i in range(5)}
    params = {rid: SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True) for rid in others}
    params["s"] = seeded
    batched = run_all(tiny_engine(), {**others, "s": [11, 12, 13]}, params)["s"].token_ids
    assert alone == batched
    other_seed = run_all(
        tiny_engine(),
        {"s": [11, 12, 13]},
        SamplingParams(temperature=3.0, seed=99, max_tokens=10, ignore_eos=True),
    )["s"].token_ids
    assert other_seed != alone


def test_stop_string_across_token_boundary() -> None:
    tok = embedded_tokenizer()
    free = run_all(
        tiny_engine(), {"a": [100, 200, 300]}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )["a"]
    # choose a stop string that starts inside token 3 and ends inside token 4
    pieces = [tok.decode([t]) for t in free.token_ids]
    start = len("".join(pieces[:3]))
    assert len(pieces[3]) >= 1 and len(pieces[4]) >= 1
    stop = free.text[start + len(pieces[3]) - 1 : start + len(pieces[3]) + 1]
    first = free.text.find(stop)
    out = run_all(
        tiny_engine(),
        {"a": [100, 200, 300]},
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
    )["a"]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:first]
    assert stop not in out.text
    assert out.trace.stop_reason == stop


def test_max_tokens_and_stop_token_ids() -> None:
    out = run_all(
        tiny_engine(), {"a": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )["a"]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    third = out.token_ids[2]
    out2 = run_all(
        tiny_engine(),
        {"a": [1, 2, 3]},
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[third]),
    )["a"]
    assert out2.token_ids == out.token_ids[: out.token_ids.index(third) + 1]
    assert out2.finish_reason == "stop"


def test_abort_frees_blocks_at_once() -> None:
    engine = tiny_engine(num_blocks=64)
    engine.add_request(
        "a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    # no block is held for the request any more; only its prompt's KV stays, evictable, in the prefix cache
    assert engine.block_manager.num_free_blocks + engine.block_manager.num_evictable_blocks == 64
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.num_free_blocks == 64
    assert not engine.has_unfinished_requests()
    assert engine.abort("a") is None


def test_trace_records_stages() -> None:
    engine = tiny_engine()
    out = run_all(
        engine, {"a": list(range(100, 120))}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )["a"]
    t = out.trace
    assert t.num_prompt_tokens == 20 and t.num_prefilled_tokens == 20
    assert [s.kind for s in t.steps] == ["prefill", "decode", "decode", "decode"]
    assert [s.token_id for s in t.steps] == out.token_ids
    assert t.queue_time is not None and t.queue_time >= 0
    assert (
        t.time_to_first_token is not None and t.e2e_time is not None and t.e2e_time >= t.time_to_first_token
    )
    assert t.finish_reason == "length" and t.sampling["mode"] == "greedy"
    # a second request sharing 15 tokens then differing reports where the match broke
    prompt2 = list(range(100, 115)) + [7, 8, 9]
    out2 = run_all(engine, {"b": prompt2}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))["b"]
    assert out2.num_cached_tokens == 15
    assert out2.trace.divergence == {"index": 15, "prompt_token": 7, "cached_token": 115}
    assert out2.trace.num_prefilled_tokens == 3


def test_cache_salt_partitions_the_prefix_cache() -> None:
    """Requests share cached prefixes only under the same cache_salt: a second tenant's identical
    prompt prefills from scratch (no divergence reported from another tenant's path either), its own
    repeat hits, and the trace names the salt only by a hash."""
    engine = tiny_engine()
    prompt = list(range(100, 120))

    def run(rid: str, salt: str | None) -> Any:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt=salt)
        return run_all(engine, {rid: prompt}, params)[rid]

    a = run("a", "tenant-a")
    assert a.num_cached_tokens == 0
    b = run("b", "tenant-b")
    assert b.num_cached_tokens == 0 and b.trace.divergence is None
    assert run("a2", "tenant-a").num_cached_tokens == 19  # all but the last prompt token
    assert run("plain", None).num_cached_tokens == 0  # no salt shares with no salt only
    assert run("plain2", None).num_cached_tokens == 19
    assert b.token_ids == a.token_ids  # same prompt, same greedy tokens: only the cache differs
    digest = b.trace.sampling["cache_salt_sha256"]
    assert isinstance(digest, str) and len(digest) == 12 and "tenant" not in str(b.trace.to_dict())
    with pytest.raises(InvalidParameterError, match="cache_salt"):
        SamplingParams(cache_salt="")
    engine.block_manager.check_invariants()


def test_bad_input_is_typed() -> None:
    engine = tiny_engine(num_blocks=16, block_size=4)  # 64-token window
    with pytest.raises(ContextLengthExceededError, match="64") as e:
        engine.add_request("x", list(range(1, 70)), SamplingParams(max_tokens=1))
    assert "69" in str(e.value)
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("x", list(range(1, 50)), SamplingParams(max_tokens=30))
    with pytest.raises(InvalidParameterError, match="prompt"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        engine.add_request("x", [10**7], SamplingParams())
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        engine.add_request("x", [1], SamplingParams(logit_bias={10**7: 1.0}))
    assert not engine.has_unfinished_requests()


def _assert_pool_drains(engine) -> None:  # type: ignore[no-untyped-def]
    assert not engine.has_unfinished_requests()
    kv = engine.block_manager
    assert kv.num_free_blocks + kv.num_evictable_blocks == kv.num_blocks
    kv.reset_prefix_cache()
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_uninitialised_kv_memory_is_never_read(reference: dict[str, list[int]]) -> None:
    """The KV pool is allocated uninitialised (only slot 0, the padding slot, is zeroed): poison
    every other slot with NaN and the outputs must not change."""
    engine = tiny_engine()
    kv = engine.parts.kv_cache
    for t in (kv.k, kv.v):
        t.fill_(float("nan"))
        t[:, 0].zero_()
    outs = run_all(engine, prompts_mixed(), GREEDY)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference


@pytest.mark.slow
def test_max_model_len_builds_the_model_for_that_length() -> None:
    """--max-model-len 512 on the embedded model (window 8,192): RoPE tables of 512 rows, the model's
    own config unchanged for everything else, and a call that runs."""
    from onecall.config import EngineConfig
    from onecall.engine.engine import Engine
    from onecall.engine.engine_parts import load_engine_parts
    from onecall.model.layers import RotaryEmbedding

    parts = load_engine_parts(EngineConfig(max_model_len=512, kv_cache_gib=0.05))
    assert parts.max_model_len == 512 and parts.model_config.max_position_embeddings == 8192
    rotary = parts.model.rotary
    assert isinstance(rotary, RotaryEmbedding) and rotary.cos.shape[0] == 512
    engine = Engine(EngineConfig(max_model_len=512, kv_cache_gib=0.05), parts=parts)
    out = run_all(engine, {"r": "Hello"}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))["r"]
    assert len(out.token_ids) == 4


def test_only_the_trace_writes_its_fields() -> None:
    """One owner for the trace's stamps: outside engine/trace.py, no code assigns a field of a
    request's trace (`trace.x = ...`, `seq.trace.x += ...`); it calls the trace's record_* methods."""
    import ast
    from pathlib import Path

    import onecall

    root = Path(onecall.__file__).parent
    offenders = []
    # the grammar constraint's `self.trace` is its own GrammarTrace, which it owns and keeps current
    owners = {root / "engine" / "trace.py", root / "sampling" / "grammar_constraint.py"}
    for path in sorted(root.rglob("*.py")):
        if path in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    owner = t.value if isinstance(t, ast.Attribute) else None
                    if (
                        isinstance(owner, ast.Attribute)
                        and owner.attr == "trace"
                        or isinstance(owner, ast.Name)
                        and owner.id == "trace"
                    ):
                        offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
