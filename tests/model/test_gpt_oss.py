"""gpt-oss against transformers, float32 on CPU: attention sinks on every attention path, the whole tiny
model over the paged cache, its config, YaRN, the experts' layout and the MXFP4 decoder.

1. Attention sinks (model/attention.py, the native decode and prefill kernels, Triton under
   TRITON_INTERPRET=1) against a float64 dense attention written out here from transformers' eager
   gpt-oss attention (scores, mask, the head's sink appended as one more logit, softmax, the sink's
   column dropped), on random inputs over scrambled blocks, with and without sliding windows, grouped
   query heads, sinks above and below the scores' range. Tolerance ATTN_TOL = 2e-6 on outputs of
   magnitude ~1 (float32 sums against float64); measured max abs error over the windows: reference
   (slot gather, our own softmax) 2.8e-7, "paged" on the native decode + prefill kernels 3.7e-7, "paged"
   with the kernels off (the torch path over cache views) 2.8e-7, Triton (interpreter) 4.4e-7; head_dim 8
   (the native prefill kernel declines it: the torch path) 3.0e-7, Triton 3.8e-7. Without the sinks the
   answer moves by > 1e-2, so a path that dropped them would fail. The native prefill kernel with sinks
   stays bit for bit chunk-invariant (torch.equal).
2. The tiny model (4 layers sliding / full / sliding / full, window 8 under a 20-token prompt, 4 heads of
   16 over 2 KV heads, 4 experts top 2, vocabulary 512, YaRN, swiglu_limit 1 so both clamps bite, sinks
   ~2 N(0, 1)) against transformers' GptOssForCausalLM (eager attention, eager experts): prefill then 12
   decode steps, on the reference and paged backends, Triton (interpreter), and the fast kernels
   (DecoderLM(kernels="fast"): native norms, RoPE + K/V writes, attention with sinks; oneDNN
   projections). Tolerance ATOL = 1e-4 on logits of magnitude up to ~5.6 (tests/model/
   test_model_numerics.py's); measured max abs error: reference 5.0e-6, paged 4.3e-6, Triton 4.6e-6,
   fast kernels 4.8e-6 against transformers and 5.2e-6 against the reference model (the same packed on
   load, as the engine loads: 5.2e-6). bfloat16: 0.079 from transformers' float32 logits where its own
   bfloat16 model is 0.109 off (tolerance: twice that, at least 0.05). In these layers
   13-22% of the gate and 37-47% of the up values are clamped; the sinks move the logits by up to 4.2.
   Chunked prefill (chunks of 5) against one chunk: measured 3.3e-6, tolerance 2e-5.
3. The experts alone against transformers' GptOssMLP (GptOssTopKRouter + GptOssExperts, eager), with
   inputs scaled so 25% of the gate and 46% of the up values are clamped: measured 0 (bit for bit, on
   outputs up to ~220), tolerance 1e-5 * the outputs' magnitude.
4. YaRN: our tables for the released config (factor 32 over 4096, truncate false, theta 150000, head_dim
   64) against transformers' GptOssRotaryEmbedding: inv_freq and the attention factor bit for bit,
   cos / sin at positions up to 131071 bit for bit.
5. MXFP4: dequantize_mxfp4 against transformers' convert_moe_packed_tensors, bit for bit in float32 and
   bfloat16 over every nibble and the extreme exponents (0: subnormal, 254: overflow to inf); a
   checkpoint whose experts are MXFP4 pairs loads to the same parameters as transformers' dequantized
   tensors (torch.equal) and the same logits as transformers' model over them (measured 2.4e-6, ATOL).
6. The config: the released gpt-oss-20b config.json (its parameter count is transformers' own,
   20,914,757,184), transformers' defaults for what a file leaves out, and the refusals by name; the Triton
   sinks kernel compiled for sm_90 without a GPU (slow).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.kernels.cpu import native
from onecall.kernels.ops import TORCH_ATTENTION
from onecall.loading.weights import _gpt_oss_layout, dequantize_mxfp4, load_weights
from onecall.model import rope
from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.config import GLOBAL, SLIDING, GptOssSpec, ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.gpt_oss import GptOssAttention, GptOssExperts, GptOssMoE
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import RotaryEmbedding
from onecall.model.parallel import TensorParallel
from tests.helpers.make_models import fast_copy, hf_and_ours
from tests.model.test_model_numerics import Harness, Seq, hf_logits

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4  # logits against transformers
ATTN_TOL = 2e-6  # attention outputs against the float64 dense definition
VOCAB = 512

_has_triton = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
try:
    import triton  # noqa: F401
except ImportError:
    _has_triton = False

# The released gpt-oss-20b config.json (openai/gpt-oss-20b), as the hub serves it.
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


# ---------------------------------------------------------------- 1. attention sinks, every path
NUM_HEADS, NUM_KV_HEADS, BLOCK = 4, 2, 4
# (seq_len, query_len): a fresh prefill past one 64-key tile, a chunk after a cached prefix, decode rows
# whose history spans two of the decode kernel's 128-position chunks, and short ones
SHAPES = [(70, 70), (40, 7), (150, 1), (33, 1), (3, 1)]
# above every score (the kernels' rescaling by the sink), in range, below, negligible
SINKS = torch.tensor([6.0, 0.5, -2.0, -30.0])


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """transformers' eager gpt-oss attention in float64: q (n, H, D) at positions q_pos over k, v (L, KVH,
    D) at 0..L-1 -> (n, H, D)."""
    group, head_dim = NUM_HEADS // NUM_KV_HEADS, q.shape[-1]
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(NUM_HEADS):
        scores = q[:, h].double() @ k[:, h // group].double().T * head_dim**-0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks[h].double().expand(scores.shape[0], 1)), dim=1)
        probs = scores.softmax(dim=-1)[:, : k.shape[0]]
        out[:, h] = probs @ v[:, h // group].double()
    return out


def _case(
    head_dim: int, seed: int
) -> tuple[PagedKVCache, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s, _ in SHAPES) + 3
    kv = PagedKVCache(1, num_blocks, BLOCK, NUM_KV_HEADS, head_dim, torch.float32, "cpu")
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for seq_len, _ in SHAPES:
        n = -(-seq_len // BLOCK)
        tables.append(perm[used : used + n])
        used += n
    num_tokens = sum(q for _, q in SHAPES)
    q = torch.randn(num_tokens, NUM_HEADS, head_dim, generator=g)
    k_new = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g)
    v_new = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g)
    return kv, tables, q, k_new, v_new


def _want(
    kv: PagedKVCache, tables: list[list[int]], q: torch.Tensor, window: int | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The dense answer, read from the cache after paged_attention stored the new K/V."""
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for table, (seq_len, query_len) in zip(tables, SHAPES, strict=True):
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:seq_len]
        q_pos = torch.arange(seq_len - query_len, seq_len)
        out[row : row + query_len] = _dense(
            q[row : row + query_len], kv.k[0][slots], kv.v[0][slots], q_pos, window, sinks
        )
        row += query_len
    return out


