"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside attention) through the whole engine: state
slots handed out and taken back, continuous batching with chunked prefill, preemption, aborts, and the
prefix cache resuming from state snapshots (engine/state_slots.py), against transformers' own greedy
generate on the same tiny random model (tests/helpers/make_models.py tiny_hybrid_hf).

Greedy tokens are compared exactly: the model's float32 logits match transformers' to ~1e-4
(tests/model/test_qwen35.py), and these prompts' top two logits are far apart at every step (checked
on the reference run, so a near-tie cannot make a test flaky).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine
from onecall.engine.engine_parts import LoadedEngineParts
from onecall.formats.checkpoint import resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from onecall.model.state_cache import LinearStateCache
from onecall.sampling_params import SamplingParams
from tests.helpers.make_models import tiny_hybrid_hf
from tests.helpers.tiny_engine import drain, embedded_tokenizer

BLOCK = 4
MARGIN = 1e-2  # the smallest gap allowed between a reference step's top two logits


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hybrid_hf("qwen3_5", seed=3)


def hybrid_engine(hf: Any, num_blocks: int = 64, **config: Any) -> Engine:
    """The tiny hybrid model as an engine (the embedded tokenizer rides along: prompts are token ids
    below the model's 160)."""
    mc = model_config_from_hf(hf.config.to_dict())
    model = DecoderLM(mc, kernels=config.get("kernels", "fast"))
    load_weights(model, hf.state_dict().items())
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BLOCK, **config)
    kv_cache = PagedKVCache(mc.num_kv_layers, num_blocks, BLOCK, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu")
    shape = mc.linear_state_shape
    assert shape is not None
    kv_cache.state = LinearStateCache(shape, cfg.num_state_slots, torch.float32, "cpu")
    parts = LoadedEngineParts(
        files=resolve_model(None), model_config=mc, model=model.eval(), tokenizer=embedded_tokenizer(),
        kv_cache=kv_cache, num_blocks=num_blocks, max_model_len=num_blocks * BLOCK, device=torch.device("cpu"),
        dtype=torch.float32, load_seconds=0.0,
    )  # fmt: skip
    return Engine(cfg, parts=parts)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def transformers_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, with each step's top-two gap checked (module docstring)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    for scores in out.scores:
        top2 = scores[0].topk(2).values
        assert float(top2[0] - top2[1]) > MARGIN, "a near-tie: pick another prompt"
    return out.sequences[0, len(prompt) :].tolist()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompts: dict[str, list[int]], n: int) -> dict[str, Any]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy(n))
    return drain(engine)


def test_concurrent_chunked_requests_equal_transformers(hf: Any) -> None:
    """Three prompts at once under a small token budget: prompts chunked (one into 4 pieces, not on the
    conv's or the delta rule's boundaries) beside decode rows; every request gets transformers' tokens,
    and every live slot is back at the end."""
    prompts = {"a": prompt(13, 1), "b": prompt(5, 2), "c": prompt(22, 3)}
    want = {rid: transformers_greedy(hf, ids, 8) for rid, ids in prompts.items()}
    engine = hybrid_engine(hf, max_num_batched_tokens=7, max_num_seqs=3)
    got = run(engine, prompts, 8)
    assert {rid: list(o.token_ids) for rid, o in got.items()} == want
    slots = engine.scheduler.state_slots
    assert slots is not None and slots.num_live == 3
    slots.check_invariants()
    assert not slots._live  # every finished request gave its live slot back


@pytest.mark.slow
def test_a_chat_turn_resumes_from_the_previous_turns_state(hf: Any) -> None:
    """Turn 2 re-sends turn 1's prompt and answer: its KV matches all turn 1 fed, and the state resumes
    from the snapshot taken when turn 1 finished: only the new tokens are prefilled, and the answer is
    exactly a fresh engine's. A request sharing only a prefix without a snapshot inside its match
    starts from scratch; its trace says how much KV matched and where the state resumed."""
    p1 = prompt(17, 4)
    engine = hybrid_engine(hf, max_num_batched_tokens=64)
    out1 = run(engine, {"t1": p1}, 6)["t1"]
    turn2 = p1 + list(out1.token_ids) + prompt(5, 5)
    out2 = run(engine, {"t2": turn2}, 6)["t2"]
    fed = len(p1) + len(out1.token_ids) - 1  # the last sampled token was never fed
    assert out2.num_cached_tokens == fed
    assert out2.trace.state_resumed_at == fed and out2.trace.num_kv_matched_tokens == fed
    assert list(out2.token_ids) == transformers_greedy(hf, turn2, 6)
    # a prompt sharing turn 1's first 10 tokens: KV for 10, but no state snapshot inside them
    other = run(engine, {"o": p1[:10] + prompt(4, 6)}, 2)["o"]
    assert other.trace.num_kv_matched_tokens == 10 and other.trace.state_resumed_at == 0
    assert other.num_cached_tokens == 0
    assert list(other.token_ids) == transformers_greedy(hf, p1[:10] + prompt(4, 6), 2)


