"""The fused Triton ops of the CUDA path (kernels/cuda/fused_ops.py) against the torch ops they replace.

Runs on CPU under TRITON_INTERPRET=1 (conftest.py), as tests/kernels/test_triton_attention.py does.
Tolerances: float32, the same formulas in float32 (summation order only): 1e-5 relative to the
values' scale. No bfloat16 here: Triton's interpreter converts float32 to bfloat16 by truncation (a GPU
rounds to nearest even), so its bfloat16 results differ from torch's by an interpreter artefact;
benchmarks/gpu_check.py's tiny_qwen3_bf16 section checks bfloat16 on a GPU. The engine test runs a tiny
Qwen3 with and without the fused ops through the Triton backend and requires equal greedy tokens.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test extra (pip install -e '.[test]')")

from onecall.kernels.cuda.fused_ops import TritonLayerOps, add_rms_norm, rope_store, silu_mul
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a CUDA device or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_matches_the_module(residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-6, torch.float32, "cpu")
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    h = torch.randn(5, 96, generator=g)
    r = torch.randn(5, 96, generator=g) if residual else None
    want_h, want = norm.add_and_norm(h.clone(), r)
    got_h = h.clone()
    got = add_rms_norm(got_h, r, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)  # the residual add is one float32 add
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _torch_rope_store(qkv, heads, kv_heads, head_dim, cos, sin, slots, kv, norms):
    n = qkv.shape[0]
    x = qkv.view(n, heads + 2 * kv_heads, head_dim)
    qk, v = x.split([heads + kv_heads, kv_heads], dim=1)
    if norms is not None:
        q, k = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat((norms[0](q), norms[1](k)), dim=1)
    qk = apply_rope(qk, cos[:, None], sin[:, None])
    kv.k[0].index_copy_(0, slots, qk[:, heads:])
    kv.v[0].index_copy_(0, slots, v)
    return qk


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 32), (8, 2, 128), (4, 2, 96)],
    ids=["tiny", "qwen3-8b-head", "phi3-head"],
)
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_store_matches_norm_rope_and_cache_writes(
    with_norm: bool, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Also at the 8B model's head shape (HALF 64, 4 query heads per KV head), the GPU run's, and at
    Phi-3's head_dim 96 (HALF 48: lanes masked up to a power of two)."""
    g = torch.Generator().manual_seed(2)
    n = 6
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g)
    angles = torch.rand(n, head_dim // 2, generator=g) * 6.0
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 9, 0, 17, 5, 12])
    norms = None
    if with_norm:
        norms = (RMSNorm(head_dim, 1e-6, torch.float32, "cpu"), RMSNorm(head_dim, 1e-6, torch.float32, "cpu"))
        with torch.no_grad():
            for m in norms:
                m.weight.normal_(generator=g)
    ref_kv = PagedKVCache(1, 5, 4, kv_heads, head_dim, torch.float32, "cpu")
    got_kv = PagedKVCache(1, 5, 4, kv_heads, head_dim, torch.float32, "cpu")
    for cache in (ref_kv.k, ref_kv.v, got_kv.k, got_kv.v):
        cache.zero_()  # slots no token writes must stay equal too
    with torch.no_grad():
        want_qk = _torch_rope_store(qkv.clone(), heads, kv_heads, head_dim, cos, sin, slots, ref_kv, norms)
        got = qkv.clone()
        qk_norm = None if norms is None else (norms[0].weight, norms[1].weight, 1e-6)
        rope_store(got, heads, kv_heads, cos, sin, slots, got_kv.k[0], got_kv.v[0], qk_norm)
    got_qk = got.view(n, heads + 2 * kv_heads, head_dim)[:, : heads + kv_heads]
    torch.testing.assert_close(got_qk, want_qk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.k, ref_kv.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.v, ref_kv.v, rtol=0, atol=0)  # V is copied as it is
    assert torch.equal(
        got.view(n, -1, head_dim)[:, heads + kv_heads :], qkv.view(n, -1, head_dim)[:, heads + kv_heads :]
    )


def test_silu_mul_matches_the_mlp_activation() -> None:
    g = torch.Generator().manual_seed(3)
    y = torch.randn(3, 2 * 1500, generator=g)  # more than one block of columns
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(y), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


class Counted(TritonLayerOps):
    """The Triton ops, counting the fused RoPE passes that ran."""

    rope_stores = 0

    def rope_store(self, *args: Any) -> bool:
        self.rope_stores += 1
        return super().rope_store(*args)


@pytest.mark.slow
def test_engine_greedy_tokens_equal_with_the_fused_ops() -> None:
    """A tiny Qwen3 (q/k norms) through the Triton backend on static decode buffers, as on CUDA:
    with the fused ops installed, the same greedy tokens as the torch ops (float32)."""
    import copy

    from onecall.kernels import ops
    from onecall.model.decoder import DecoderLM
    from onecall.sampling_params import SamplingParams
    from tests.helpers.tiny_engine import run_all, tiny_engine, tiny_model

    prompts = {f"r{i}": f"Count the apples number {i} " + "and pears " * i for i in range(2)}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        counted = Counted()
        layer_ops = counted if fused else ops.REFERENCE_OPS
        ref = tiny_model("qwen3")
        model = DecoderLM(ref.config, ops=layer_ops)  # what the engine builds on CUDA with the fast kernels
        model.load_state_dict(ref.state_dict())
        engine = tiny_engine(model=model.eval())
        engine.enable_static_decode(capture=False, backend="triton")
        copy.deepcopy(engine.parts.model)  # the ops do not stop a model from being copied
        layers = engine.parts.model.model  # DecoderLM.model: the layers and the final norm
        built_on = [m for m in layers.modules() if getattr(m, "ops", None) is layer_ops]
        # per layer: two norms, the q/k norms, attention, the MLP; and the final norm
        assert len(built_on) == 6 * engine.parts.model.config.num_hidden_layers + 1
        out = run_all(engine, prompts, params)
        assert (counted.rope_stores > 0) == fused
        tokens.append({rid: list(o.token_ids) for rid, o in out.items()})
    assert tokens[0] == tokens[1]


# The three kernels as the GPU compiles them (sm_90, no GPU needed; see test_triton_attention.py):
# the 8B model's bfloat16 shapes, and rope_store's masked lanes at Phi-3's head_dim 96.
_COMPILE_OPS = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if "nvidia" not in triton.backends.backends:
    sys.exit(77)
from onecall.kernels.cuda.fused_ops import _add_rms_norm_kernel, _rope_store_kernel, _silu_mul_kernel

types = {name: "*bf16" for name in "h_ptr r_ptr w_ptr y_ptr qkv_ptr cos_ptr sin_ptr q_norm_ptr k_norm_ptr".split()}
types |= {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16", "slot_ptr": "*i64", "eps": "fp32"}

def build(kernel, consts):  # every other argument is an int
    sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))

build(_add_rms_norm_kernel, {"HAS_RESIDUAL": True, "LOW_PRECISION": True, "BLOCK": 4096})
for half in (64, 48):
    build(_rope_store_kernel, {"HAS_NORM": True, "LOW_PRECISION": True, "HALF": half, "BLOCK_H": 64})
build(_silu_mul_kernel, {"BLOCK": 1024})
"""


@pytest.mark.slow
def test_the_kernels_compile_for_an_h200() -> None:
    from tests.kernels.test_triton_attention import compile_for_sm90

    compile_for_sm90(_COMPILE_OPS)
