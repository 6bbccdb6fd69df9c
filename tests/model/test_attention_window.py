"""Sliding-window attention and logit soft-capping (model/attention.py's per-layer options) on every
backend, against a dense implementation written out here from transformers' definitions:

    a query at position t sees keys t - W + 1 .. t            (sliding_window W: Mistral, Gemma)
    score = c * tanh(q.k * scale / c), then mask, softmax     (logit_softcap c: Gemma 2)

Tolerance: float32 throughout, 2e-5 max abs difference on outputs of magnitude ~1 (the backends sum
in different orders: SDPA, matmul + softmax, the native kernel's chunked online softmax, Triton's
tiles). The batch mixes a fresh prefill longer than the window, a chunk after a cached prefix, decode
rows whose history is longer and shorter than the window, over scrambled physical blocks, with
grouped-query heads.
"""

from __future__ import annotations

import os

import pytest
import torch

from onecall.kernels.cpu import native
from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.kv_cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
# (seq_len, query_len): a fresh prefill, a chunk after a cached prefix, decode rows long and short
SHAPES = [(21, 21), (40, 7), (33, 1), (3, 1), (150, 1)]
OPTIONS = [(None, None), (5, None), (12, None), (None, 6.0), (7, 3.0), (1, None)]

_has_triton = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
try:
    import triton  # noqa: F401
except ImportError:
    _has_triton = False


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    """q (n, H, D) at positions q_pos over k, v (L, KVH, D) at positions 0..L-1 -> (n, H, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.empty_like(q)
    for h in range(NUM_HEADS):
        scores = q[:, h] @ k[:, h // group].T * HEAD_DIM**-0.5
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[:, h] = probs @ v[:, h // group]
    return out


def _case(seed: int) -> tuple[PagedKVCache, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s, _ in SHAPES) + 3
    kv = PagedKVCache(1, num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for seq_len, _ in SHAPES:
        n = -(-seq_len // BLOCK)
        tables.append(perm[used : used + n])
        used += n
    num_tokens = sum(q for _, q in SHAPES)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g)
    k_new = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v_new = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    return kv, tables, q, k_new, v_new


def _want(
    kv: PagedKVCache, tables: list[list[int]], q: torch.Tensor, window: int | None, cap: float | None
) -> torch.Tensor:
    """The dense answer, read from the cache after paged_attention stored the new K/V."""
    out, row = torch.empty_like(q), 0
    for table, (seq_len, query_len) in zip(tables, SHAPES, strict=True):
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:seq_len]
        k, v = kv.k[0][slots], kv.v[0][slots]
        q_pos = torch.arange(seq_len - query_len, seq_len)
        out[row : row + query_len] = _dense(q[row : row + query_len], k, v, q_pos, window, cap)
        row += query_len
    return out


BACKENDS = ["reference", "paged"] + (["triton"] if _has_triton else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_every_backend_matches_the_dense_definition(
    backend: str, window: int | None, cap: float | None
) -> None:
    kv, tables, q, k_new, v_new = _case(seed=len(BACKENDS))
    seq_lens, query_lens = [s for s, _ in SHAPES], [n for _, n in SHAPES]
    meta = build_attention_metadata(tables, seq_lens, query_lens, BLOCK, "cpu", backend=backend)
    if backend == "paged" and native.load() is not None:
        assert meta.decode is not None  # the decode rows run the native kernel's window and cap
    got = paged_attention(
        q, k_new, v_new, kv, 0, meta, HEAD_DIM**-0.5, sliding_window=window, logit_softcap=cap
    )
    want = _want(kv, tables, q, window, cap)
    diff = float((got - want).abs().max())
    assert diff <= 2e-5, diff


def test_the_options_change_the_answer() -> None:
    """A window shorter than the history and a cap below the scores' range both matter here (so the
    test above would catch a backend ignoring them)."""
    kv, tables, q, k_new, v_new = _case(seed=1)
    meta = build_attention_metadata(tables, [s for s, _ in SHAPES], [n for _, n in SHAPES], BLOCK, "cpu")
    plain = paged_attention(q, k_new, v_new, kv, 0, meta, HEAD_DIM**-0.5)
    for options in ({"sliding_window": 5}, {"logit_softcap": 0.5}):
        other = paged_attention(q, k_new, v_new, kv, 0, meta, HEAD_DIM**-0.5, **options)  # type: ignore[arg-type]
        assert float((other - plain).abs().max()) > 1e-2, options
