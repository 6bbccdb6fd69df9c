"""Paged varlen attention in Triton: one kernel launch per layer for a whole mixed batch (CUDA).

The batch is flat (see model/attention_metadata.py): sequence s owns query rows query_starts[s] ..
query_starts[s + 1] - 1, whose positions are the last query_len of its seq_len positions. One
program handles (sequence, query head, block of BLOCK_M query rows) and streams that sequence's
keys and values in tiles of BLOCK_N positions straight from the paged cache: position p lives in
slot block_tables[s, p // block_size] * block_size + p % block_size, so nothing is gathered or
copied per layer. Softmax is the online (flash) form in float32; causality is by position (a query
at position t sees keys 0..t), which covers a prefill chunk after a cached prefix and a decode row
(query_len 1) alike. Any head size: a tile's width is head_dim rounded up to a power of two, at least
16 (tl.dot's least), the extra columns masked (Phi-3's 96 runs in 128-wide tiles).

Attention sinks (gpt-oss): a second entry point, _paged_attention_sinks_kernel, is the same program
(both run _attend_rows) with one learned logit per query head joining each row's softmax once its
keys are done: with M = max(m, sink), acc and l are rescaled by exp(m - M) and l gains exp(sink - M),
so out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)). The plain kernel keeps its own signature
(and compiles as before: no sink argument, no sink code).

Numerics: float32 queries use IEEE float32 dot products (no TF32); bfloat16/float16 ones accumulate
in float32. A cache stored in another dtype than the queries (kv_cache_dtype) is converted to the
queries' dtype as it is loaded, as the reference backend converts it. tests/kernels/test_triton_attention.py
holds the kernel against the reference backend under TRITON_INTERPRET=1 on CPU (the interpreter runs
it with numpy; bfloat16 dot products excepted, which it gets wrong), and benchmarks/gpu_check.py
against transformers on a GPU, bfloat16 included.

Triton is imported only when this backend is used; nothing else in onecall needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from onecall.kernels.ops import PagedBatch


@triton.jit
def _attend_rows(
    q_ptr,  # (num_tokens, num_heads, head_dim)
    k_ptr,  # (num_slots, num_kv_heads, head_dim)
    v_ptr,
    o_ptr,  # (num_tokens, num_heads, head_dim)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32
    query_starts_ptr,  # (num_seqs + 1,) int32
    scale,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_o_tok,
    stride_o_head,
    max_blocks,
    window,  # sliding window (a query at t sees t - window + 1 .. t); 0: none
    softcap,  # scores -> softcap * tanh(score / softcap); used when HAS_SOFTCAP
    sinks_ptr,  # (num_heads,) attention sinks; read when HAS_SINKS
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16): the tiles' width
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 inputs: exact float32 products, no TF32
):
    """One program's rows: (sequence, query head, block of BLOCK_M rows) from the launch grid."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # positions already cached before this step's rows
    kv_head = head // GROUP

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) row within the sequence's queries
    row_ok = rows < query_len
    dims = tl.arange(0, BLOCK_D)
    # a static (constexpr) if: a power-of-two head compiles without the column mask
    if BLOCK_D == HEAD_DIM:  # noqa: SIM108
        q_mask = row_ok[:, None]
    else:  # padded columns load as 0: they add nothing to q.k, and are not stored
        q_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tok = (q_start + rows).to(tl.int64)  # int64 offsets: tokens * stride may pass 2**31
    q_off = tok[:, None] * stride_q_tok + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    q_pos = context_len + rows  # (BLOCK_M,) absolute positions

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # keys up to the last query position of this block (causal), never past seq_len; with a window,
    # from the first key its first row sees (tiles before it are all outside every row's window)
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_M)
    kv_begin = 0
    if window > 0:
        kv_begin = tl.maximum(context_len + q_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        pos_ok = pos < kv_end
        block = tl.load(block_tables_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :]
        if BLOCK_D == HEAD_DIM:  # noqa: SIM108
            kv_mask = pos_ok[:, None]
        else:
            kv_mask = pos_ok[:, None] & (dims < HEAD_DIM)[None, :]
        # (BLOCK_N, BLOCK_D), in q's dtype: a cache of another dtype (kv_cache_dtype) is read as the
        # reference backend reads it, converted (tl.dot takes two operands of one dtype)
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N) float32
        if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), from exp alone (portable across backends)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :] & row_ok[:, None]
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if HAS_SINKS:  # the sink joins the softmax: M = max(m, sink), everything rescaled by exp(m - M)
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_fin)  # 0 for rows that saw no key (m = -inf): only the sink is left
        l_i = l_i * alpha + tl.exp(sink - m_fin)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = tok[:, None] * stride_o_tok + head * stride_o_head + dims[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr, scale,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_o_tok, stride_o_head, max_blocks,
    window, softcap,
    HAS_SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_attend_rows without sinks (the arguments as _attend_rows documents them)."""
    _attend_rows(
        q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr, scale,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_o_tok, stride_o_head, max_blocks,
        window, softcap, q_ptr, HAS_SOFTCAP, False, GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_M, BLOCK_N,
        PRECISION,
    )  # fmt: skip


@triton.jit
def _paged_attention_sinks_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr, scale,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_o_tok, stride_o_head, max_blocks,
    window, softcap, sinks_ptr,
    HAS_SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_attend_rows with attention sinks: sinks_ptr (num_heads,) float32."""
    _attend_rows(
        q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr, scale,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_o_tok, stride_o_head, max_blocks,
        window, softcap, sinks_ptr, HAS_SOFTCAP, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_M, BLOCK_N,
        PRECISION,
    )  # fmt: skip


def tile_sizes(head_dim: int, element_size: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N): the head padded to a power of two (tl.dot needs 16 at least; Phi-3's
    96 -> 128); 16 query rows for decode rows and short chunks, else 64; 64 keys a tile while a key row
    is at most 256 bytes, else 32 (float32 at head_dim 128: 74 KB of shared memory, not 115 KB, which
    a 99 KB GPU such as sm_86/89 refuses; bfloat16 at 128 keeps 64)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 16 if max_query_len <= 16 else 64
    block_n = 64 if block_d * element_size <= 256 else 32
    return block_d, block_m, block_n


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (num_tokens, num_heads, head_dim) over the paged cache -> (num_tokens, num_heads, head_dim).
    sliding_window, logit_softcap, sinks ((num_heads,), any float dtype: read as float32): as
    model/attention.py's paged_attention defines them."""
    assert meta.block_tables is not None and meta.seq_lens_t is not None and meta.query_starts_t is not None
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.stride(2) == 1 and q.stride(2) == 1
    out = torch.empty_like(q)
    block_d, block_m, block_n = tile_sizes(head_dim, q.element_size(), meta.max_query_len)
    grid = (len(meta.seqs), num_heads, triton.cdiv(meta.max_query_len, block_m))
    kernel: Any = _paged_attention_kernel
    extra: tuple[torch.Tensor, ...] = ()
    if sinks is not None:
        assert sinks.shape == (num_heads,), "one sink per query head"
        kernel, extra = _paged_attention_sinks_kernel, (sinks.detach().to(q.device).contiguous(),)
    kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens_t, meta.query_starts_t, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.shape[1], sliding_window or 0, logit_softcap or 1.0, *extra,
        HAS_SOFTCAP=logit_softcap is not None, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=meta.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
