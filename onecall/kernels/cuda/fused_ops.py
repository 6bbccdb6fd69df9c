"""The small per-layer ops of the CUDA path fused into three Triton kernels.

On a GPU a batch-1 decode step should cost one read of the weights, but around a layer's four
matmuls about thirty small elementwise kernels ran (residual add and RMSNorm in float32 then cast
and scaled, Qwen3's q/k norms, RoPE as slices, products and a concat, the two K/V cache writes, SiLU
then the product), each a launch of its own: a large share of the step (the H200 profile is in
docs/benchmarks.md, "Measurements behind the code"). Here each group is one kernel:

    add_rms_norm   h += residual (in place), y = norm(h) * weight          2 launches -> 1 (x2 a layer)
    rope_store     Qwen3's q/k RMSNorm, RoPE on q and k in place, K and V  ~18 launches -> 1
                   written to the paged cache at the step's slots
    silu_mul       silu(gate) * up of the fused gate/up projection         2 launches -> 1

Numerics follow the torch path of model/layers.py, in the same order of roundings where it rounds:
RMSNorm normalises in float32, then for bfloat16/float16 rounds to the model dtype before the weight
product (transformers' order); float32 is F.rms_norm. RoPE is computed in float32 from the stored
values and rounded once (the torch path rounds each product in the model dtype: results differ by an
ulp or so in bfloat16, exactly nothing in float32 beyond summation order). tests/kernels/test_triton_ops.py
holds each kernel against the torch ops under TRITON_INTERPRET=1 on CPU.

TritonLayerOps and TritonAttention are these kernels and triton_attention.py's behind the interface of
kernels/ops.py; kernels/select.py picks them on CUDA with the fast kernels, and imports this module
(and so Triton) only then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onecall.kernels.cuda.triton_attention import triton_paged_attention
from onecall.kernels.ops import AttentionKernels, LayerOps, PagedBatch, QKNorm


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,  # (rows, n): the residual stream; h + residual is written back when HAS_RESIDUAL
    r_ptr,  # (rows, n) or a dummy
    w_ptr,  # (n,)
    y_ptr,  # (rows, n)
    stride_h,
    stride_r,
    stride_y,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    LOW_PRECISION: tl.constexpr,  # bfloat16/float16: round the normalised value before the weight product
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * stride passes 2**31 on long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # torch's add: float32, rounded once
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * rstd
    if LOW_PRECISION:
        normed = normed.to(h.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * w).to(h.dtype), mask=mask)


@triton.jit
def _rope_store_kernel(
    qkv_ptr,  # (tokens, (heads + 2 * kv_heads) * head_dim): q and k rotated in place
    cos_ptr,  # (tokens, head_dim // 2)
    sin_ptr,
    q_norm_ptr,  # (head_dim,) or a dummy
    k_norm_ptr,
    slot_ptr,  # (tokens,) int64: where each token's K and V go
    k_cache_ptr,  # (slots, kv_heads, head_dim)
    v_cache_ptr,
    stride_tok,
    stride_cs,
    stride_slot,
    stride_kv_head,
    num_heads,
    num_kv_heads,
    eps,
    HAS_NORM: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,  # HALF rounded up to a power of two; the lanes past HALF are masked
):
    tok = tl.program_id(0).to(tl.int64)  # int64 offsets: tokens * stride may pass 2**31
    head = tl.program_id(1)  # 0 .. heads + 2 * kv_heads - 1: q heads, then k, then v
    offs = tl.arange(0, BLOCK_H)
    ok = offs < HALF  # all true for a power-of-two half (Phi-3's head_dim 96: 48 of 64)
    base = qkv_ptr + tok * stride_tok + head * 2 * HALF
    slot = tl.load(slot_ptr + tok)
    x1 = tl.load(base + offs, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=ok, other=0.0)
    dtype = x1.dtype
    if head < num_heads + num_kv_heads:  # q or k: (norm,) rotate, write back; k also to the cache
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
            if head < num_heads:
                w1 = tl.load(q_norm_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(q_norm_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(k_norm_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
            a = a * rstd
            b = b * rstd
            if LOW_PRECISION:
                a = a.to(dtype).to(tl.float32)
                b = b.to(dtype).to(tl.float32)
            a = (a * w1).to(dtype).to(tl.float32)  # the norm's output is a model-dtype tensor
            b = (b * w2).to(dtype).to(tl.float32)
        c = tl.load(cos_ptr + tok * stride_cs + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * stride_cs + offs, mask=ok, other=0.0).to(tl.float32)
        y1 = (a * c - b * s).to(dtype)
        y2 = (b * c + a * s).to(dtype)
        tl.store(base + offs, y1, mask=ok)
        tl.store(base + HALF + offs, y2, mask=ok)
        if head >= num_heads:
            dst = k_cache_ptr + slot * stride_slot + (head - num_heads) * stride_kv_head
            tl.store(dst + offs, y1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + offs, y2.to(k_cache_ptr.dtype.element_ty), mask=ok)
    else:
        dst = v_cache_ptr + slot * stride_slot + (head - num_heads - num_kv_heads) * stride_kv_head
        tl.store(dst + offs, x1.to(v_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + offs, x2.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(y_ptr, out_ptr, stride_y, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * (2 * inter) passes 2**31 (64k rows at 25,600)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    up = tl.load(y_ptr + row * stride_y + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: float32 inside, rounded to the dtype
    tl.store(
        out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


def add_rms_norm(
    h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += residual in place (when given); returns RMSNorm(h) * weight. h, residual: (rows, n)."""
    rows, n = h.shape
    assert h.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    y = torch.empty_like(h)
    r = h if residual is None else residual
    _add_rms_norm_kernel[(rows,)](
        h, r, weight, y, h.stride(0), r.stride(0), y.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, LOW_PRECISION=h.dtype != torch.float32,
        BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return y


def rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> None:
    """In place on qkv (tokens, (heads + 2 * kv_heads) * head_dim): q/k norms (Qwen3) and RoPE on q and
    k; k and v written to the caches (slots, kv_heads, head_dim) at slot_mapping. cos, sin:
    (tokens, head_dim // 2)."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    half = head_dim // 2
    assert head_dim % 2 == 0, "RoPE rotates pairs: head_dim must be even"
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_store_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, q_norm, k_norm, slot_mapping, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
        num_heads, num_kv_heads, eps,
        HAS_NORM=qk_norm is not None, LOW_PRECISION=qkv.dtype != torch.float32, HALF=half,
        BLOCK_H=triton.next_power_of_2(half),
    )  # fmt: skip


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """(rows, 2 * inter) [gate | up] -> (rows, inter) silu(gate) * up."""
    rows, width = y.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=y.dtype, device=y.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        y, out, y.stride(0), out.stride(0), inter, BLOCK=block
    )
    return out


class TritonLayerOps(LayerOps):
    """A CUDA model's fused ops. RMSNorm's rounding order in low precision is the plain (Llama) one:
    Gemma's norms, which scale before the cast, do not ask for it (model/gemma.py)."""

    name = "triton"

    def add_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        return add_rms_norm(h, residual, weight, eps)

    def silu_mul(self, y: torch.Tensor) -> torch.Tensor | None:
        return silu_mul(y)

    def rope_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qk_norm: QKNorm | None,
    ) -> bool:
        if 2 * cos.shape[-1] != k_cache.shape[-1]:
            return False
        rope_store(qkv, num_heads, num_kv_heads, cos, sin, slot_mapping, k_cache, v_cache, qk_norm)
        return True


class TritonAttention(AttentionKernels):
    """The "triton" backend: the whole step in one paged-attention launch per layer (attention sinks
    included: triton_attention.py's sinks kernel)."""

    name = "triton"

    def whole_batch(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedBatch,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        return triton_paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, logit_softcap, sinks)
