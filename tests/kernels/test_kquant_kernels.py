"""The K-quants' low-bit codes on their own bits (csrc/gemm_kq.c: Q6_K, Q3_K, Q2_K as quants.KQuantGroups,
native.pack_kq's layout), against gguf's own dequantization of the same bytes and a float64 matmul; and
models loaded from GGUFs that store their weights so.

Tolerances, written down:
* kq GEMM (int16 activations): the q4 kernel's bound (test_native_kernels.py, test_quant_kernels.py).
  Each activation is rounded to a multiple of its group's step dx = absmax / 32767 (|x - x_q| <= dx / 2);
  a half-group's dot (16 columns) is an exact integer, |dot| <= 16 x 32 x 32767 < 2^24, so exact in
  float32 too; scaling and summation are float32. So |y - ref| <= sum_g (dx_g / 2) * sum_{j in g} |w_j| +
  1e-5 * (|x| @ |W|^T) + 1e-6, ref = x @ W^T (+ b) in float64 on gguf's dequantized W. Q2_K adds its
  offset term, -dmin * m times the float32 sum of 16 activations (relative error <= 16 x 2^-24 < 1e-6,
  then one FMA): + 1e-5 * (sum16(|x|) @ |dmin * m|^T). The mean error is also checked to sit well
  inside the bound (the bound is not trivially loose).
* batch invariance: a row's output is bitwise the same whatever the number of rows and threads.
* rows (embedding lookups): bit for bit with gguf's dequantization.
* models (tiny random Llama / Qwen3 GGUFs whose every 2-D weight is Q6_K / Q3_K / Q2_K, and a Q4_K_M-style
  mix with attn_v / ffn_down in Q6_K): the fast path's logits against the reference path's on the same
  file within 5e-3 (test_quant_kernels.MODEL_ATOL, the families' FAST_ATOL for Q8_0): the int16 activation
  steps, compounded over the layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from onecall.formats.quants import KQuantGroups, kquant_groups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import FastLinear, FastLMHead, pack_stored, runs_stored_only
from onecall.loading import packing
from tests.formats.test_stored_groups import random_blocks
from tests.helpers import kquant_blocks, make_models, stored_models
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_converted_gguf, write_tiny_gguf
from tests.kernels.test_quant_kernels import MODEL_ATOL, _int16_bound
from tests.loading.test_pack_cache import cache_dir  # noqa: F401  (the fixture: a cache in tmp_path)
from tests.model.test_model_numerics import Harness, Seq

T = GGMLQuantizationType
LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
K_TYPES = [T.Q6_K, T.Q3_K, T.Q2_K]
BITS = {T.Q6_K: 6, T.Q3_K: 3, T.Q2_K: 2}
KIND = {T.Q6_K: "q6k", T.Q3_K: "q3k", T.Q2_K: "q2k"}


def _groups(rows: int, cols: int, qtype: T, seed: int) -> tuple[KQuantGroups, torch.Tensor]:
    """Random blocks (finite scales: test_stored_groups.random_blocks) -> (their KQuantGroups, gguf's
    dequantization (rows, cols) float32)."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows * cols // block_size, seed)
    groups = kquant_groups(torch.from_numpy(raw.reshape(-1).copy()), qtype, (rows, cols))  # type: ignore[arg-type]
    assert groups is not None and groups.bits == BITS[qtype]
    return groups, torch.from_numpy(gguf_dequantize(raw, qtype).reshape(rows, cols))


def _bound(x: torch.Tensor, w: torch.Tensor, g: KQuantGroups) -> torch.Tensor:
    """float64 (rows, N): the module docstring's bound (Q2_K with its offset term)."""
    bound = _int16_bound(x, w)
    if g.sub_min is not None and g.dmin is not None:
        offsets = g.dmin.double().repeat_interleave(16, dim=1) * g.sub_min.double()  # (N, K / 16)
        sums = x.double().abs().view(x.shape[0], -1, 16).sum(-1)
        bound = bound + 1e-5 * (sums @ offsets.T)
    return bound


