"""Gemma 2 / Gemma 3 model code (model/gemma.py) against transformers' own classes, float32 on CPU.

Tiny random-weight Gemma2ForCausalLM / Gemma3ForCausalLM (hidden 64, 4 heads, 2 KV heads, head_dim 16,
intermediate 128, sliding_window 8, layer 0 sliding and layer 1 global; eager attention, so the
attention soft-cap applies) are copied into ours, with every norm weight folded to 1 + w as the loader
must. Each layer runs a 20-token prefill through the paged cache (block size 4, scrambled blocks) and
then 4 decode steps at positions 20..23, well past the 8-token window; transformers runs the same layer
over all 24 tokens at once with its causal (and sliding) mask. The configs make every Gemma knob bite:
attention soft-cap 2.0 and final soft-cap 3.0 (scores and logits exceed them), query_pre_attn_scalar 24
(not head_dim), Gemma 3's local and global RoPE bases differ and the global one is linearly scaled.
test_every_knob_is_needed checks that dropping any one of them breaks the match.

Tolerance: max abs diff <= 2e-5 on layer outputs (magnitude ~6) and 1e-4 on logits (capped at 3).
Everything is float32 and the formulas are the same; what differs is summation order (fused qkv and
gate/up matmuls, F.rms_norm against transformers' rsqrt, SDPA / the native decode kernel against
eager matmul-softmax) and the folded 1 + w rounded once to float32, as transformers does per call.
Those move results by ~1e-6; a knob left out moves them by >1e-2.

bfloat16 (test_bf16_layer_rounds_like_transformers): transformers' own bfloat16 layer is ~0.05-0.09
from the float32 answer (outputs ~6, a bfloat16 step there is 2**-5); ours must stay within 0.1 of
it and no further from float32 than twice its distance. Rounding happens at different points
(fused projections, the paged cache, SDPA), so bit equality is not the bar. That bar is loose enough
that Llama's norm rounding order would pass it too (measured: 0.094 from transformers), so the norm's
order is pinned where it can be seen: test_bf16_norm_scales_in_float32_before_casting, bit for bit.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, Gemma2TextScaledWordEmbedding

from onecall.formats.hf_config import model_config_from_hf
from onecall.kernels.cpu import native
from onecall.kernels.ops import LayerOps
from onecall.kernels.select import layer_ops
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.config import GLOBAL, SLIDING, GemmaSpec, ModelConfig, RopeScaling
from onecall.model.decoder import DecoderLM
from onecall.model.gemma import (
    GemmaDecoderLayer,
    GemmaDecoderModel,
    GemmaRMSNorm,
    GemmaRotary,
    checkpoint_norm_weight,
    embed_scale,
    soft_cap,
)
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP
from tests.helpers.make_models import hf_and_ours
from tests.model.test_model_numerics import VOCAB as NUMERICS_VOCAB
from tests.model.test_model_numerics import Harness, Seq, assert_close, hf_logits, prompt

LAYER_ATOL = 2e-5
LOGITS_ATOL = 1e-4
BF16_ATOL = 0.1  # 3 bfloat16 steps at the outputs' magnitude (4..8: a step is 2**-5)
BLOCK, NUM_BLOCKS, VOCAB = 4, 32, 128
HIDDEN, HEAD_DIM, NUM_KV_HEADS = 64, 16, 2
PREFILL, DECODE = 20, 4  # positions 0..19 in one chunk, then 20..23 one at a time

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=8,
    layer_types=[SLIDING, GLOBAL], query_pre_attn_scalar=24, final_logit_softcapping=3.0,
    attn_implementation="eager",
)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(attn_logit_softcapping=2.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                GLOBAL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            }
        ),
    ),
}


# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


def _spec(c: Any, family: str) -> GemmaSpec:
    """What config.py will read from config.json, here from transformers' config object."""
    rope = c.rope_parameters
    return GemmaSpec(
        query_pre_attn_scalar=c.query_pre_attn_scalar,
        layer_types=tuple(c.layer_types),
        sliding_window=c.sliding_window,
        attn_logit_softcapping=c.attn_logit_softcapping if family == "gemma2" else None,
        final_logit_softcapping=c.final_logit_softcapping,
        rope_local_base_freq=rope[SLIDING]["rope_theta"] if family == "gemma3" else None,
    )