PATHS = ["reference", "paged", "paged-sdpa"] + (["triton"] if _has_triton else [])


@pytest.mark.parametrize("head_dim", [16, 8], ids=["d16", "d8-no-native-prefill"])
@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("path", PATHS)
def test_sinks_on_every_attention_path(
    path: str, window: int | None, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "paged" path runs the native kernels where they load (decode rows: the decode kernel; prompt chunks:
    the prefill kernel when head_dim % 16 == 0, else the torch path), "paged-sdpa" the same metadata
    with the kernels switched off (the torch path over views of the cache). Each native call is
    checked to have carried the sinks."""
    kv, tables, q, k_new, v_new = _case(head_dim, seed=head_dim)
    backend = "paged" if path.startswith("paged") else path
    meta = build_attention_metadata(
        tables, [s for s, _ in SHAPES], [n for _, n in SHAPES], BLOCK, "cpu", backend=backend
    )
    if path == "paged-sdpa":
        meta.kernels, meta.decode = TORCH_ATTENTION, None
    calls: list[str] = []
    for name in ("paged_decode_attention", "prefill_attention"):
        real = getattr(native, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> torch.Tensor:
            assert kwargs.get("sinks", args[-1]) is not None, f"{_name} called without the sinks"
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, spy)
    got = paged_attention(q, k_new, v_new, kv, 0, meta, head_dim**-0.5, sliding_window=window, sinks=SINKS)
    if path == "paged" and native.load() is not None:
        expected = (
            {"paged_decode_attention", "prefill_attention"}
            if head_dim % 16 == 0
            else {"paged_decode_attention"}
        )
        assert set(calls) == expected
    want = _want(kv, tables, q, window, SINKS)
    diff = float((got.double() - want).abs().max())
    assert diff <= ATTN_TOL, diff
    plain = _want(kv, tables, q, window, None)
    assert float((plain - want).abs().max()) > 1e-2  # the sinks matter here: a path without them fails


@pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
def test_native_prefill_with_sinks_is_chunk_invariant() -> None:
    """A row's bits depend only on its query, position, KV and sink: one 70-row call equals 30 + 40."""
    lib = native.load()
    assert lib is not None
    kv, tables, q, _, _ = _case(16, seed=3)
    blocks = torch.tensor(tables[0], dtype=torch.int64)
    q = q[:70]

    def run(rows: slice, seq_len: int) -> torch.Tensor:
        return native.prefill_attention(
            lib, q[rows], kv.k[0], kv.v[0], seq_len, -1, blocks, BLOCK, 0.25, 1, 9, None, SINKS
        )

    whole = run(slice(0, 70), 70)
    assert torch.equal(torch.cat((run(slice(0, 30), 30), run(slice(30, 70), 70))), whole)


# The sinks kernel compiled for an H100/H200 (sm_90) without a GPU, as tests/kernels/test_triton_attention.py
# compiles the plain one: gpt-oss's head (64, 8 query heads per KV head) in bfloat16 for decode rows and
# long chunks, in float32, with float32 sinks; within the shared memory an sm_90 block has.
_COMPILE_SINKS = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if "nvidia" not in triton.backends.backends:
    sys.exit(77)
from onecall.kernels.cuda.triton_attention import _paged_attention_sinks_kernel as kernel, tile_sizes
ints = "stride_q_tok stride_q_head stride_k_slot stride_k_head stride_o_tok stride_o_head max_blocks window"
consts = "HAS_SOFTCAP GROUP HEAD_DIM BLOCK_D BLOCK_SIZE BLOCK_M BLOCK_N PRECISION"
for q, max_query_len in [("bf16", 1), ("bf16", 1024), ("fp32", 64)]:
    block_d, block_m, block_n = tile_sizes(64, 2 if q == "bf16" else 4, max_query_len)
    sig = {"q_ptr": "*" + q, "k_ptr": "*" + q, "v_ptr": "*" + q, "o_ptr": "*" + q, "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "query_starts_ptr": "*i32", "scale": "fp32", "softcap": "fp32",
           "sinks_ptr": "*fp32"}
    sig |= {name: "i32" for name in ints.split()} | {name: "constexpr" for name in consts.split()}
    sig = {name: sig[name] for name in kernel.arg_names}
    const = {"HAS_SOFTCAP": False, "GROUP": 8, "HEAD_DIM": 64, "BLOCK_D": block_d, "BLOCK_SIZE": 16,
             "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": "ieee" if q == "fp32" else "tf32"}
    compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32))
    assert compiled.metadata.shared <= 232448, (q, max_query_len, compiled.metadata.shared)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton, reason="triton is a test extra")