def _kq(x: torch.Tensor, g: KQuantGroups, bias: torch.Tensor | None = None, threads: int = 2) -> torch.Tensor:
    assert LIB is not None
    packed = native.pack_kq(g.bits, g.q, g.sub_scale, g.d, g.sub_min, g.dmin)
    return native.kq_gemm(LIB, x.contiguous(), packed, bias, threads)


@pytest.mark.parametrize("rows", [1, 2, 3, 70])  # tiles of 2, then 1; 70: past a chunk of 64
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_kq_gemm_within_the_activation_rounding_bound(qtype: T, rows: int) -> None:
    groups, w = _groups(37, 512, qtype, seed=rows)  # 37: padding rows in the last unit
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[:, 5] += 3.0  # an outlier column: its group's step is coarse
    bias = torch.randn(37)
    got = _kq(x, groups, bias).double()
    ref = x.double() @ w.double().T + bias.double()
    err, bound = (got - ref).abs(), _bound(x, w, groups)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.mean()) < 0.5 * float(bound.mean())


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_kq_gemm_rows_are_batch_invariant_and_a_nan_poisons_its_row_only(qtype: T) -> None:
    groups, _ = _groups(40, 768, qtype, seed=3)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(9))
    full = _kq(x, groups)
    for m in (1, 4, 7):
        assert torch.equal(_kq(x[:m], groups, threads=1), full[:m])
        assert torch.equal(_kq(x[m:], groups), full[m:])
    x[4, 100] = float("nan")
    y = _kq(x, groups)
    assert bool(y[4].isnan().all()) and not bool(y[torch.arange(9) != 4].isnan().any())


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_kq_rows_are_the_dequantized_table_and_bytes_are_the_codes_own(qtype: T) -> None:
    groups, table = _groups(45, 512, qtype, seed=5)
    packed = pack_stored(groups)
    assert isinstance(packed, native.KQPacked) and native.kind(packed) == KIND[qtype]
    assert torch.equal(native.rows(LIB, packed, torch.arange(45)), table)  # type: ignore[arg-type]
    embed = StoredEmbedding(packed)
    ids = torch.tensor([[44, 0, 7], [7, 16, 15]])  # any shape, repeats, the edges of a unit
    assert torch.equal(embed(ids), table[ids])
    with pytest.raises(IndexError):
        native.rows(LIB, packed, torch.tensor([45]))  # type: ignore[arg-type]
    # bits a weight: the codes, an int8 per 16 (Q2_K: two) and float16 d (dmin) per 256; 48 padded rows
    per_row = (
        512 * BITS[qtype] / 8
        + 512 / 16 * (2 if qtype == T.Q2_K else 1)
        + 512 / 256 * 2 * (2 if qtype == T.Q2_K else 1)
    )
    assert packed.nbytes == 48 * per_row


