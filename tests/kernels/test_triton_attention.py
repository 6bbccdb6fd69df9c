"""The Triton paged attention kernel (kernels/cuda/triton_attention.py) against the reference backend.

Runs on CPU under TRITON_INTERPRET=1 (set for the session in conftest.py; Triton's interpreter
executes the kernel with numpy), so the CUDA path's numerics are checked here without a GPU;
benchmarks/gpu_check.py runs it on a GPU.
Tolerance: float32 throughout, online softmax against SDPA's: max abs diff <= 2e-5 on outputs of
magnitude ~1. The batch mixes a fresh prefill, a chunk after a cached prefix, and decode rows, over
scrambled physical blocks, with grouped-query heads. A second test runs the Qwen3-8B head shape in
float16 and caches stored in another dtype than the queries (its tolerances in its docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (6, 3, 32, 16), (4, 2, 96, 16), (4, 2, 8, 4)],
    ids=["16", "32", "96-phi3-padded-to-128", "8-padded-to-16"],
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


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "atol"),
    [
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.float16, 2e-5),  # kv_cache_dtype float16 under a float32 model
        (torch.float16, torch.float32, 2e-3),
    ],
)
def test_qwen3_8b_head_shape_and_a_cache_of_another_dtype(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, atol: float
) -> None:
    """The 8B shape's constexprs (head_dim 128, 4 query heads per KV head, 16-token blocks, BLOCK_M 64
    for a 20-row chunk and 16 for decode rows, BLOCK_N 64) in low precision, and a cache stored in
    another dtype than the queries (converted on load: tl.dot refuses mixed operands). float16 stands
    in for bfloat16: Triton's interpreter computes bfloat16 dot products wrongly (it multiplies the
    raw bits), so bfloat16 is checked on a GPU (benchmarks/gpu_check.py). Tolerance: two float16 ulps
    at the outputs' magnitude (~1) where the output is float16; float32's 2e-5 otherwise."""
    g = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 128, 16
    kv = PagedKVCache(1, 16, block_size, num_kv_heads, head_dim, kv_dtype, "cpu")
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    tables, seq_lens, query_lens = (
        [[3, 1, 7], [2, 9, 4]],
        [40, 33],
        [20, 1],
    )  # a chunk after 20 cached; a decode row
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(q_dtype)
    outs = {}
    for backend in ("reference", "triton"):
        meta = build_attention_metadata(tables, seq_lens, query_lens, block_size, "cpu", backend=backend)
        outs[backend] = paged_attention(q, None, None, kv, 0, meta, head_dim**-0.5)
    assert outs["triton"].dtype == q_dtype
    diff = (outs["triton"].float() - outs["reference"].float()).abs().max().item()
    assert diff <= atol, diff


# Compiled for an H100/H200 (sm_90) in a subprocess without the interpreter (it cannot compile while
# TRITON_INTERPRET=1 is set): Triton's own compiler and ptxas run here, no GPU needed. What the
# interpreter cannot see: the kernel as the GPU compiles it (static branches, dtypes tl.dot takes,
# shared memory), at the tile sizes the wrapper picks. The 8B model's bfloat16 layouts (both
# BLOCK_M), a float16 cache under bfloat16 queries, Phi-3's padded head, Gemma 2's soft-capped
# 256-wide head, the tiny float32 model's; and a float32 head of 128 within an sm_86's 99 KB.
_COMPILE_ATTENTION = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if "nvidia" not in triton.backends.backends:
    sys.exit(77)
from onecall.kernels.cuda.triton_attention import _paged_attention_kernel as kernel, tile_sizes
ints = "stride_q_tok stride_q_head stride_k_slot stride_k_head stride_o_tok stride_o_head max_blocks window"
consts = "HAS_SOFTCAP GROUP HEAD_DIM BLOCK_D BLOCK_SIZE BLOCK_M BLOCK_N PRECISION"
size = {"bf16": 2, "fp16": 2, "fp32": 4}
# (q dtype, cache dtype, head_dim, max_query_len, soft-cap, compute capability, its shared memory per block)
for q, kv, head_dim, max_query_len, softcap, cc, limit in [
    ("bf16", "bf16", 128, 1, False, 90, 232448), ("bf16", "bf16", 128, 1024, False, 90, 232448),
    ("bf16", "fp16", 128, 1, False, 90, 232448), ("bf16", "bf16", 96, 64, False, 90, 232448),
    ("bf16", "bf16", 256, 64, True, 90, 232448), ("fp32", "fp32", 32, 1, False, 90, 232448),
    ("fp32", "fp32", 128, 64, False, 86, 101376),  # a float32 model on a 99 KB GPU
]:
    block_d, block_m, block_n = tile_sizes(head_dim, size[q], max_query_len)  # what the wrapper launches
    sig = {"q_ptr": "*" + q, "k_ptr": "*" + kv, "v_ptr": "*" + kv, "o_ptr": "*" + q, "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "query_starts_ptr": "*i32", "scale": "fp32", "softcap": "fp32"}
    sig |= {name: "i32" for name in ints.split()} | {name: "constexpr" for name in consts.split()}
    sig = {name: sig[name] for name in kernel.arg_names}
    const = {"HAS_SOFTCAP": softcap, "GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": 16,
             "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": "ieee" if q == "fp32" else "tf32"}
    compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", cc, 32))
    assert compiled.metadata.shared <= limit, (q, head_dim, block_m, block_n, cc, compiled.metadata.shared)
"""


def compile_for_sm90(code: str) -> None:
    """Run `code` in a Python without TRITON_INTERPRET (skip when Triton has no CUDA backend)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    if done.returncode == 77:
        pytest.skip("this Triton has no CUDA backend to compile for")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_kernel_compiles_for_an_h200() -> None:
    compile_for_sm90(_COMPILE_ATTENTION)