def test_the_same_system_prompt_resumes_from_the_prompt_snapshot(hf: Any) -> None:
    """A prompt fully computed leaves a snapshot: a second request extending it resumes there."""
    system = prompt(20, 7)
    engine = hybrid_engine(hf, max_num_batched_tokens=64)
    run(engine, {"a": system}, 1)
    b = system + prompt(3, 8)
    out = run(engine, {"b": b}, 4)["b"]
    assert out.trace.state_resumed_at == len(system) and out.num_cached_tokens == len(system)
    assert list(out.token_ids) == transformers_greedy(hf, b, 4)


@pytest.mark.slow
def test_preemption_and_abort_keep_every_state_right(hf: Any) -> None:
    """A pool too small for all three requests preempts (recompute; a preempted request may resume from
    its own snapshot) and an abort mid-generation frees its slot for the next request: every completed
    request still gets transformers' tokens."""
    prompts = {"a": prompt(11, 21), "b": prompt(9, 22), "c": prompt(10, 23)}
    want = {rid: transformers_greedy(hf, ids, 10) for rid, ids in prompts.items()}
    engine = hybrid_engine(hf, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy(10))
    engine.add_request("x", prompt(6, 12), greedy(10))
    for _ in range(3):
        engine.step()
    engine.abort("x")
    got = drain(engine)
    assert engine.stats.num_preemptions_total > 0, "the pool was meant to force a preemption"
    assert {rid: list(got[rid].token_ids) for rid in prompts} == want
    engine.scheduler.state_slots.check_invariants()  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_rewritten_prompt_end_resumes_at_the_aligned_snapshot(hf: Any) -> None:
    """Qwen3's template drops the empty think block it wrote at the end of turn k's prompt once that
    turn is history: turn k + 1 diverges a few tokens before turn k's prompt end, past the prompt-end
    and finish snapshots. The forward wrote one more, mid-chunk, at the prompt's last 64-token boundary
    at least 16 tokens before its end (engine/state_slots.py): the hit resumes there, and the answer is
    still exactly transformers'."""
    p1 = prompt(90, 13)
    engine = hybrid_engine(hf, max_num_batched_tokens=128)
    run(engine, {"t1": p1}, 3)
    turn2 = p1[:-3] + prompt(6, 14)  # the last 3 prompt tokens rewritten, the reply not re-sent
    out = run(engine, {"t2": turn2}, 5)["t2"]
    assert out.trace.num_kv_matched_tokens == len(p1) - 3
    assert out.trace.state_resumed_at == 64 == out.num_cached_tokens
    assert list(out.token_ids) == transformers_greedy(hf, turn2, 5)


def test_a_forward_that_never_ran_leaves_no_snapshot() -> None:
    """A snapshot reserved for a step's forward is resumable only once that forward ran; one whose
    forward raised is dropped unread."""
    from onecall.engine.state_slots import StateSlots

    s = StateSlots(num_live=1, num_snapshots=2)
    slot = s.reserve([1, 2, 3])
    assert slot is not None and s.best([1, 2, 3, 4], limit=3).num_tokens == 0  # not yet written
    s.drop_pending()
    s.check_invariants()
    assert s.best([1, 2, 3, 4], limit=3).num_tokens == 0
    slot = s.reserve([1, 2, 3])
    assert s.reserve([1, 2, 3]) is None  # reserved once per step
    s.confirm_pending()
    assert s.best([1, 2, 3, 4], limit=3).slot == slot
    assert s.reserve([1, 2, 3]) is None  # kept already
    s.check_invariants()


def test_snapshots_follow_prefix_caching_and_a_state_starved_budget_says_so(tmp_path: Any) -> None:
    """Without prefix caching nothing resumes from a snapshot, so none are reserved by default; a
    budget the states eat is refused naming the states' share, not only "0 blocks"."""
    from onecall import LLM
    from onecall.errors import InvalidParameterError
    from tests.helpers.make_models import write_tiny_hybrid_chat_folder

    assert EngineConfig(max_num_seqs=8).num_state_snapshots == 8
    assert EngineConfig(max_num_seqs=8, enable_prefix_caching=False).num_state_snapshots == 0
    assert EngineConfig(max_num_seqs=8, enable_prefix_caching=False, state_snapshots=3).num_state_slots == 11
    folder = write_tiny_hybrid_chat_folder(tmp_path / "tiny-qwen3.5")
    with pytest.raises(
        InvalidParameterError, match=r"states take .* \(16 slots of .*max_num_seqs 8 \+ state_snapshots 8"
    ):
        LLM(model=str(folder), kv_cache_gib=1e-5, max_num_seqs=8)
