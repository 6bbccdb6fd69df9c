"""The native CPU kernels (kernels/cpu/native.py, csrc/*.c) against float64 references.

Tolerances, written down:
* q4 GEMM (int16 activations): each activation is rounded to a multiple of its group's step
  dx = absmax / 32767, so |x - x_q| <= dx / 2; with exact integer products the error of output n is at
  most sum_g (dx_g / 2) * sum_{j in g} |w_nj| (the activation rounding) + 1e-5 * (|x| @ |W|^T) + 1e-6
  (float32 scaling and summation).
* q4 GEMM with int8 activations (int8_activations): the same bound with dx = absmax / 127; against
  the int8 rounding emulated as the kernel rounds (step absmax / 127 and x * (1 / step) in float32,
  ties to even: the same quantized activations; a float64 x / step rounds ~1% of inputs one step
  apart), exact integer dots in float64, 1e-6 relative to the largest output (float32 scaling and
  summation only).
* q8b GEMM (int8 weights, Q8_0/Q6_K projections and logits; int16 activations): the q4 bound (the
  activation rounding, then 1e-5 relative for float32 scaling and summation; a group's int32 dot may
  round once on its way to float32, relative 6e-8).
* paged decode attention: against SDPA over the gathered KV in float32: 2e-6 absolute (values are
  O(1)); its exp polynomial has relative error < 2e-7.
* residual add + RMSNorm: 1e-6 relative to torch's rms_norm.
* batch invariance: a row's output is bitwise the same whatever the number of rows in the call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from onecall.formats.quants import Int4Groups
from onecall.kernels.cpu import native, native_build
from onecall.kernels.cpu.fast_linear import FastLMHead

LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


def _int4(rows: int, cols: int, seed: int) -> Int4Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02
    offset = -torch.rand(rows, cols // 32, generator=g) * 0.15
    return Int4Groups(q, scale, offset)


def _q4(x: torch.Tensor, w: Int4Groups, bias: torch.Tensor | None = None) -> torch.Tensor:
    assert LIB is not None
    return native.q4_gemm(LIB, x, native.pack_q4(w.q, w.scale, w.offset), bias, torch.get_num_threads())


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 33])
def test_q4_gemm_within_the_activation_rounding_bound(rows: int) -> None:
    w = _int4(93, 160, seed=rows)  # 93 rows: a partial block of 8
    bias = torch.randn(93)
    x = torch.randn(rows, 160) * 2
    x[:, 5] = 40.0  # an outlier feature: its group's step is coarse, the bound follows it
    got = _q4(x, w, bias)
    wd = w.dequantize().double()
    ref = x.double() @ wd.T + bias.double()
    step = x.view(rows, -1, 32).abs().amax(-1).double() / 32767  # (rows, G)
    abs_w_per_group = wd.abs().view(93, -1, 32).sum(-1)  # (N, G)
    bound = (step / 2) @ abs_w_per_group.T + 1e-5 * (x.double().abs() @ wd.abs().T) + 1e-6
    assert bool(((got.double() - ref).abs() <= bound).all())
    # and it is not trivially loose: the typical error is well inside it
    assert float((got.double() - ref).abs().mean()) < 0.5 * float(bound.mean())


def test_q4_gemm_rows_are_batch_invariant() -> None:
    w = _int4(61, 96, seed=3)
    x = torch.randn(16, 96)
    full = _q4(x, w)
    for m in (1, 2, 5, 9, 15):
        assert torch.equal(_q4(x[:m].contiguous(), w), full[:m])
        assert torch.equal(_q4(x[m:].contiguous(), w), full[m:])


@pytest.mark.parametrize("group_size", [32, 16])
def test_q8_blocked_gemm_within_the_activation_rounding_bound_and_batch_invariant(group_size: int) -> None:
    assert LIB is not None
    g = torch.Generator().manual_seed(group_size)
    n, k = 85, 128  # 6 units of 16 rows, the last partial (5 rows)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group_size, generator=g) * 0.01
    w = native.pack_q8_blocked(q, scale, group_size)
    wd = (q.double().view(n, -1, group_size) * scale.double()[..., None]).view(n, k)
    bias = torch.randn(n)
    x = torch.randn(70, k) * 2
    x[:, 3] = 50.0  # an outlier feature: its group's step is coarse
    got = native.q8_blocked_gemm(LIB, x, w, bias, 2)
    ref = x.double() @ wd.T + bias.double()
    step = x.view(70, -1, 32).abs().amax(-1).double() / 32767
    bound = (step / 2) @ wd.abs().view(n, -1, 32).sum(-1).T + 1e-5 * (x.double().abs() @ wd.abs().T) + 1e-6
    assert bool(((got.double() - ref).abs() <= bound).all())
    assert float((got.double() - ref).abs().mean()) < 0.5 * float(bound.mean())
    for m in (1, 2, 3, 5, 16, 65):
        assert torch.equal(native.q8_blocked_gemm(LIB, x[:m].contiguous(), w, bias, 2), got[:m])
        assert torch.equal(native.q8_blocked_gemm(LIB, x[m:].contiguous(), w, bias, 1), got[m:])


def test_lm_head_keeps_a_q8_0_weight_as_int8_and_a_float_weight_as_float() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (256, 64), generator=g, dtype=torch.int8)
    q[:, ::32] = 127  # Q8_0's recipe: each group's absmax maps to +-127
    d = (torch.rand(256, 2, generator=g) * 0.01).half().float()  # GGUF stores d as float16
    stored = (q.view(256, 2, 32).float() * d.unsqueeze(-1)).view(256, 64)
    head = FastLMHead(stored)
    assert head.kernel == "native q8"
    x = torch.randn(3, 64, generator=g)
    ref = x.double() @ stored.double().T
    assert float((head(x).double() - ref).abs().max()) <= 1e-5 * float((x.abs() @ stored.abs().T).max())
    assert FastLMHead(torch.randn(256, 64, generator=g)).kernel == "onednn float32"


def _sdpa_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], seq_len: int, bs: int
) -> torch.Tensor:
    slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).reshape(-1)[:seq_len]
    k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)  # (kv_heads, L, D)
    num_heads, head_dim = q.shape
    qg = q.view(k.shape[0], num_heads // k.shape[0], head_dim)  # head h reads KV head h // group
    return F.scaled_dot_product_attention(qg, k, v, scale=head_dim**-0.5).reshape(num_heads, head_dim)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 32), (4, 4, 16)])
def test_paged_decode_attention_reads_scrambled_blocks(
    num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> None:
    """A float16 cache is compared with SDPA over the same values converted to float32: the kernel's
    own error is the same; the cache's rounding is the caller's choice (kv_cache_dtype)."""
    assert LIB is not None
    bs, num_blocks = 16, 80
    g = torch.Generator().manual_seed(num_heads)
    k_cache = torch.randn(num_blocks * bs, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks * bs, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    lens = [1, 17, 127, 128, 129, 600]  # around the kernel's 128-position chunks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[start : start + nb] if start + nb <= num_blocks else perm[:nb])
        start = (start + nb) % num_blocks
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    out = native.paged_decode_attention(
        LIB, q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), bs, head_dim**-0.5, 2
    )
    for i, n in enumerate(lens):
        ref = _sdpa_reference(q[i], k_cache, v_cache, tables[i], n, bs)
        assert float((out[i] - ref).abs().max()) <= 2e-6, (n, float((out[i] - ref).abs().max()))
    # batch invariance: each sequence alone gives the same bits as in the batch
    for i, n in enumerate(lens):
        alone = native.paged_decode_attention(
            LIB, q[i : i + 1], k_cache, v_cache, bt[i : i + 1].contiguous(),
            torch.tensor([n], dtype=torch.int32), bs, head_dim**-0.5, 1,
        )  # fmt: skip
        assert torch.equal(alone[0], out[i])


def test_add_rms_norm_matches_torch() -> None:
    assert LIB is not None
    h = torch.randn(5, 576)
    r = torch.randn(5, 576)
    w = torch.randn(576)
    want_h = h + r
    want = F.rms_norm(want_h, (576,), w, 1e-5)
    got = native.add_rms_norm(LIB, h, r, w, 1e-5)  # h updated in place
    assert torch.equal(h, want_h)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONECALL_NATIVE_KERNELS", "0")
    with pytest.raises(native_build._Unavailable, match="ONECALL_NATIVE_KERNELS=0"):
        native_build._build_and_load()


@pytest.mark.slow
def test_a_second_copy_of_the_sources_loads_beside_the_first(tmp_path: Path) -> None:
    """load_from (bench_kernels.py --against): the same sources built apart give the same bits; sources
    without a kernels.h, whose header lacks a GEMM or declares one that takes other arguments, or that
    do not compile, are a RuntimeError saying so."""
    assert LIB is not None
    csrc = Path(native_build.__file__).parent / "csrc"
    other = native_build.load_from(csrc, tmp_path)
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    scale = torch.rand(48, 2) * 0.01
    w = native.pack_q4(q, scale, -8 * scale)
    x = torch.randn(5, 64)
    assert torch.equal(native.q4_gemm(other, x, w, None, 2), native.q4_gemm(LIB, x, w, None, 2))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "k.c").write_text("int f(void) { return 1; }")
    with pytest.raises(RuntimeError, match="has no kernels.h"):
        native_build.load_from(broken, broken)
    header = (csrc / "kernels.h").read_text()
    gemm = "int onecall_q8b_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *scale, int64_t N,"
    assert gemm in header
    (broken / "kernels.h").write_text(header.replace(gemm, gemm.replace("int64_t N,", "int N,")))
    with pytest.raises(RuntimeError, match="onecall_q8b_gemm.*int N.*not comparable"):
        native_build.load_from(broken, broken)
    (broken / "kernels.h").write_text(header.replace("onecall_q8b_gemm", "onecall_q8b_gemm_v2"))
    with pytest.raises(RuntimeError, match="lacks a GEMM this version calls: onecall_q8b_gemm"):
        native_build.load_from(broken, broken)
    (broken / "kernels.h").write_text(header)
    (broken / "k.c").write_text("int f( {")
    with pytest.raises(RuntimeError, match="building the kernels failed"):
        native_build.load_from(broken, broken)
    (broken / "k.c").write_text("int f(void) { return 1; }")
    with pytest.raises(RuntimeError, match="declares onecall_q4_gemm, but .* does not export it"):
        native_build.load_from(broken, broken)


@pytest.mark.parametrize(("rows", "cols"), [(16, 49152), (3, 13), (1, 7), (2, 1), (5, 64)])
def test_argmax_is_torchs_index_for_index(rows: int, cols: int) -> None:
    """native.argmax (the sampler's greedy pick) against torch.argmax: the first maximum on ties, the
    first NaN where a row holds one (torch ranks NaN above every number), infinities, all-equal rows,
    lengths not a multiple of the 8-wide vectors."""
    assert LIB is not None
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g)
    cases = [x, x.round()]  # rounding makes ties
    tie = x.clone()
    tie[:, -1] = tie.max(dim=-1).values  # the same maximum at the end as well
    cases.append(tie)
    nan = x.clone()
    nan[0, cols // 2] = float("nan")
    nan[0, cols - 1] = float("nan")
    cases.append(nan)
    cases.append(torch.full((rows, cols), float("-inf")))
    cases.append(torch.full((rows, cols), 2.5))
    inf = x.clone()
    inf[-1, cols // 3] = float("inf")
    cases.append(inf)
    zeros = torch.zeros(rows, cols)
    zeros[:, cols // 2] = -0.0  # -0.0 == +0.0: the first zero wins
    cases.append(zeros)
    for case in cases:
        assert torch.equal(native.argmax(case), case.argmax(dim=-1)), case
    assert torch.equal(native.argmax(x.t().contiguous().t()), x.argmax(dim=-1))  # a strided view
    assert torch.equal(native.argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))  # torch's own path


def test_silu_mul_matches_torch() -> None:
    assert LIB is not None
    y = torch.randn(3, 2 * 200) * 4
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(LIB, y), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_store_matches_the_reference_layers(kv_dtype: torch.dtype, qk_norm: bool) -> None:
    """RoPE (and Qwen3's per-head q/k RMSNorm before it) against the torch layers: float32 summation
    order differs in the norm only, hence 1e-6 (values are O(1))."""
    from onecall.model.layers import RMSNorm, RotaryEmbedding, apply_rope

    assert LIB is not None
    num_heads, num_kv_heads, head_dim, n = 6, 2, 32, 5
    rotary = RotaryEmbedding(head_dim, 64, 1e4, torch.float32, "cpu")
    positions = torch.tensor([0, 3, 7, 20, 63])
    cos, sin = rotary(positions)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim)
    heads = qkv.view(n, -1, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]
    norms = None
    if qk_norm:
        q_norm = RMSNorm(head_dim, 1e-6, torch.float32, "cpu")
        k_norm = RMSNorm(head_dim, 1e-6, torch.float32, "cpu")
        with torch.no_grad():
            q_norm.weight.normal_(1.0, 0.5), k_norm.weight.normal_(1.0, 0.5)
            qk = torch.cat((q_norm(qk[:, :num_heads]), k_norm(qk[:, num_heads:])), dim=1)
        norms = (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    want_qk = apply_rope(qk, cos, sin)
    want_v = heads[:, num_heads + num_kv_heads :].clone()
    k_cache, v_cache = torch.zeros(40, num_kv_heads, head_dim), torch.zeros(40, num_kv_heads, head_dim)
    slots = torch.tensor([9, 0, 31, 4, 17])
    native.rope_store(
        LIB, qkv, num_heads, num_kv_heads, cos.squeeze(1), sin.squeeze(1), slots, k_cache, v_cache, norms
    )
    torch.testing.assert_close(heads[:, : num_heads + num_kv_heads], want_qk, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache[slots], want_qk[:, num_heads:], rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[slots], want_v)


def test_q4_gemm_float16_scales_give_the_float32_scales_bits() -> None:
    """Q4_0/Q4_1 store scales in float16; kept so (fewer bytes), they give exactly the result of the
    same values held in float32."""
    assert LIB is not None
    w = _int4(64, 128, seed=9)
    scale, offset = w.scale.half(), w.offset.half()
    x = torch.randn(5, 128)
    half = native.q4_gemm(LIB, x, native.pack_q4(w.q, scale, offset), None, 2)
    full = native.q4_gemm(LIB, x, native.pack_q4(w.q, scale.float(), offset.float()), None, 2)
    assert torch.equal(half, full)


def _q4a8(x: torch.Tensor, w: Int4Groups, bias: torch.Tensor | None = None) -> torch.Tensor:
    assert LIB is not None
    packed = native.pack_q4(w.q, w.scale, w.offset, act8=True)
    return native.q4_gemm(LIB, x, packed, bias, torch.get_num_threads())


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 70])  # 70: past a chunk of 64 rows
def test_q4_int8_activations_equal_their_emulation_and_stay_within_the_rounding_bound(rows: int) -> None:
    w = _int4(85, 192, seed=rows)  # 85 rows: 6 units of 16, the last partial (5 rows)
    bias = torch.randn(85)
    x = torch.randn(rows, 192) * 2
    x[:, 7] = 30.0  # an outlier feature: its group's step is coarse
    got = _q4a8(x, w, bias).double()
    # emulated: each group of 32 rounded to int8 steps of absmax / 127 as the kernel rounds it (float32
    # step and reciprocal, to nearest, ties to even) multiplies q * scale; the offset multiplies the
    # group's sum of the unrounded activations
    step32 = x.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x.view(rows, -1, 32) * (1.0 / step32)).double() * step32.double()
    groups = x.view(rows, -1, 32).double()
    step = groups.abs().amax(-1, keepdim=True) / 127
    wd = w.dequantize().double()
    scaled = (w.q.double().view(85, -1, 32) * w.scale.double()[..., None]).view(85, -1)
    emulated = xq.view(rows, -1) @ scaled.T + groups.sum(-1) @ w.offset.double().T + bias.double()
    assert float((got - emulated).abs().max()) <= 1e-6 * float(emulated.abs().max())
    ref = x.double() @ wd.T + bias.double()
    bound = (step.squeeze(-1) / 2) @ wd.abs().view(85, -1, 32).sum(-1).T + 1e-5 * (
        x.double().abs() @ wd.abs().T
    )
    assert bool(((got - ref).abs() <= bound + 1e-6).all())
    # int8 steps are coarser than int16's: the error is real, and larger than the int16 kernel's
    assert float((got - ref).abs().mean()) > 10 * float((_q4(x, w, bias).double() - ref).abs().mean())


def test_q4_int8_activation_rows_are_batch_invariant() -> None:
    w = _int4(61, 96, seed=4)
    x = torch.randn(70, 96)
    full = _q4a8(x, w)
    for m in (1, 2, 3, 5, 16, 65):
        assert torch.equal(_q4a8(x[:m].contiguous(), w), full[:m])
        assert torch.equal(_q4a8(x[m:].contiguous(), w), full[m:])


def test_q4_int8_activations_float16_scales_give_the_float32_scales_bits() -> None:
    w = _int4(40, 64, seed=10)
    x = torch.randn(3, 64)
    packed = [
        native.pack_q4(w.q, s, o, act8=True)
        for s, o in ((w.scale.half(), w.offset.half()), (w.scale.half().float(), w.offset.half().float()))
    ]
    half, full = (native.q4_gemm(LIB, x, p, None, 2) for p in packed)  # type: ignore[arg-type]
    assert torch.equal(half, full)


def test_a_nan_poisons_its_row_and_a_tiny_group_adds_nothing_wrong() -> None:
    """As in float32 math: a NaN anywhere in an activation row makes every output of that row NaN (in
    each kernel, whichever column holds it), other rows untouched; a group of values so small that the
    reciprocal of its step would overflow quantizes to zeros instead of flipping signs."""
    assert LIB is not None
    w4 = _int4(20, 64, seed=11)
    g = torch.Generator().manual_seed(12)
    q8 = torch.randint(-127, 128, (20, 64), generator=g, dtype=torch.int8)
    kernels = {
        "q4": lambda x: native.q4_gemm(LIB, x, native.pack_q4(w4.q, w4.scale, w4.offset), None, 2),
        "q4a8": lambda x: native.q4_gemm(
            LIB, x, native.pack_q4(w4.q, w4.scale, w4.offset, act8=True), None, 2
        ),
        "q8b": lambda x: native.q8_blocked_gemm(
            LIB, x, native.pack_q8_blocked(q8, torch.full((20, 2), 0.01)), None, 2
        ),
    }
    for name, run in kernels.items():
        for col in (0, 5, 31, 40):
            x = torch.randn(3, 64, generator=g)
            x[1, col] = float("nan")
            y = run(x)
            assert bool(y[1].isnan().all()), (name, col)
            assert not bool(y[0].isnan().any() or y[2].isnan().any()), (name, col)
        x = torch.randn(2, 64, generator=g)
        x[0, :32] = 1e-36  # its step's reciprocal overflows float32
        y = run(x)
        assert not bool(y.isnan().any()), name
        ref = run(torch.cat((torch.zeros(1, 32), x[0:1, 32:]), dim=1).contiguous())
        # the tiny group contributes at most its exact (~1e-34) share, never a flipped sign
        assert float((y[0] - ref[0]).abs().max()) <= 1e-30, name