def _model_config(c: Any, family: str) -> ModelConfig:
    """The shared hyperparameters, the global layers' RoPE among them. Until config.py knows
    gemma2/gemma3 (the lead wires it), the llama/qwen3 names stand in: Attention reads only the
    shapes, attention_bias and qk_norm."""
    rope = c.rope_parameters[GLOBAL] if family == "gemma3" else c.rope_parameters
    scaling = RopeScaling(rope["rope_type"], rope["factor"]) if rope["rope_type"] == "linear" else None
    return ModelConfig(
        architecture="qwen3" if family == "gemma3" else "llama",
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope["rope_theta"], rope_scaling=scaling,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        attention_bias=False, qk_norm=family == "gemma3",
    )  # fmt: skip


class Case:
    """A random transformers model of one family and our ModelConfig/GemmaSpec for it."""

    def __init__(self, family: str) -> None:
        config_cls, model_cls, extra = FAMILIES[family]
        self.family = family
        self.hf_config = config_cls(**_COMMON, **extra)
        torch.manual_seed(0)
        self.hf = model_cls(self.hf_config).eval()
        with torch.no_grad():
            for name, p in self.hf.named_parameters():
                # Gemma norms scale by 1 + w and transformers initialises w to 0, which would hide a
                # missing fold: w ~ 0.3 N makes every norm weight count.
                p.copy_(0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        self.config = _model_config(self.hf_config, family)
        self.spec = _spec(self.hf_config, family)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request: pytest.FixtureRequest) -> Case:
    return Case(request.param)


def _load_layer(ours: GemmaDecoderLayer, hf_layer: Any) -> None:
    """What the loader does for one layer: fuse q/k/v and gate/up, fold 1 + w into every norm."""
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    with torch.no_grad():
        ours.self_attn.qkv_proj.weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        ours.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
        ours.mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        ours.mlp.down_proj.weight.copy_(mlp.down_proj.weight)
        norms = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ]
        for name in norms:
            getattr(ours, name).weight.copy_(checkpoint_norm_weight(getattr(hf_layer, name).weight))
        if ours.self_attn.q_norm is not None and ours.self_attn.k_norm is not None:
            ours.self_attn.q_norm.weight.copy_(checkpoint_norm_weight(attn.q_norm.weight))
            ours.self_attn.k_norm.weight.copy_(checkpoint_norm_weight(attn.k_norm.weight))  # fmt: skip


def _hf_layer_out(case: Case, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' layer over all of x (num_tokens, hidden) at positions 0.., its own mask, in x's
    dtype (a low-precision copy of the layer for a low-precision x)."""
    n = x.shape[0]
    positions = torch.arange(n)[None]
    rotary = case.hf.model.rotary_emb
    layer_type = case.hf_config.layer_types[layer_idx]
    cos_sin = (
        rotary(x[None], positions, layer_type) if case.family == "gemma3" else rotary(x[None], positions)
    )
    q_pos, k_pos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = k_pos <= q_pos
    if layer_type == SLIDING:
        visible &= k_pos > q_pos - case.hf_config.sliding_window
    mask = torch.zeros(n, n, dtype=x.dtype).masked_fill(~visible, torch.finfo(x.dtype).min)[None, None]
    layer = case.hf.model.layers[layer_idx]
    if x.dtype != torch.float32:
        layer = copy.deepcopy(layer).to(x.dtype)
    with torch.no_grad():
        out = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
    return out[0]  # fmt: skip


def _run_paged(
    step: Any,
    num_layers: int,
    inputs: torch.Tensor,
    backend: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
) -> torch.Tensor:
    """Feed `inputs` (num_tokens, ...) through step(inputs chunk, positions, cache, meta) as one prefill
    of PREFILL rows then single-row decodes; the outputs stacked back in order."""
    kv_cache = PagedKVCache(num_layers, NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu")
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    outs, start = [], 0
    for end in [PREFILL, *range(PREFILL + 1, inputs.shape[0] + 1)]:
        meta = build_attention_metadata([table], [end], [end - start], BLOCK, "cpu", backend=backend)
        with torch.inference_mode():
            outs.append(step(inputs[start:end].clone(), torch.arange(start, end), kv_cache, meta))
        start = end
    return torch.cat(outs)


def _layer_step(case: Case, layer_idx: int, ours: GemmaDecoderLayer, swap_tables: bool = False) -> Any:
    """Layer `layer_idx` as a step: our layer's output h + residual (what the next layer's norm adds
    first). `swap_tables`: each layer type rotates with the other type's table (a wiring mistake)."""
    rotary = GemmaRotary(case.config, case.spec, ours.mlp.down_proj.weight.dtype, "cpu")
    if swap_tables:
        rotary.layer_table = [len(rotary.tables) - 1 - t for t in rotary.layer_table]

    def step(x: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache, meta: Any) -> torch.Tensor:
        cos, sin = rotary(positions)[layer_idx]
        h, residual = ours(x, None, cos, sin, kv_cache, 0, meta)
        return h + residual

    return step


