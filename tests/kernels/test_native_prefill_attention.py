"""The native causal prefill attention (csrc/prefill_attention.c) against float64 references.

Tolerance, written down: queries, keys and values ~N(0, 1), scale 1 / sqrt(head_dim), so outputs are
O(1) (a weighted mean of values); the kernel's error against float64 attention over the same K/V
values (a float16 cache: its float16 values) is at most 5e-6 absolute. Its sources: float32 dot
products and sums over up to ~1,000 keys (~1e-6 observed), the exp polynomial (relative < 2e-7),
and the scale folded into the queries before the dot product. torch's float32 SDPA is held to the same
bound in the same test, so the bound is not looser than what float32 attention does anyway.

Invariance, exact (torch.equal): a row's bits depend only on its query, its position and the KV, so
they are the same when the prompt is chunked anywhere (a chunk after a cached prefix), whatever
other rows share the call, with the KV in blocks or in one run, and with 1 or 2 threads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecall.kernels.cpu import native
from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.kv_cache import PagedKVCache

LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
TOL = 5e-6


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """float64 eager attention: q (query_len, H, D) at the last query_len of k, v's (seq_len, KVH, D)."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qd = q.double().transpose(0, 1)  # (H, query_len, D)
    kd = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vd = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def _native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: int,
    kv_start: int = 0,
    blocks: torch.Tensor | None = None,
    block_size: int = 16,
    threads: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    assert LIB is not None
    scale = q.shape[-1] ** -0.5
    n = torch.get_num_threads() if threads is None else threads
    return native.prefill_attention(
        LIB, q, k_cache, v_cache, seq_len, kv_start, blocks, block_size, scale, n, window, softcap
    )