def test_a_projection_in_k_quant_parts_runs_every_row_with_no_float32_copy() -> None:
    """A fused projection whose parts are Q6_K, Q3_K and Q2_K: each part its own kq call, no oneDNN
    copy, every row within the bound; the logits head on a Q6_K table (tied-head style)."""
    parts, dense, start = [], [], 0
    for qtype, n in ((T.Q6_K, 32), (T.Q3_K, 16), (T.Q2_K, 16), (T.Q6_K, 16)):
        g, w = _groups(n, 256, qtype, seed=n + int(qtype))
        parts.append((start, start + n, g))
        dense.append(w)
        start += n
    assert runs_stored_only(parts)
    fast = FastLinear(None, None, parts)
    assert fast.every_row and fast.packed is None and fast.decode_kernel == "native q2k+q3k+q6k"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    weight = torch.cat(dense)
    with torch.no_grad():
        got = fast(x).double()
    bound = torch.cat([_bound(x, w, g) for (_, _, g), w in zip(parts, dense, strict=True)], dim=1)
    assert bool(((got - x.double() @ weight.double().T).abs() <= bound).all())
    head = FastLMHead(torch.empty(32, 256, device="meta"), parts[0][2])  # never a float32 matrix
    assert head.from_stored and head.kernel == "native q6k"
    assert torch.equal(head(x), fast(x)[:, :32])


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", T.Q6_K), ("qwen3", T.Q3_K), ("qwen3", T.Q2_K)],
    ids=["llama-Q6_K", "qwen3-Q3_K", "qwen3-Q2_K"],
)
def test_a_k_quant_gguf_runs_every_weight_on_its_codes(
    arch: str, qtype: T, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection, the token embedding and the logits head on the file's own codes: no float32
    copy of any (none expanded, none a parameter, no oneDNN copy); the kernels line names the type; the
    one-call decode step runs them; the logits the reference path's on the same file within tolerance."""
    config = tiny_hf_config(arch, hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64)
    monkeypatch.setattr(make_models, "quantize", kquant_blocks.quantize)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=3), config, weight_type=qtype)
    ref = stored_models.load(path, fast=False)
    with monkeypatch.context() as m:
        # where a meta part would be expanded
        m.setattr(packing.StreamingPacker, "_dense", stored_models.never)
        fast = stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    stored_models.assert_every_projection_stored(fast, n, KIND[qtype], native.KQPacked)
    embed = fast.model.embed_tokens
    assert isinstance(embed, StoredEmbedding) and isinstance(embed.table, native.KQPacked)
    assert fast.fast_lm_head is not None and fast.fast_lm_head.kernel == f"native {KIND[qtype]}"
    assert fast.native_step is not None
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)


def test_a_q4_k_m_style_mix_runs_v_and_down_on_q6_k_codes_in_the_one_call_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-quantize's Q4_K_M keeps attn_v and ffn_down in Q6_K: here q/k/o/gate/up Q4_0 beside them.
    The kernels line names both; the fused qkv runs as a chain (4-bit q/k, 6-bit v) in the one-call
    decode step, which gives the per-op path's bits (hidden states and the KV written)."""
    monkeypatch.setattr(make_models, "quantize", kquant_blocks.quantize)
    config = tiny_hf_config(
        "qwen3", hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64
    )
    path = write_converted_gguf(
        tmp_path / "mix.gguf", random_state_dict(config, seed=4), config, weight_type=T.Q4_0,
        type_overrides={"attn_v": T.Q6_K, "ffn_down": T.Q6_K},
    )  # fmt: skip
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    assert f"native int4+q6k ({n} of {n} projections, every row)" in fast.kernels, fast.kernels
    qkv = fast.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert isinstance(qkv, FastLinear) and [type(p) for _, _, p in qkv.parts] == [
        native.Q4Packed,
        native.KQPacked,
    ]
    assert fast.native_step is not None
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)
    step, tokens, outs = fast.native_step, list(range(5, 18)), []
    for native_step in (step, None):
        fast.native_step = native_step
        harness, seq = Harness(fast), Seq(list(tokens))
        harness.kv_cache.k.zero_(), harness.kv_cache.v.zero_()  # unwritten slots compare equal
        harness.step([(seq, 13)])
        seq.tokens.append(7)
        outs.append((harness.step([(seq, 1)], num_decode=1)[0], harness.kv_cache))
    (got, got_kv), (want, want_kv) = outs
    assert torch.equal(got, want) and torch.equal(got_kv.k, want_kv.k) and torch.equal(got_kv.v, want_kv.v)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_the_c_packer_lays_out_the_torch_layouts_bytes(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """native.pack_kq's one pass in C (onecall_kq_pack) and its torch reshapes give the same bytes,
    padding rows included."""
    groups, _ = _groups(21, 512, qtype, seed=11)
    args = (groups.bits, groups.q, groups.sub_scale, groups.d, groups.sub_min, groups.dmin)
    in_c = native.pack_kq(*args)
    monkeypatch.setattr(native, "load", lambda: None)
    in_torch = native.pack_kq(*args)
    for field in ("qs", "scales", "supers"):
        assert torch.equal(getattr(in_c, field), getattr(in_torch, field)), field


@pytest.mark.skipif(
    not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= native.cpu_flags(),
    reason="this CPU lacks AVX-512 F/BW/VL + VNNI",
)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_the_avx512_tile_gives_the_avx2_tiles_bits(qtype: T) -> None:
    """csrc/gemm_kq_avx512.c against gemm_kq.c's AVX2 tile (onecall_set_avx512 0 / 1): torch.equal for
    one row, the tails of its tiles of 8 and 4, and a second chunk of 64 rows; N with a partial unit."""
    assert LIB is not None
    groups, w = _groups(40, 512, qtype, seed=13)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(13))
    bias = torch.randn(40)
    before = LIB.onecall_set_avx512(-1)
    try:
        for m in (1, 3, 5, 13, 70):
            LIB.onecall_set_avx512(1)
            wide = _kq(x[:m], groups, bias)
            LIB.onecall_set_avx512(0)
            narrow = _kq(x[:m], groups, bias)
            assert torch.equal(wide, narrow), m
            ref = x[:m].double() @ w.double().T + bias.double()
            assert bool(((wide.double() - ref).abs() <= _bound(x[:m], w, groups)).all())
    finally:
        LIB.onecall_set_avx512(before)


