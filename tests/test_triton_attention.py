"""The Triton paged attention kernel (model/triton_attention.py) against the reference backend.

Runs on CPU under TRITON_INTERPRET=1 (set for the session in conftest.py; Triton's interpreter
executes the kernel with numpy), so the CUDA path's numerics are checked here without a GPU;
benchmarks/gpu_check.py runs it on a GPU.
Tolerance: float32 throughout, online softmax against SDPA's: max abs diff <= 2e-5 on outputs of
magnitude ~1. The batch mixes a fresh prefill, a chunk after a cached prefix, and decode rows, over
scrambled physical blocks, with grouped-query heads.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test extra (pip install -e '.[test]')")

from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a CUDA device or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(4, 2, 16, 4), (6, 3, 32, 16)]
)
def test_triton_matches_the_reference_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    g = torch.Generator().manual_seed(head_dim)
    num_blocks = 48
    kv = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # (seq_len, query_len): a fresh prefill, a chunk after a cached prefix, decode rows
    shapes = [(21, 21), (40, 7), (33, 1), (1, 1), (70, 1)]
    tables, used = [], 0
    for seq_len, _ in shapes:
        n = -(-seq_len // block_size)
        tables.append(perm[used : used + n])
        used += n
    assert used <= num_blocks
    num_tokens = sum(q for _, q in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    seq_lens, query_lens = [s for s, _ in shapes], [q for _, q in shapes]
    outs = {}
    for backend in ("reference", "triton"):
        meta = build_attention_metadata(tables, seq_lens, query_lens, block_size, "cpu", backend=backend)
        outs[backend] = paged_attention(q, k_new, v_new, kv, 0, meta, head_dim**-0.5)
    diff = (outs["triton"] - outs["reference"]).abs().max().item()
    assert diff <= 2e-5, diff
