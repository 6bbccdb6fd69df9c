"""LayerOps.delta_decode_rows on the native kernels (csrc/delta_rule.c) against a Gated DeltaNet layer's
own torch path (model/qwen35.py's GatedDeltaNet, model/delta_rule.py) run in float64.

The kernel takes the rows of the layer's input projection [qkv | z | b | a] and does everything up to
the output projection: the conv step, SiLU, the l2 norms, the gates, the delta rule and the gated
RMSNorm, the conv and recurrent states read and written in place in their slots. The oracle is the same
layer's torch path (GatedDeltaNet._torch_rows: the conv step, prepare_qk, gated_delta_step_,
RMSNormGated) with every weight, row and state in float64; the kernel runs in float32 on the same values
rounded to float32. Several rows in scattered slots of a state cache's second layer, a fresh row (its
slot full of NaN, which it must never read), two key heads for four value heads, a conv kernel of 4,
head sizes off the 8-lane width; three steps in a row, so the conv state's shift and the recurrent
state carry over.

Measured (this machine, torch 2.13), tolerance in brackets: outputs (up to ~7 here, ~13 at 128 x 128
heads) <= 7.1e-6 (ATOL_OUT 5e-5); recurrent states (up to ~2) <= 4.7e-7, conv states <= 1.2e-7 (the
float32 rounding of their inputs) (ATOL 1e-5); the whole layer, native vs its float32 torch path over a
step mixing decode rows and a prompt chunk, outputs up to ~45: <= 1.9e-6 (ATOL_OUT), states <= 1.2e-7
(ATOL). Slots no row names, and the cache's other layer, keep their bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from onecall.kernels.cpu import native
from onecall.kernels.cpu.ops import NativeLayerOps
from onecall.kernels.ops import REFERENCE_OPS, DeltaNetWeights, LayerOps
from onecall.model.attention_metadata import AttentionMetadata, SeqSpan
from onecall.model.config import GLOBAL, LINEAR, LinearAttentionSpec, ModelConfig
from onecall.model.delta_rule import L2_EPS
from onecall.model.qwen35 import GatedDeltaNet
from onecall.model.state_cache import LinearStateCache

LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

ATOL = 1e-5  # states of size ~1: float32 against float64
ATOL_OUT = 5e-5  # the gated norm's outputs, up to ~10 (scaled by the norm weight and silu(z))
NUM_SLOTS = 6
LAYER = 1  # the state cache's second linear layer: its views start past the first's


def make_config(k_dim: int, v_dim: int) -> tuple[ModelConfig, LinearAttentionSpec]:
    spec = LinearAttentionSpec(
        layer_types=(LINEAR, LINEAR, GLOBAL),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=k_dim,
        linear_value_head_dim=v_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    config = ModelConfig(
        architecture="qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        partial_rotary_factor=0.25, linear_attention=spec, attn_output_gate=True,
    )  # fmt: skip
    return config, spec


def make_layer(k_dim: int, v_dim: int, seed: int, ops: LayerOps = REFERENCE_OPS) -> GatedDeltaNet:
    """A float64 layer with random weights (a gated norm weight away from ones, decays of all sizes)."""
    config, spec = make_config(k_dim, v_dim)
    layer = GatedDeltaNet(config, spec, torch.float64, "cpu", ops)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        layer.norm.weight.add_(1.0)
    return layer


def make_cache(layer: GatedDeltaNet, dtype: torch.dtype, seed: int) -> LinearStateCache:
    """A two-layer state cache with random states (recurrent in `dtype` too: float64 for the oracle)."""
    config, _ = make_config(layer.k_head_dim, layer.v_head_dim)
    shape = config.linear_state_shape
    assert shape is not None
    cache = LinearStateCache(shape, NUM_SLOTS, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.conv = torch.randn(cache.conv.shape, generator=gen, dtype=torch.float64).to(dtype)
    cache.recurrent = (torch.randn(cache.recurrent.shape, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    return cache


def decode_meta(slots: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """A step of one-token sequences, row i in slot slots[i], seq_lens[i] tokens after it (1: fresh)."""
    seqs = [SeqSpan(i, i + 1, n, -1, None, None, None) for i, n in enumerate(seq_lens)]
    return AttentionMetadata(
        backend="paged", slot_mapping=torch.zeros(len(slots), dtype=torch.int64), seqs=seqs, block_size=4,
        num_decode=len(slots), state_slots=torch.tensor(slots, dtype=torch.int64),
    )  # fmt: skip


def weights_of(layer: GatedDeltaNet) -> DeltaNetWeights:
    return DeltaNetWeights(
        layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight, layer.norm.eps, L2_EPS,
        layer.num_k_heads, layer.k_head_dim,
    )  # fmt: skip


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize(("k_dim", "v_dim"), [(12, 20), (32, 48)])
def test_decode_rows_match_the_float64_torch_path(k_dim: int, v_dim: int) -> None:
    """Three rows in slots 4, 1, 3 (slot 1 fresh at the first step, its states NaN), three steps."""
    assert LIB is not None
    layer64 = make_layer(k_dim, v_dim, seed=1)
    layer32 = make_layer(k_dim, v_dim, seed=1).float()
    ref = make_cache(layer64, torch.float64, seed=2)
    ours = make_cache(layer64, torch.float32, seed=2)
    ref.conv[LAYER, 1] = ours.conv[LAYER, 1] = math.nan
    ref.recurrent[LAYER, 1] = ours.recurrent[LAYER, 1] = math.nan
    start_conv, start_recurrent = ours.conv.clone(), ours.recurrent.clone()
    ops = NativeLayerOps(LIB)
    slots = [4, 1, 3]
    width = layer64.conv_dim + layer64.value_dim + 2 * layer64.num_v_heads
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        seq_lens = [9 + step, 1 + step, 5 + step]  # slot 1's sequence starts at this first step
        meta = decode_meta(slots, seq_lens)
        proj64 = torch.randn(len(slots), width, generator=gen, dtype=torch.float64)
        proj64[:, -2 * layer64.num_v_heads :] *= 2  # gates over a wider range
        want = layer64._torch_rows(proj64, list(range(len(slots))), ref, LAYER, meta, {})
        fresh = torch.tensor([n == 1 for n in seq_lens])
        slot_t = torch.tensor(slots, dtype=torch.int64)
        got = ops.delta_decode_rows(
            proj64.float(), weights_of(layer32), slot_t, fresh, ours.conv[LAYER], ours.recurrent[LAYER]
        )
        assert got is not None and got.shape == (len(slots), layer64.value_dim)
        assert max_diff(got, want) <= ATOL_OUT, f"step {step}: outputs off by {max_diff(got, want):.2e}"
        for s in slots:
            assert max_diff(ours.conv[LAYER, s], ref.conv[LAYER, s]) <= ATOL
            assert max_diff(ours.recurrent[LAYER, s], ref.recurrent[LAYER, s]) <= ATOL
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(ours.conv[LAYER, untouched], start_conv[LAYER, untouched])
    assert torch.equal(ours.recurrent[LAYER, untouched], start_recurrent[LAYER, untouched])
    assert torch.equal(ours.conv[0], start_conv[0]) and torch.equal(ours.recurrent[0], start_recurrent[0])


def test_the_layer_on_native_ops_equals_its_torch_path_in_a_mixed_step() -> None:
    """GatedDeltaNet.forward with the native ops (decode rows in C) vs the reference ops (all torch), float32,
    over a step of two decode rows then a 5-token prompt chunk: outputs and states agree."""
    assert LIB is not None
    layer = make_layer(16, 24, seed=4).float()
    native_layer = make_layer(16, 24, seed=4, ops=NativeLayerOps(LIB)).float()
    ref, ours = make_cache(layer, torch.float32, seed=5), make_cache(layer, torch.float32, seed=5)
    seqs = [SeqSpan(0, 1, 8, -1, None, None, None), SeqSpan(1, 2, 3, -1, None, None, None)]
    seqs.append(SeqSpan(2, 7, 5, -1, None, None, None))  # a prompt from position 0 (its slot not read)
    meta = AttentionMetadata(
        backend="paged", slot_mapping=torch.zeros(7, dtype=torch.int64), seqs=seqs, block_size=4,
        num_decode=2, state_slots=torch.tensor([2, 5, 0], dtype=torch.int64),
    )  # fmt: skip
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = layer(x, ref, LAYER, meta)
        got = native_layer(x, ours, LAYER, meta)
    assert max_diff(got, want) <= ATOL_OUT
    assert max_diff(ours.conv, ref.conv) <= ATOL and max_diff(ours.recurrent, ref.recurrent) <= ATOL
    assert not torch.equal(
        ours.recurrent[LAYER, 2], make_cache(layer, torch.float32, seed=5).recurrent[LAYER, 2]
    )


def test_declines_what_it_does_not_take() -> None:
    """float64 rows or a float16 conv state: None, and nothing written."""
    assert LIB is not None
    layer = make_layer(8, 8, seed=7)
    ops = NativeLayerOps(LIB)
    cache = make_cache(layer, torch.float32, seed=8)
    before = cache.recurrent.clone()
    width = layer.conv_dim + layer.value_dim + 2 * layer.num_v_heads
    slots = torch.tensor([0], dtype=torch.int64)
    proj = torch.randn(1, width, dtype=torch.float64)
    assert (
        ops.delta_decode_rows(proj, weights_of(layer), slots, None, cache.conv[0], cache.recurrent[0]) is None
    )
    w32 = weights_of(layer.float())
    half = cache.conv[0].half()
    assert ops.delta_decode_rows(proj.float(), w32, slots, None, half, cache.recurrent[0]) is None
    assert (
        REFERENCE_OPS.delta_decode_rows(proj.float(), w32, slots, None, cache.conv[0], cache.recurrent[0])
        is None
    )
    assert torch.equal(cache.recurrent, before)


@pytest.mark.parametrize("slots", [[0, 6], [2, 2]])
def test_a_slot_outside_the_cache_or_used_twice_is_refused_before_any_write(slots: list[int]) -> None:
    assert LIB is not None
    layer = make_layer(8, 8, seed=9).float()
    cache = make_cache(layer, torch.float32, seed=10)
    conv, recurrent = cache.conv.clone(), cache.recurrent.clone()
    width = layer.conv_dim + layer.value_dim + 2 * layer.num_v_heads
    with pytest.raises(ValueError, match="outside 0..5 or repeated"):
        NativeLayerOps(LIB).delta_decode_rows(
            torch.randn(2, width),
            weights_of(layer),
            torch.tensor(slots),
            None,
            cache.conv[0],
            cache.recurrent[0],
        )
    assert torch.equal(cache.conv, conv) and torch.equal(cache.recurrent, recurrent)