def _ours_layer(
    case: Case, layer_idx: int, use_native: bool, dtype: torch.dtype = torch.float32
) -> GemmaDecoderLayer:
    ours = GemmaDecoderLayer(case.config, case.spec, layer_idx, dtype, "cpu", _ops(use_native))
    # from the checkpoint's tensors in the model dtype, as a low-precision checkpoint holds them
    _load_layer(ours, copy.deepcopy(case.hf.model.layers[layer_idx]).to(dtype))
    return ours


def _ops(use_native: bool) -> LayerOps:
    """What a fast-path model's layers are built on (float32 CPU): the native add + norm, and RoPE +
    q/k norm + cache store passes (GemmaMLP, gelu, asks for no fused op); else the reference ops."""
    ops = layer_ops("cpu", torch.float32, "fast" if use_native else "reference")
    assert (ops.name == "native") == use_native
    return ops


def _layer_input(seed: int = 5) -> torch.Tensor:
    return torch.randn(PREFILL + DECODE, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max().detach())


NATIVE = [False, True] if native.load() is not None else [False]


@pytest.mark.parametrize("use_native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("backend", ["reference", "paged"])
@pytest.mark.parametrize("layer_idx", [0, 1], ids=[SLIDING, GLOBAL])
def test_layer_matches_transformers(case: Case, layer_idx: int, backend: str, use_native: bool) -> None:
    x = _layer_input()
    want = _hf_layer_out(case, layer_idx, x)
    ours = _ours_layer(case, layer_idx, use_native)
    got = _run_paged(_layer_step(case, layer_idx, ours), 1, x, backend)
    diff = _max_diff(got, want)
    assert diff <= LAYER_ATOL, f"max abs diff {diff:.2e}"
    assert float(want.abs().max()) > 1.0  # the tolerance is against outputs of this size


@pytest.mark.parametrize("layer_idx", [0, 1], ids=[SLIDING, GLOBAL])
def test_bf16_layer_rounds_like_transformers(case: Case, layer_idx: int) -> None:
    """bfloat16 weights, activations and cache: our layer is as close to the float32 answer as
    transformers' own bfloat16 layer is, and within a few bfloat16 steps of it (BF16_ATOL)."""
    x = _layer_input()
    exact = _hf_layer_out(case, layer_idx, x)
    theirs = _hf_layer_out(case, layer_idx, x.to(torch.bfloat16)).float()
    ours = _ours_layer(case, layer_idx, use_native=False, dtype=torch.bfloat16)
    got = _run_paged(
        _layer_step(case, layer_idx, ours), 1, x.to(torch.bfloat16), "paged", torch.bfloat16
    ).float()
    assert _max_diff(got, theirs) <= BF16_ATOL
    assert _max_diff(got, exact) <= 2 * _max_diff(theirs, exact)


KNOBS = {
    "no sliding window": lambda layer: setattr(layer.self_attn, "sliding_window", None),
    "no attention soft-cap": lambda layer: setattr(layer.self_attn, "logit_softcap", None),
    "head_dim scale": lambda layer: setattr(layer.self_attn, "scale", HEAD_DIM**-0.5),
    "norm without + 1": lambda layer: layer.post_feedforward_layernorm.weight.sub_(1.0),
    "silu MLP": lambda layer: setattr(layer.mlp, "forward", types.MethodType(MLP.forward, layer.mlp)),
}


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_every_knob_is_needed(case: Case, knob: str) -> None:
    """Each Gemma departure, dropped from our sliding layer, breaks the match (so the test above sees it)."""
    if knob == "no attention soft-cap" and case.family == "gemma3":
        pytest.skip("Gemma 3 has no attention soft-cap")
    x = _layer_input()
    want = _hf_layer_out(case, 0, x)
    ours = _ours_layer(case, 0, use_native=False)
    with torch.no_grad():
        KNOBS[knob](ours)
    got = _run_paged(_layer_step(case, 0, ours), 1, x, "paged")
    assert _max_diff(got, want) > 1e-2


def test_gemma3_tables_differ_by_layer_type() -> None:
    """Gemma 3's sliding and global layers rotate with different tables; Gemma 2's share one."""
    g3, g2 = Case("gemma3"), Case("gemma2")
    positions = torch.arange(PREFILL)
    (c0, s0), (c1, s1) = GemmaRotary(g3.config, g3.spec, torch.float32, "cpu")(positions)
    assert _max_diff(c0, c1) > 1e-2
    rotary2 = GemmaRotary(g2.config, g2.spec, torch.float32, "cpu")
    assert len(rotary2.tables) == 1
    # and the global table is transformers' linear-scaled one, bit for bit
    want_cos, want_sin = g3.hf.model.rotary_emb(torch.zeros(1, 1), positions[None], GLOBAL)
    assert torch.equal(c1[:, 0], want_cos[0, :, : HEAD_DIM // 2]) and torch.equal(
        s1[:, 0], want_sin[0, :, : HEAD_DIM // 2]
    )


@pytest.mark.parametrize("layer_idx", [0, 1], ids=[SLIDING, GLOBAL])
def test_gemma3_layer_needs_its_own_table(layer_idx: int) -> None:
    """The layer test above would catch a Gemma 3 layer rotating with the other type's table."""
    case = Case("gemma3")
    x = _layer_input()
    want = _hf_layer_out(case, layer_idx, x)
    ours = _ours_layer(case, layer_idx, use_native=False)
    got = _run_paged(_layer_step(case, layer_idx, ours, swap_tables=True), 1, x, "paged")
    assert _max_diff(got, want) > 1e-2


def _load_model(case: Case, use_native: bool) -> GemmaDecoderModel:
    ours = GemmaDecoderModel(case.config, case.spec, torch.float32, "cpu", _ops(use_native))
    with torch.no_grad():
        ours.embed_tokens.weight.copy_(case.hf.model.embed_tokens.weight)
        ours.norm.weight.copy_(checkpoint_norm_weight(case.hf.model.norm.weight))
    for layer, hf_layer in zip(ours.layers, case.hf.model.layers, strict=True):
        assert isinstance(layer, GemmaDecoderLayer)
        _load_layer(layer, hf_layer)
    return ours


@pytest.mark.parametrize("use_native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_model_logits_match_transformers(case: Case, backend: str, use_native: bool) -> None:
    """Embedding scale, both layers, final norm, tied logits and the final soft-cap, end to end."""
    ours = _load_model(case, use_native)
    tokens = torch.randint(0, VOCAB, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(3))
    cap = case.spec.final_logit_softcapping

    rotary = GemmaRotary(case.config, case.spec, torch.float32, "cpu")

    def step(ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache, meta: Any) -> torch.Tensor:
        hidden = ours(ids, rotary(positions), kv_cache, meta)
        return soft_cap(torch.nn.functional.linear(hidden, ours.embed_tokens.weight).float(), cap)

    got = _run_paged(step, 2, tokens, backend)
    with torch.no_grad():
        want = case.hf(tokens[None], use_cache=False).logits[0]
    diff = _max_diff(got, want)
    assert diff <= LOGITS_ATOL, f"max abs diff {diff:.2e}"
    assert cap is not None and float(want.abs().max()) > 0.9 * cap  # the cap bites


def test_soft_cap_is_transformers_formula() -> None:
    logits = torch.linspace(-100, 100, 41)
    assert torch.equal(soft_cap(logits, 30.0), torch.tanh(logits / 30.0) * 30.0)
    assert soft_cap(logits, None) is logits
    assert float(soft_cap(logits, 30.0).abs().max()) < 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scale_rounds_like_transformers(dtype: torch.dtype) -> None:
    """sqrt(3072) = 55.4256 is 55.5 in bfloat16; transformers multiplies by the rounded factor."""
    hidden = 3072
    hf = Gemma2TextScaledWordEmbedding(16, hidden, 0, embed_scale=hidden**0.5).to(dtype)
    torch.nn.init.normal_(hf.weight, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([1, 5, 9, 15])
    ours = torch.nn.functional.embedding(ids, hf.weight) * embed_scale(hidden, dtype)
    with torch.no_grad():
        assert torch.equal(ours, hf(ids))
    if dtype == torch.bfloat16:
        assert embed_scale(hidden, dtype) == 55.5


def test_bf16_norm_scales_in_float32_before_casting() -> None:
    """Low precision: x normalised and scaled by the float32 1 + w, one cast at the end, as Gemma2RMSNorm
    does. Llama's order (cast, then scale by a bfloat16 weight) rounds twice and differs from
    transformers in about a third of the elements here; this order matches it bit for bit."""
    gen = torch.Generator().manual_seed(6)
    hf = Gemma2RMSNorm(64, eps=1e-6)
    ours = GemmaRMSNorm(64, 1e-6, "cpu")
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(64, generator=gen))
        hf = hf.to(torch.bfloat16)  # the checkpoint's w in bfloat16, as a bf16 model holds it
        ours.weight.copy_(checkpoint_norm_weight(hf.weight))
        x = (3 * torch.randn(64, 64, generator=gen)).to(torch.bfloat16)
        got, want = ours(x).float(), hf(x).float()
    assert ours(x).dtype == torch.bfloat16 and ours.weight.dtype == torch.float32
    # F.rms_norm and transformers' x * rsqrt(mean(x^2) + eps) may differ in the last float32 bit,
    # which can flip a rare bfloat16 rounding: allow 1% of elements one bfloat16 step (2**-7) apart.
    assert float((got != want).float().mean()) <= 0.01
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


def test_model_builds_on_meta_without_buffers() -> None:
    """DecoderLM builds its modules on "meta" and materialises only parameters: GemmaDecoderModel must
    hold nothing else (the RoPE tables are GemmaRotary's, built by the caller on the real device)."""
    case = Case("gemma3")
    model = GemmaDecoderModel(case.config, case.spec, torch.bfloat16, "meta")
    assert not list(model.buffers())
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert len(norms) == 2 * 6 + 1  # 4 per layer, q/k norms, the final norm
    assert all(p.dtype == torch.float32 for p in norms)  # the folded 1 + w stays float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- the whole model, as a user loads it
# model_config_from_hf on transformers' own config dict, DecoderLM, load_weights (folding the
# norms' + 1) and the engine's paged cache; tolerance: test_model_numerics' ATOL on logits.

_TINY: dict[str, Any] = dict(
    vocab_size=NUMERICS_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=4, max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=24,
    attn_implementation="eager",
)  # fmt: skip
WHOLE = {
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        layer_types=[SLIDING, GLOBAL, SLIDING, GLOBAL], final_logit_softcapping=3.0,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         GLOBAL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(WHOLE))
def whole(request: pytest.FixtureRequest) -> tuple[Any, DecoderLM]:
    config_cls, model_cls, extra = WHOLE[request.param]
    return hf_and_ours(config_cls(**_TINY, **extra), model_cls, weight_scale=0.15)  # type: ignore[no-any-return]


def test_the_whole_model_loads_from_its_config_and_matches_transformers(whole: tuple[Any, DecoderLM]) -> None:
    """Prefill past the window, greedy decode through the paged cache, then a prefix-cache hit."""
    hf, ours = whole
    assert ours.config.gemma is not None and ours.native_step is None
    harness = Harness(ours)
    seq = Seq(prompt(21, seed=3))
    (logits,) = harness.step([(seq, len(seq.tokens))])
    assert_close(logits, hf_logits(hf, seq.tokens))
    steps = []
    for _ in range(6):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    ref = hf_logits(hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[21 + i])
    shared = 20  # whole blocks: a second sequence reuses the first's blocks as they are
    other = Seq(seq.tokens[:shared] + prompt(5, seed=4), num_cached=shared)
    other.block_table = seq.block_table[: shared // 4]
    (logits,) = harness.step([(other, len(other.tokens) - shared)])
    assert_close(logits, hf_logits(hf, other.tokens)[shared:])


def test_gemma_configs_as_their_files_write_them() -> None:
    """Defaults where a config.json leaves keys out (Gemma 2: every other layer slides, caps 50 / 30;
    Gemma 3: five sliding layers to one global, no caps, two RoPE bases), and the refusals."""
    from onecall.errors import UnsupportedModelError

    g2 = model_config_from_hf(
        {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    )  # fmt: skip
    assert g2.gemma is not None and g2.head_dim == 256 and g2.tie_word_embeddings
    assert g2.gemma.layer_types == (SLIDING, GLOBAL, SLIDING, GLOBAL)
    assert (g2.gemma.attn_logit_softcapping, g2.gemma.final_logit_softcapping) == (50.0, 30.0)
    g3 = model_config_from_hf(
        {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 16, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None}
    )  # fmt: skip
    assert g3.gemma is not None and g3.qk_norm and g3.rope_theta == 1e6
    assert g3.gemma.layer_types == (SLIDING,) * 5 + (GLOBAL, SLIDING)
    assert g3.gemma.attn_logit_softcapping is None and g3.gemma.final_logit_softcapping is None
    assert g3.gemma.rope_local_base_freq == 10000.0 and g3.rope_scaling is not None
    assert ModelConfig(**g3.to_dict()) == g3  # the nested GemmaSpec survives a dict round trip
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu'"):
        model_config_from_hf(
            {**g3.to_dict(), "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "silu"}
        )


def test_the_fast_kernels_run_gemma(whole: tuple[Any, DecoderLM]) -> None:
    """oneDNN projections and the native norm / RoPE / attention passes (no one-call step: Gemma's
    layer is not Llama's): the reference model's logits to float32 summation order."""
    from onecall.loading.packing import enable_fast_kernels
    from tests.helpers.make_models import fast_copy

    _, ours = whole
    fast = fast_copy(ours)
    enable_fast_kernels(fast)
    assert "onednn" in fast.kernels and fast.native_step is None
    seq, ref_seq = Seq(prompt(21, seed=5)), Seq(prompt(21, seed=5))
    (got,) = Harness(fast).step([(seq, 21)])
    (want,) = Harness(ours).step([(ref_seq, 21)])
    assert_close(got, want)


@pytest.mark.parametrize(
    ("architecture", "needle"),
    [("Gemma3ForConditionalGeneration", "no text_config"), ("GemmaForCausalLM", "Gemma 1"),
     ("Gemma3nForConditionalGeneration", "Gemma 3n")],
)  # fmt: skip
def test_gemma_checkpoints_we_do_not_run_are_named(architecture: str, needle: str) -> None:
    from onecall.errors import UnsupportedModelError

    config = {"architectures": [architecture], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=f"{architecture}.*{needle}"):
        model_config_from_hf(config)