@pytest.mark.usefixtures("cache_dir")
@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_the_pack_cache_maps_k_quant_packs_back(
    qtype: T, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """loading/pack_cache.py writes the kq packs (codes, int8 sub-scales, float16 supers) and a second
    load maps them back, checked against the kq layout's shapes, without packing anything: the same
    logits bit for bit (the same kernels on the same bytes)."""
    from tests.loading.test_pack_cache import _load as cached_load
    from tests.loading.test_pack_cache import _logits, _no_packing

    monkeypatch.setattr(make_models, "quantize", kquant_blocks.quantize)
    config = tiny_hf_config(
        "qwen2", hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64
    )
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=2), config, weight_type=qtype)
    first, status = cached_load(path)
    assert status == "written", status
    want = _logits(first)
    with monkeypatch.context() as m:
        _no_packing(m)
        m.setattr(native, "pack_kq", stored_models.never)
        second, status = cached_load(path)
    assert status == "hit" and second.kernels == first.kernels and KIND[qtype] in second.kernels
    assert torch.equal(_logits(second), want)


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q3_K], ids=lambda t: t.name)
def test_q6_k_and_q3_k_give_the_values_their_int8_groups_gave(qtype: T) -> None:
    """The kq GEMM runs the float32 operations the q8b kernel ran on the same weights as int8 groups of 16
    (the same exact integer dot a half-group, the same scale x step, the same two FMAs in order), so
    moving Q6_K / Q3_K onto their own codes changes no output value (a -0.0 may become +0.0)."""
    from onecall.formats.quants import int8_groups

    assert LIB is not None
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = torch.from_numpy(random_blocks(qtype, 40 * 768 // block_size, seed=17).reshape(-1).copy())
    as_int8 = int8_groups(raw, qtype, (40, 768))  # type: ignore[arg-type]
    codes = kquant_groups(raw, qtype, (40, 768))  # type: ignore[arg-type]
    assert as_int8 is not None and codes is not None
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(17))
    bias = torch.randn(40)
    before = native.q8_blocked_gemm(LIB, x, native.pack_q8_blocked(as_int8.q, as_int8.scale, 16), bias, 2)
    assert torch.equal(_kq(x, codes, bias), before)


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_columns_move_with_their_super_blocks_or_not_at_all(qtype: T) -> None:
    """gguf._select_columns (a hybrid's ssm_out, its value heads reordered) on K-quant codes: whole
    super-blocks of 256 columns move with their d (and dmin, mins), exactly; any other cut is None (the
    weight is then expanded and its columns picked from the float copy)."""
    from onecall.formats.gguf import _select_columns

    groups, w = _groups(8, 1024, qtype, seed=19)
    columns = torch.cat((torch.arange(512, 768), torch.arange(0, 256)))
    picked = _select_columns(groups, columns)
    assert isinstance(picked, KQuantGroups) and torch.equal(picked.dequantize(), w[:, columns])
    assert _select_columns(groups, torch.arange(128, 384)) is None