def _paged(
    seq_len: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A cache of shuffled blocks holding one sequence's K/V: (k_cache, v_cache, blocks, k, v)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size)
    blocks = torch.randperm(num_blocks + 3, generator=g)[:num_blocks] + 1  # not in order, never block 0
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:seq_len]
    k_cache = torch.randn((num_blocks + 4) * block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn((num_blocks + 4) * block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return k_cache, v_cache, blocks, k_cache[slots], v_cache[slots]


@pytest.mark.parametrize(
    "query_len,seq_len,heads,kv_heads,head_dim",
    [
        (1024, 1024, 9, 3, 64),  # SmolLM2's shape, a fresh prompt
        (77, 300, 9, 3, 64),  # a chunk after a cached prefix; tails of every tile size
        (5, 5, 4, 4, 32),  # fewer rows than a tile, no GQA
        (130, 130, 8, 1, 16),  # multi-query, smallest head_dim
        (33, 200, 2, 2, 128),
    ],
)
def test_matches_float64_attention_with_the_kv_in_blocks(
    query_len: int, seq_len: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    k_cache, v_cache, blocks, k, v = _paged(
        seq_len, kv_heads, head_dim, 16, seed=seq_len, dtype=torch.float32
    )
    q = torch.randn(query_len, heads, head_dim)
    ref = _reference(q, k, v, head_dim**-0.5)
    got = _native(q, k_cache, v_cache, seq_len, -1, blocks)
    assert float((got.double() - ref).abs().max()) <= TOL
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len),
        scale=head_dim**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    assert float((sdpa.double() - ref).abs().max()) <= TOL  # the bound float32 attention meets anyway
    # one run of slots from kv_start reads the same values in the same order: the same bits
    run = (
        torch.cat((torch.zeros(7, kv_heads, head_dim), k)),
        torch.cat((torch.zeros(7, kv_heads, head_dim), v)),
    )
    assert torch.equal(_native(q, run[0], run[1], seq_len, kv_start=7), got)


def test_float16_cache_matches_attention_over_its_values() -> None:
    k_cache, v_cache, blocks, k, v = _paged(400, 3, 64, 16, seed=1, dtype=torch.float16)
    q = torch.randn(150, 9, 64)
    got = _native(q, k_cache, v_cache, 400, -1, blocks)
    assert float((got.double() - _reference(q, k, v, 0.125)).abs().max()) <= TOL


@pytest.mark.parametrize("window,softcap", [(1, None), (50, None), (64, None), (None, 2.0), (100, 1.5)])
def test_sliding_window_and_softcap(window: int | None, softcap: float | None) -> None:
    k_cache, v_cache, blocks, k, v = _paged(333, 2, 32, 16, seed=2, dtype=torch.float32)
    q = torch.randn(200, 6, 32) * 3  # larger scores, so the cap bends them
    got = _native(q, k_cache, v_cache, 333, -1, blocks, window=window, softcap=softcap)
    ref = _reference(q, k, v, 32**-0.5, window, softcap)
    assert float((got.double() - ref).abs().max()) <= TOL
    # the options change the result (so the comparison above checks them)
    assert float((got.double() - _reference(q, k, v, 32**-0.5)).abs().max()) > 1e-3


def test_rows_are_exact_whatever_the_chunking_the_rows_around_them_and_the_threads() -> None:
    seq_len = 700
    k_cache, v_cache, blocks, _, _ = _paged(seq_len, 3, 64, 16, seed=3, dtype=torch.float32)
    qkv = torch.randn(seq_len, 15 * 64)  # a fused projection output: q rows are strided
    q = qkv[:, : 9 * 64].view(seq_len, 9, 64)
    full = _native(q, k_cache, v_cache, seq_len, -1, blocks, threads=2)
    assert torch.equal(_native(q, k_cache, v_cache, seq_len, -1, blocks, threads=1), full)
    for start, end in [(0, 1), (0, 100), (100, 161), (161, 512), (650, 700), (699, 700)]:
        # rows start..end-1 as a chunk whose KV ends at position end - 1 (the later keys not yet written)
        chunk = _native(q[start:end], k_cache, v_cache, end, -1, blocks)
        assert torch.equal(chunk, full[start:end]), (start, end)
    windowed = _native(q, k_cache, v_cache, seq_len, -1, blocks, window=90, softcap=3.0)
    assert torch.equal(
        _native(q[300:421], k_cache, v_cache, 421, -1, blocks, window=90, softcap=3.0), windowed[300:421]
    )


def test_paged_attention_runs_prefill_chunks_natively_and_each_sequence_alone() -> None:
    """A mixed step (a decode row, a chunk after a prefix, a fresh prompt) through paged_attention: the
    prefill rows equal the native kernel on each sequence alone (bits), and the reference backend."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    cache = PagedKVCache(1, 64, bs, kv_heads, head_dim, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    tables = [[5], [9, 10, 11, 12, 20, 21], [30, 31, 32, 33, 34]]  # seq 1: two runs of blocks
    seq_lens, query_lens = [7, 90, 70], [1, 40, 70]
    q = torch.randn(sum(query_lens), heads, head_dim)
    outs = {}
    for backend in ("paged", "reference"):
        meta = build_attention_metadata(tables, seq_lens, query_lens, bs, "cpu", backend=backend)
        outs[backend] = paged_attention(q, None, None, cache, 0, meta, head_dim**-0.5)
    assert float((outs["paged"] - outs["reference"]).abs().max()) <= TOL
    alone = build_attention_metadata(tables[1:2], seq_lens[1:2], query_lens[1:2], bs, "cpu")
    assert alone.kernels.reads_prefill_chunks and alone.seqs[0].blocks is not None
    assert torch.equal(
        paged_attention(q[1:41], None, None, cache, 0, alone, head_dim**-0.5), outs["paged"][1:41]
    )
    k_run = cache.k[0][30 * bs : 30 * bs + 70]
    v_run = cache.v[0][30 * bs : 30 * bs + 70]
    assert torch.equal(outs["paged"][41:], _native(q[41:], k_run, v_run, 70))


def test_fits_turns_away_what_the_kernel_does_not_take() -> None:
    k_cache = torch.zeros(16, 2, 64)
    assert native.prefill_attention_fits(torch.zeros(3, 4, 64), k_cache)
    assert not native.prefill_attention_fits(torch.zeros(3, 4, 64, dtype=torch.bfloat16), k_cache)
    assert not native.prefill_attention_fits(torch.zeros(3, 3, 64), k_cache)  # 3 heads over 2 KV heads
    assert not native.prefill_attention_fits(torch.zeros(3, 4, 24), torch.zeros(16, 2, 24))  # head_dim % 16
