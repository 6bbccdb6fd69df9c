"""The whole-step native decode (loading/native_step.py) against the per-op fast path, bitwise.

Tolerance: none. The step runs the per-op path's kernels in the same order on the same values, so
hidden states and every K/V byte written must be identical; that is what keeps a request's tokens
independent of whether its step was all-decode (this path) or mixed (the per-op path).
"""

from __future__ import annotations

import copy

import pytest
import torch

from onecall.kernels.cpu import native
from onecall.loading.native_step import NativeDecodeStep
from onecall.loading.packing import enable_fast_kernels
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from tests.helpers.int4 import int4_engine
from tests.helpers.make_models import fast_copy
from tests.helpers.tiny_engine import tiny_model

pytestmark = pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
BLOCK = 4
PROMPT_LENS = (5, 9, 2)  # a partial block, two blocks and a bit, less than a block


def _scrambled_tables(num_blocks: int) -> list[list[int]]:
    """Block tables for PROMPT_LENS + a few decode steps, out of order and not consecutive (so the
    kernels read through the tables), never block 0."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(3)) + 1
    per_seq = (num_blocks - 1) // len(PROMPT_LENS)
    return [perm[i * per_seq : (i + 1) * per_seq].tolist() for i in range(len(PROMPT_LENS))]


def _prefill(model: DecoderLM, cache: PagedKVCache, tables: list[list[int]]) -> None:
    ids = torch.randint(
        0, model.config.vocab_size, (sum(PROMPT_LENS),), generator=torch.Generator().manual_seed(1)
    )
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENS])
    meta = build_attention_metadata(tables, PROMPT_LENS, PROMPT_LENS, BLOCK, "cpu", num_decode=0)
    with torch.inference_mode():
        model(ids, positions, cache, meta)


def _decode(model: DecoderLM, cache: PagedKVCache, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """One all-decode step: the next token of every sequence (lens: KV lengths after the step)."""
    ids = torch.tensor([11 * (i + 1) + n for i, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    meta = build_attention_metadata(tables, lens, [1] * len(lens), BLOCK, "cpu", num_decode=len(lens))
    with torch.inference_mode():
        return model(ids, positions, cache, meta)


@pytest.mark.parametrize(
    ("arch", "window", "softcap", "int8_group", "act8"),
    [
        ("qwen2", None, None, 0, False),  # q/k/v biases in the 4-bit projections
        ("qwen3", None, None, 0, False),  # q/k norms
        ("qwen2", 3, 2.0, 0, False),  # a sliding window and logit soft-capping
        ("qwen2", None, None, 32, False),  # projections in int8 groups of 32 (Q8_0)
        ("qwen3", None, None, 16, False),  # ... and of 16 (Q6_K)
        ("qwen3", None, None, 0, True),  # 4-bit projections with int8 activations
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_native_step_gives_the_per_op_paths_bits(
    kv_dtype: torch.dtype, arch: str, window: int | None, softcap: float | None, int8_group: int, act8: bool
) -> None:
    model = int4_engine("fast", arch=arch, int8_group=int8_group, int8_activations=act8).parts.model
    assert ("int8 activations" in model.kernels) == act8, model.kernels
    for layer in model.model.layers:  # per-layer attention options, as Gemma/Mistral configs set them
        layer.self_attn.sliding_window, layer.self_attn.logit_softcap = window, softcap  # type: ignore[union-attr]
    model.native_step = NativeDecodeStep.build(model.model)
    step = model.native_step
    assert step is not None, model.kernels
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, kv_dtype, "cpu")
    cache.k.zero_(), cache.v.zero_()  # uninitialised memory may hold NaNs, which torch.equal never matches
    tables = _scrambled_tables(40)
    _prefill(model, cache, tables)
    lens = list(PROMPT_LENS)
    for _ in range(6):  # crosses block boundaries of every sequence
        lens = [n + 1 for n in lens]
        per_op_cache = copy.deepcopy(cache)
        got = _decode(model, cache, tables, lens)
        model.native_step = None
        try:
            want = _decode(model, per_op_cache, tables, lens)
        finally:
            model.native_step = step
        assert torch.equal(got, want)
        assert torch.equal(cache.k, per_op_cache.k) and torch.equal(cache.v, per_op_cache.v)


def test_native_step_takes_only_all_decode_steps_on_the_4bit_kernel() -> None:
    model = int4_engine("fast").parts.model
    step = model.native_step
    assert step is not None
    c = model.config
    cache = PagedKVCache(
        c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
    )
    tables = _scrambled_tables(40)
    decode = build_attention_metadata(tables[:2], [6, 3], [1, 1], BLOCK, "cpu")
    mixed = build_attention_metadata(tables[:2], [6, 3], [1, 3], BLOCK, "cpu")
    assert step.accepts(decode, cache, 2)
    assert not step.accepts(mixed, cache, 4)  # a prompt chunk shares the step: the per-op path
    planned = build_attention_metadata(tables[:2], [6, 3], [1, 1], BLOCK, "cpu", num_decode=0)
    assert not step.accepts(planned, cache, 2)  # the rows are planned as prompt rows: the per-op path
    bf16 = PagedKVCache(
        c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, torch.bfloat16, "cpu"
    )
    assert not step.accepts(decode, bf16, 2)


def test_a_token_id_or_position_outside_the_tables_is_refused_before_anything_is_written() -> None:
    """The step gathers embedding and RoPE rows in C: an id past the vocabulary or a position past the
    RoPE tables raises IndexError, and the cache is left as it was."""
    model = int4_engine("fast").parts.model
    step = model.native_step
    assert step is not None
    c = model.config
    cache = PagedKVCache(
        c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
    )
    cache.k.zero_(), cache.v.zero_()
    tables = _scrambled_tables(40)
    meta = build_attention_metadata(tables[:2], [6, 3], [1, 1], BLOCK, "cpu", num_decode=2)
    cos, sin = model.rotary.cos, model.rotary.sin  # type: ignore[union-attr]
    ok_ids, ok_pos = torch.tensor([5, 7]), torch.tensor([5, 2])
    for ids, pos, what in (
        (torch.tensor([5, c.vocab_size]), ok_pos, "vocabulary"),
        (torch.tensor([-1, 7]), ok_pos, "vocabulary"),
        (ok_ids, torch.tensor([5, cos.shape[0]]), "RoPE tables"),
        (ok_ids, torch.tensor([-1, 2]), "RoPE tables"),
    ):
        with torch.inference_mode(), pytest.raises(IndexError, match=what):
            step(ids, pos, cos, sin, cache, meta)
        assert not cache.k.any() and not cache.v.any()
    with torch.inference_mode():
        out = step(ok_ids, ok_pos, cos, sin, cache, meta)
    assert out.shape == (2, c.hidden_size) and torch.isfinite(out).all() and cache.k.any()


def test_models_it_cannot_run_exactly_keep_the_per_op_path() -> None:
    """No 4-bit copy of the projections (a float checkpoint): no native step, for any family."""
    for arch in ("llama", "qwen3"):
        dense = fast_copy(tiny_model(arch))  # the native ops, which the step needs: only 4-bit is missing
        assert dense.ops.name == "native"
        enable_fast_kernels(dense)
        assert "onednn" in dense.kernels and dense.native_step is None