def test_the_sinks_kernel_compiles_for_an_h200() -> None:
    from tests.kernels.test_triton_attention import compile_for_sm90

    compile_for_sm90(_COMPILE_SINKS)


# ---------------------------------------------------------------- 2. the tiny model against transformers
def tiny_gpt_oss_config(**overrides: Any) -> GptOssConfig:
    """4 layers (sliding, full, sliding, full), window 8, 4 heads of 16 over 2 KV heads, 4 experts of 64
    (top 2), vocabulary 512, YaRN (factor 4 over 64 positions), swiglu_limit 1 (both clamps bite on
    these weights); eager attention and experts (transformers' definitions)."""
    config: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, rms_norm_eps=1e-5, swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    )  # fmt: skip
    config.update(overrides)
    return GptOssConfig(**config, attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def models() -> tuple[Any, DecoderLM]:
    """transformers' model (every parameter random: tests/helpers/make_models.py's hf_and_ours, then
    sinks ~2 N(0, 1) so they weigh in) and ours loaded from its state dict."""
    hf, ours = hf_and_ours(tiny_gpt_oss_config(), GptOssForCausalLM, weight_scale=0.15)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
    load_weights(ours, hf.state_dict().items())
    return hf, ours


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_and_decode(
    model: DecoderLM, tokens: list[int], backend: str, steps: int = 12
) -> tuple[Seq, torch.Tensor]:
    """A 20-token prompt, then `steps` greedy decode steps: (the sequence, every logit row it produced)."""
    harness = Harness(model)
    seq = Seq(list(tokens))
    (logits,) = harness.step([(seq, len(tokens))], backend=backend)
    rows = [logits]
    for _ in range(steps):
        seq.tokens.append(int(rows[-1][-1].argmax()))
        (logits,) = harness.step([(seq, 1)], backend=backend)
        rows.append(logits)
    return seq, torch.cat(rows)


BACKENDS = ["reference", "paged"] + (["triton"] if _has_triton else [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_match_transformers(models: tuple[Any, DecoderLM], backend: str) -> None:
    hf, ours = models
    seq, got = _prefill_and_decode(ours, prompt(20, seed=1), backend)
    ref = hf_logits(hf, seq.tokens)[: got.shape[0]]
    diff = float((got - ref).abs().max())
    assert diff <= ATOL, diff


def test_chunked_prefill_equals_one_chunk(models: tuple[Any, DecoderLM]) -> None:
    hf, ours = models
    tokens = prompt(23, seed=2)
    (whole,) = Harness(ours).step([(Seq(list(tokens)), 23)])
    harness, seq, chunks = Harness(ours), Seq(list(tokens)), []
    while seq.num_cached < len(tokens):
        (logits,) = harness.step([(seq, min(5, len(tokens) - seq.num_cached))])  # chunks straddle the window
        chunks.append(logits)
    assert float((torch.cat(chunks) - whole).abs().max()) <= 2e-5
    assert float((whole - hf_logits(hf, tokens)).abs().max()) <= ATOL


@pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
def test_the_fast_kernels_run_gpt_oss(models: tuple[Any, DecoderLM]) -> None:
    from onecall.loading.packing import enable_fast_kernels

    hf, ours = models
    fast = fast_copy(ours)
    enable_fast_kernels(fast)
    assert "onednn" in fast.kernels and fast.native_step is None  # the one-call step declines gpt-oss
    seq, got = _prefill_and_decode(fast, prompt(20, seed=1), "paged")
    _, want = _prefill_and_decode(ours, prompt(20, seed=1), "reference")
    assert float((got - want).abs().max()) <= ATOL
    assert float((got - hf_logits(hf, seq.tokens)[: got.shape[0]]).abs().max()) <= ATOL
    # as the engine loads it: each projection packed as it streams in (no dense weight), experts copied
    packed = DecoderLM(ours.config, kernels="fast")
    load_weights(packed, hf.state_dict().items())
    assert packed.pack_on_load and "onednn" in packed.kernels
    _, got = _prefill_and_decode(packed, prompt(20, seed=1), "paged")
    assert float((got - want).abs().max()) <= ATOL


def test_bfloat16_tracks_float32(models: tuple[Any, DecoderLM]) -> None:
    """dtype plumbing in bfloat16 (float32 norm weights and sinks, bfloat16 experts and cache): our
    error against transformers' float32 logits within twice transformers' own bfloat16 error (at least
    0.05), as tests/model/test_model_numerics.py holds the other families."""
    hf, ours = models
    tokens = prompt(12, seed=30) + [3]
    ref = hf_logits(hf, tokens)
    hf_err = float((hf_logits(copy.deepcopy(hf).to(torch.bfloat16), tokens) - ref).abs().max())
    ours16 = DecoderLM(ours.config, dtype=torch.bfloat16)
    load_weights(ours16, hf.state_dict().items())
    assert ours16.model.layers[0].self_attn.sinks.dtype == torch.float32
    harness = Harness(ours16, dtype=torch.bfloat16)
    seq = Seq(tokens[:-1])
    (prefill,) = harness.step([(seq, 12)])
    seq.tokens.append(3)
    (decode,) = harness.step([(seq, 1)])
    err = float((torch.cat([prefill, decode]) - ref).abs().max())
    assert err <= max(2 * hf_err, 0.05), (err, hf_err)


def test_the_layers_are_gpt_oss(models: tuple[Any, DecoderLM]) -> None:
    """Alternating windows, sinks in float32, every parameter count as transformers'."""
    hf, ours = models
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == [8, None, 8, None]
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn, GptOssAttention) and attn.sinks.dtype == torch.float32
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert ours.config.num_parameters == sum(p.numel() for p in hf.parameters())
    with pytest.raises(UnsupportedModelError, match="tensor parallel"):
        DecoderLM(ours.config, tp=TensorParallel(rank=0, world_size=2))


# ---------------------------------------------------------------- 3. router and experts alone
def test_router_and_experts_match_transformers() -> None:
    """transformers' GptOssTopKRouter + GptOssExperts (eager) against GptOssMoE, weights from one state
    dict through the loader's layout (interleaved gate/up columns -> [gate; up] rows). Inputs scaled so
    both clamps act on a good share of the values (counted)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_config = tiny_gpt_oss_config(swiglu_limit=7.0)
    torch.manual_seed(0)
    mlp = GptOssMLP(hf_config).eval()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_((0.2 if name.endswith("bias") else 0.3) * torch.randn_like(p))
    config = model_config_from_hf(hf_config.to_dict())
    assert config.gpt_oss is not None
    ours = GptOssMoE(config, config.gpt_oss, torch.float32, "cpu")
    state = {f"model.layers.0.mlp.{k}": v for k, v in mlp.state_dict().items()}
    rewritten = dict(_gpt_oss_layout(state.items(), torch.float32))  # the loader's rewrite
    ours.load_state_dict({k.removeprefix("model.layers.0.mlp."): v for k, v in rewritten.items()})
    x = 4.0 * torch.randn(33, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = mlp(x[None])
        got = ours(x)
        gate_up = x @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    clamped = float((gate_up[:, ::2] > 7.0).float().mean() + (gate_up[:, 1::2].abs() > 7.0).float().mean())
    assert clamped > 0.2, clamped
    diff = float((got - want[0]).abs().max())
    assert diff <= 1e-5 * float(want.abs().max()), diff
    # top-k softmax over the selected logits == softmax over all, renormalised over the top k
    weights, experts = ours.route(x)
    probs = ours.router(x).softmax(-1)
    renorm = probs.gather(1, experts) / probs.gather(1, experts).sum(-1, keepdim=True)
    assert torch.allclose(weights, renorm, atol=1e-6)


# ---------------------------------------------------------------- 4. config and YaRN
def test_the_released_config() -> None:
    c = model_config_from_hf(GPT_OSS_20B)
    assert c.architecture == "gpt_oss" and c.head_dim == 64 and c.num_key_value_heads == 8
    assert c.attention_bias and c.o_proj_bias and not c.qk_norm and not c.tie_word_embeddings
    assert c.gpt_oss == GptOssSpec(tuple([SLIDING, GLOBAL] * 12), 128, 1.702, 7.0)
    moe, s = c.moe, c.rope_scaling
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        32,
        4,
        2880,
    )
    assert s is not None and s.rope_type == "yarn" and s.factor == 32.0 and not s.truncate
    assert s.original_max_position_embeddings == 4096
    assert c.rope_theta == 150000 and c.rms_norm_eps == 1e-5 and c.sliding_window is None
    # transformers' own count of the same config on the meta device: 20,914,757,184
    assert c.num_parameters == 20_914_757_184
    assert ModelConfig(**c.to_dict()) == c


def test_defaults_are_transformers() -> None:
    """A config.json that leaves everything out: transformers' GptOssConfig defaults, read off it."""
    minimal = {"architectures": ["GptOssForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
               "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 16}  # fmt: skip
    c = model_config_from_hf(minimal)
    t = GptOssConfig(**{k: v for k, v in minimal.items() if k != "architectures"})
    assert c.gpt_oss is not None and c.moe is not None and c.rope_scaling is not None
    assert c.num_key_value_heads == t.num_key_value_heads and c.head_dim == t.head_dim
    assert c.rms_norm_eps == t.rms_norm_eps
    assert list(c.gpt_oss.layer_types) == t.layer_types and c.gpt_oss.sliding_window == t.sliding_window
    assert (c.gpt_oss.swiglu_alpha, c.gpt_oss.swiglu_limit) == (t.swiglu_alpha, t.swiglu_limit)
    assert (c.moe.num_experts, c.moe.num_experts_per_tok) == (t.num_local_experts, t.num_experts_per_tok)
    assert c.attention_bias == t.attention_bias and c.max_position_embeddings == t.max_position_embeddings
    params = t.rope_parameters
    assert c.rope_theta == params["rope_theta"]
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.beta_fast, s.beta_slow, s.truncate, s.original_max_position_embeddings) == (
        params["rope_type"], params["factor"], params["beta_fast"], params["beta_slow"], params["truncate"],
        params["original_max_position_embeddings"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
        ({"layer_types": ["chunked_attention", "full_attention"] * 12}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window is null"),
        ({"layer_types": ["full_attention"] * 23}, "23 entries for 24 layers"),
        ({"swiglu_limit": 0}, "swiglu_limit"),
        ({"rope_scaling": {"rope_type": "ntk_by_parts"}}, "rope_type 'ntk_by_parts' is not supported"),
        (
            {
                "rope_scaling": None,
                "rope_parameters": {SLIDING: {"rope_type": "default"}, GLOBAL: {"rope_type": "default"}},
            },
            "per layer type",
        ),
    ],
)
def test_what_gpt_oss_refuses(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        model_config_from_hf({**GPT_OSS_20B, **change})


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_transformers(truncate: bool) -> None:
    """The released RoPE (and the same with truncate true, which moves the ramp: it must matter)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    d = copy.deepcopy(GPT_OSS_20B)
    d["rope_scaling"]["truncate"] = truncate
    c = model_config_from_hf(d)
    t = GptOssConfig(
        **{k: v for k, v in d.items() if k not in ("architectures", "model_type", "quantization_config")}
    )
    hf_rope = GptOssRotaryEmbedding(t)
    inv_freq, factor = rope.inv_freq_and_attention_factor(c.rope_theta, c.rotary_dim, c.rope_scaling, 131072)
    assert torch.equal(inv_freq, hf_rope.inv_freq) and factor == hf_rope.attention_scaling
    ours = RotaryEmbedding.from_config(c, torch.float32, "cpu")
    positions = torch.tensor([0, 1, 127, 128, 4095, 4096, 50_000, 131_071])
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(ours.cos[positions], cos[0]) and torch.equal(ours.sin[positions], sin[0])
    assert c.rope_scaling is not None
    other = dataclasses.replace(c.rope_scaling, truncate=not truncate)
    assert not torch.equal(rope.inv_freq_and_attention_factor(c.rope_theta, 64, other, 131072)[0], inv_freq)


# ---------------------------------------------------------------- 5. MXFP4
def _mxfp4(
    shape: tuple[int, ...], scale_range: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (*shape, 16) and scales (*shape) in [lo, hi] (uint8)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_range[0], scale_range[1] + 1, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decoder_is_transformers(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 40, 4), (0, 254), seed=0)
    extremes = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254], dtype=torch.uint8)
    scales[0, : len(extremes), 0] = extremes
    nibbles = torch.arange(16, dtype=torch.uint8)
    blocks[0, :, 0] = (nibbles | (nibbles.flip(0) << 4)).repeat(40, 1)  # every nibble, low and high
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, in, out): transposed
    ours = dequantize_mxfp4(blocks, scales, dtype)  # (E, out, in)
    assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)
    subnormal = (ours.abs() < 1e-37) & (ours != 0)
    assert bool(ours.isinf().any()) and bool(subnormal.any())  # both ends of the exponent range ran
    nan = dequantize_mxfp4(blocks[:1, :1], torch.full((1, 1, 4), 255, dtype=torch.uint8))
    assert bool(nan.isnan().all())  # E8M0 0xFF is NaN (OCP MX)


@pytest.mark.parametrize("scales_first", [False, True])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(scales_first: bool) -> None:
    """A checkpoint with every layer's experts as MXFP4 pairs (in either order): the same parameters as
    from transformers' dequantized tensors, and the same logits as its model over them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, dense = hf_and_ours(tiny_gpt_oss_config(), GptOssForCausalLM, weight_scale=0.15)
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for j, (proj, rows, cols) in enumerate((("gate_up_proj", 128, 64), ("down_proj", 64, 64))):
                blocks, scales = _mxfp4((4, rows, cols // 32), (120, 123), seed=10 * i + j)
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                base = f"model.layers.{i}.mlp.experts.{proj}"
                pair = {f"{base}_scales": scales, f"{base}_blocks": blocks}
                quantized |= pair if scales_first else dict(reversed(pair.items()))
    load_weights(dense, hf.state_dict().items())
    dense_experts = ("experts.gate_up_proj", "experts.down_proj")
    checkpoint = [(k, v) for k, v in hf.state_dict().items() if not k.endswith(dense_experts)]
    ours = DecoderLM(dense.config)
    load_weights(ours, [*checkpoint[:5], *quantized.items(), *checkpoint[5:]])
    for name, param in dense.named_parameters():
        assert torch.equal(ours.get_parameter(name), param), name
    tokens = prompt(12, seed=4)
    (logits,) = Harness(ours).step([(Seq(tokens), 12)])
    assert float((logits - hf_logits(hf, tokens)).abs().max()) <= ATOL
    unpaired = [(k, v) for k, v in quantized.items() if not k.endswith("3.mlp.experts.down_proj_blocks")]
    with pytest.raises(UnsupportedModelError, match="down_proj_scales"):
        load_weights(DecoderLM(dense.config), [*checkpoint, *unpaired])


def test_moe_routes_like_experts_module() -> None:
    """GptOssExperts with one expert per token and weight 1 is that expert's MLP (the grouping is exact)."""
    spec = GptOssSpec((SLIDING,), 8)
    experts = GptOssExperts(3, 8, 4, spec, torch.float32, "cpu")
    for p in experts.parameters():
        torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[2], [0], [2], [1], [0]])
    got = experts(x, torch.ones(5, 1), ids)
    for t in range(5):
        e = int(ids[t, 0])
        gate, up = (experts.gate_up_proj[e] @ x[t] + experts.gate_up_proj_bias[e]).chunk(2)
        act = (up.clamp(-7, 7) + 1) * gate.clamp(max=7) * torch.sigmoid(1.702 * gate.clamp(max=7))
        assert torch.allclose(got[t], experts.down_proj[e] @ act + experts.down_proj_bias[e], atol=1e-6)
