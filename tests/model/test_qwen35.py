"""The hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; model/qwen35.py) against transformers, on CPU.

Tiny random-weight models are built with transformers' own classes (tests/helpers/make_models.py's
tiny_hybrid_hf: eager attention, its torch-only delta rule and conv, as it runs without
flash-linear-attention), their state dicts loaded into our DecoderLM, and every logit we produce through
the paged KV cache and the LinearStateCache (prefill, decode steps, chunked prefill, mixed batches) is
compared with transformers' full forward over the same tokens. The layer mix makes every cache index
count: a model's second full-attention layer is the paged cache's layer 1, its third linear layer the
state cache's layer 2; the linear heads are grouped (2 key heads for 4 value heads) and the value head
size differs from the key's.

The oracle is transformers in float64. Random weights make some DeltaNet heads' outputs the small
remainder of a cancellation, which the gated RMSNorm then scales to unit size: there float32 rounding
(ours and transformers' alike) shows at ~1e-4 on logits of ~10. So a comparison passes within ATOL of
the float64 logits, or within AS_TRANSFORMERS times transformers' own float32 error on the same tokens.

Measured (torch 2.13, transformers 5.25, this machine), tolerance in brackets:
- the delta rule, chunked vs recurrent: <= 8e-6 (decays down to -30 a token); each vs transformers'
  torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule: <= 2e-7; outputs ~1 (ATOL_RULE 5e-5);
- logits vs transformers' float64 ones, every test: <= 2.3e-4, where transformers' float32 model is off
  by up to 2.3e-4 too; ours / theirs <= 1.8 (ATOL 2e-4, or AS_TRANSFORMERS 3x theirs);
- a prompt in 3 uneven chunks vs in one go: <= 3.2e-5 (24 tokens), <= 3.3e-4 (150 tokens across the
  rule's 64-token chunks); a mixed flat batch vs each sequence alone: <= 4.4e-5; the fast CPU kernels
  vs the reference path: <= 8.7e-5 (ATOL_SELF 1e-3);
- bfloat16: our mean error against the float64 logits over transformers' bfloat16 one: <= 1.21
  (BF16_AS_TRANSFORMERS 1.5);
- each detail done the other plausible way (the gated norm folded, a constant output gate, key heads
  tiled, the conv state dropped between chunks): >= 3.5 (must exceed 100 * ATOL).
Every state slot starts as NaN: a sequence that starts at position 0 must never read its slot.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.kernels.ops import REFERENCE_OPS
from onecall.loading.packing import enable_fast_kernels
from onecall.loading.weights import load_weights
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.config import GLOBAL, LINEAR
from onecall.model.decoder import DecoderLM
from onecall.model.delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_step_,
    prepare_qk,
    recurrent_gated_delta_rule,
)
from onecall.model.kv_cache import PagedKVCache
from onecall.model.moe import SparseMoE
from onecall.model.qwen35 import CausalConv1d, GatedAttention, GatedDeltaNet
from onecall.model.state_cache import LinearStateCache
from tests.helpers.make_models import HYBRID_FAMILIES, fast_copy, tiny_hybrid_hf

ATOL_RULE = 5e-5  # the delta rule's two forms and transformers' (outputs ~1, states ~2)
ATOL = 2e-4  # our float32 logits vs transformers' float64 ones (logits up to ~10) ...
AS_TRANSFORMERS = 3.0  # ... or within 3x transformers' own float32 error there, where that is larger
BF16_AS_TRANSFORMERS = 1.5  # bfloat16: our mean error vs the exact logits, over transformers' bfloat16 one
ATOL_SELF = 1e-3  # our logits vs our own, another split of the same tokens or another batch
BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_SLOTS = 5
VOCAB = 160

# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass
class Models:
    name: str
    hf: Any  # float32
    hf64: Any  # the same weights in float64: the oracle
    ours: DecoderLM


def float64_copy(hf: Any) -> Any:
    """transformers' model in float64 (its experts on the eager loop: the grouped matmul is float32-only)."""
    hf64 = copy.deepcopy(hf).double()
    hf64.config._experts_implementation = "eager"
    return hf64


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def models(request: pytest.FixtureRequest) -> Models:
    hf = tiny_hybrid_hf(request.param)
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()))
    load_weights(ours, hf.state_dict().items())
    return Models(request.param, hf, float64_copy(hf), ours)


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab) logits of transformers' full forward, no cache, in the model's dtype."""
    with torch.no_grad():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Seq:
    tokens: list[int]
    slot: int  # its LinearStateCache slot
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)


class Harness:
    """A stand-in for the engine: scrambled KV blocks, a PagedKVCache for the full-attention layers only
    (ModelConfig.num_kv_layers), a LinearStateCache (ModelConfig.linear_state_shape) whose slots start as
    NaN, and each step's state_slots."""

    def __init__(self, model: DecoderLM, seed: int = 1, dtype: torch.dtype = torch.float32) -> None:
        c = model.config
        shape = c.linear_state_shape
        assert shape is not None
        self.model = model
        self.kv_cache = PagedKVCache(
            c.num_kv_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype, "cpu"
        )
        self.kv_cache.state = LinearStateCache(shape, NUM_SLOTS, dtype, "cpu")
        self.kv_cache.state.conv.fill_(math.nan)
        self.kv_cache.state.recurrent.fill_(math.nan)
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()

    def step(self, batch: list[tuple[Seq, int]], decode_first: bool = True) -> list[torch.Tensor]:
        """`num_new` uncached tokens of each sequence in one flat forward, decode rows (one token) first
        as the engine packs them (unless not `decode_first`); per-sequence logits, in the order given."""
        order = sorted(range(len(batch)), key=lambda i: batch[i][1] != 1 if decode_first else 0)
        packed = [batch[i] for i in order]
        ids: list[int] = []
        positions: list[int] = []
        for seq, num_new in packed:
            end = seq.num_cached + num_new
            while len(seq.block_table) * BLOCK_SIZE < end:
                seq.block_table.append(self.free.pop())
            ids += seq.tokens[seq.num_cached : end]
            positions += range(seq.num_cached, end)
        meta = build_attention_metadata(
            [s.block_table for s, _ in packed],
            [s.num_cached + n for s, n in packed],
            [n for _, n in packed],
            BLOCK_SIZE,
            "cpu",
            num_decode=next((i for i, (_, n) in enumerate(packed) if n != 1), len(packed)),
            state_slots=[s.slot for s, _ in packed],
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
        for seq, num_new in packed:
            seq.num_cached += num_new
        out = list(logits.split([n for _, n in packed]))
        return [out[order.index(i)] for i in range(len(batch))]


def run_alone(
    model: DecoderLM,
    seq_tokens: list[int],
    chunks: list[int],
    slot: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Every position's logits of one sequence fed in `chunks` (a chunk of 1 is a decode row)."""
    harness = Harness(model, dtype=dtype)
    seq = Seq(seq_tokens, slot)
    return torch.cat([harness.step([(seq, n)])[0] for n in chunks])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_matches_transformers(got: torch.Tensor, models: Models, seq_tokens: list[int]) -> None:
    """Our float32 logits for `seq_tokens` against transformers' float64 forward: within ATOL, or within
    AS_TRANSFORMERS times transformers' own float32 error where the model is ill-conditioned there."""
    want = hf_logits(models.hf64, seq_tokens)
    ours, theirs = max_diff(got, want), max_diff(hf_logits(models.hf, seq_tokens), want)
    assert ours <= max(ATOL, AS_TRANSFORMERS * theirs), f"ours {ours:.2e}, transformers' float32 {theirs:.2e}"


# ---------------------------------------------------------------- (1) the delta rule


@pytest.mark.parametrize(("tokens_", "chunk"), [(150, 64), (37, 16), (5, 64)])
def test_delta_rule_forms_agree_and_match_transformers(tokens_: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(tokens_)
    batch, k_heads, v_heads, k_dim, v_dim = 2, 2, 4, 8, 12
    q = torch.randn(batch, tokens_, k_heads, k_dim, generator=gen)
    k = torch.randn(batch, tokens_, k_heads, k_dim, generator=gen)
    v = torch.randn(batch, tokens_, v_heads, v_dim, generator=gen)
    # decays from none to total (-30 a token: exp underflows), step sizes across (0, 1)
    g = -(torch.rand(batch, tokens_, v_heads, generator=gen) ** 4) * 30
    beta = torch.rand(batch, tokens_, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    qp, kp = prepare_qk(q, k, v_heads)
    out_c, state_c = chunked_gated_delta_rule(qp, kp, v, g, beta, state, chunk_size=chunk)
    out_r, state_r = recurrent_gated_delta_rule(qp, kp, v, g, beta, state)
    hf_c, hf_state_c = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    hf_r, hf_state_r = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.isfinite(out_c).all() and torch.isfinite(state_c).all()
    assert max_diff(out_c, out_r) <= ATOL_RULE and max_diff(state_c, state_r) <= ATOL_RULE
    assert max_diff(out_c, hf_c) <= ATOL_RULE and max_diff(state_c, hf_state_c) <= ATOL_RULE
    assert max_diff(out_r, hf_r) <= ATOL_RULE and max_diff(state_r, hf_state_r) <= ATOL_RULE


def test_delta_rule_split_anywhere_carries_its_state() -> None:
    """Two pieces, the second from the first's state, equal one run (what chunked prefill relies on)."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 90, 4, 8, generator=gen), torch.randn(1, 90, 4, 8, generator=gen)
    v, g = torch.randn(1, 90, 4, 12, generator=gen), -torch.rand(1, 90, 4, generator=gen)
    beta = torch.rand(1, 90, 4, generator=gen)
    q, k = prepare_qk(q, k, 4)
    zero = torch.zeros(1, 4, 8, 12)
    whole, end = chunked_gated_delta_rule(q, k, v, g, beta, zero)
    first, mid = chunked_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], zero)
    second, end2 = recurrent_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    assert max_diff(torch.cat((first, second), dim=1), whole) <= ATOL_RULE
    assert max_diff(end2, end) <= ATOL_RULE


def test_in_place_decode_step_is_the_recurrence() -> None:
    """gated_delta_step_ (decode's in-place form) equals recurrent_gated_delta_rule token by token,
    outputs and state, from a random state through 5 steps."""
    gen = torch.Generator().manual_seed(4)
    q, k = prepare_qk(torch.randn(3, 5, 2, 8, generator=gen), torch.randn(3, 5, 2, 8, generator=gen), 4)
    v, g = torch.randn(3, 5, 4, 12, generator=gen), -torch.rand(3, 5, 4, generator=gen) * 3
    beta = torch.rand(3, 5, 4, generator=gen)
    state = torch.randn(3, 4, 8, 12, generator=gen)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    s = state.clone()
    got = torch.stack(
        [gated_delta_step_(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s) for t in range(5)], 1
    )
    assert max_diff(got, want) <= ATOL_RULE and max_diff(s, want_state) <= ATOL_RULE


# ---------------------------------------------------------------- (2)-(4) the whole model


def test_structure_and_caches(models: Models) -> None:
    """Which layers are which, and the cache shapes the engine allocates from the config."""
    c = models.ours.config
    assert c.num_kv_layers == 2
    shape = c.linear_state_shape
    assert shape is not None and shape.num_layers == 3
    assert (shape.conv_dim, shape.conv_width) == (2 * 2 * 8 + 4 * 12, 3)
    assert (shape.num_v_heads, shape.k_head_dim, shape.v_head_dim) == (4, 8, 12)
    layers = list(models.ours.model.layers)
    assert [layer.is_linear for layer in layers] == [True, True, False, True, False]
    assert [layer.cache_index for layer in layers] == [0, 1, 0, 2, 1]
    assert isinstance(layers[2].self_attn, GatedAttention) and isinstance(
        layers[0].linear_attn, GatedDeltaNet
    )
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    assert (
        sparse
        == {"qwen3_5": [False] * 5, "qwen3_5_moe": [True] * 5, "qwen3_next": [True, False, True, True, True]}[
            models.name
        ]
    )
    assert (models.ours.lm_head is None) == (models.name == "qwen3_5")
    # the parameter count agrees with transformers' (ours holds the same tensors, fused)
    assert c.num_parameters == sum(p.numel() for p in models.hf.parameters())


def test_prefill_then_decode_match_transformers(models: Models) -> None:
    prompt, decoded = tokens(23, seed=5), tokens(6, seed=6)
    got = run_alone(models.ours, prompt + decoded, [len(prompt)] + [1] * len(decoded), slot=3)
    assert_matches_transformers(got, models, prompt + decoded)


def test_chunked_prefill_equals_one_chunk(models: Models) -> None:
    """Three uneven chunks (the middle one shorter than the conv's kernel - 1: its state takes earlier
    inputs from the slot), then decode; and a long prompt whose chunks cross the rule's 64-token chunks."""
    seq = tokens(24, seed=7)
    one = run_alone(models.ours, seq, [20, 1, 1, 1, 1])
    three = run_alone(models.ours, seq, [9, 2, 9, 1, 1, 1, 1])
    assert max_diff(three, one) <= ATOL_SELF
    long = tokens(150, seed=8)
    whole = run_alone(models.ours, long, [150])
    split = run_alone(models.ours, long, [65, 2, 83])
    assert max_diff(split, whole) <= ATOL_SELF
    assert_matches_transformers(split, models, long)


def test_mixed_flat_batch_equals_each_alone(models: Models) -> None:
    """Two sequences of different lengths in one flat batch, prompt chunks and decode rows mixed (decode
    rows first, batched together when both decode), each in its own slot."""
    a_tokens, b_tokens = tokens(17, seed=9), tokens(26, seed=10)
    harness = Harness(models.ours)
    a, b = Seq(a_tokens, slot=4), Seq(b_tokens, slot=1)
    steps = [[(a, 12), (b, 7)], [(a, 1), (b, 14)], [(a, 1), (b, 1)], [(b, 1), (a, 1)], [(b, 3), (a, 1)]]
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []
    for i, step in enumerate(steps):  # the last step keeps the prompt chunk before the decode row
        for (seq, _), logits in zip(step, harness.step(step, decode_first=i < 4), strict=True):
            (got_a if seq is a else got_b).append(logits)
    alone_a = run_alone(models.ours, a_tokens, [12, 1, 1, 1, 1], slot=0)
    alone_b = run_alone(models.ours, b_tokens, [7, 14, 1, 1, 3], slot=0)
    assert max_diff(torch.cat(got_a), alone_a) <= ATOL_SELF
    assert max_diff(torch.cat(got_b), alone_b) <= ATOL_SELF
    assert_matches_transformers(torch.cat(got_a), models, a_tokens[:16])
    assert_matches_transformers(torch.cat(got_b), models, b_tokens)


def test_a_sequence_restarting_in_a_used_slot_starts_from_zero(models: Models) -> None:
    """A slot another sequence used: a new sequence there (position 0, as a prompt or as one token)
    ignores what it holds."""
    harness = Harness(models.ours)
    first = Seq(tokens(10, seed=11), slot=2)
    harness.step([(first, 10)])
    for chunks in ([6], [1, 5]):
        again = Seq(tokens(6, seed=12), slot=2)
        got = torch.cat([harness.step([(again, n)])[0] for n in chunks])
        assert_matches_transformers(got, models, again.tokens)


def test_fast_kernels_equal_the_reference(models: Models) -> None:
    """The CPU fast path (the native fused add+RMSNorm, q/k norm + RoPE + K/V write, silu*up; every
    projection packed, the hybrid ones included) gives the reference path's logits."""
    fast = fast_copy(models.ours)
    if fast.ops is REFERENCE_OPS:
        pytest.skip("no native kernels on this machine")
    assert enable_fast_kernels(fast) != "reference"
    seq, chunks = tokens(30, seed=14), [20, 1, 1, 1, 1, 3, 1, 1, 1]
    assert max_diff(run_alone(fast, seq, chunks), run_alone(models.ours, seq, chunks)) <= ATOL_SELF


def _tiled_prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = prepare_qk(q, k, k.shape[-2])
    ratio = num_v_heads // k.shape[-2]
    return q.repeat(*[1] * (q.dim() - 2), ratio, 1), k.repeat(*[1] * (k.dim() - 2), ratio, 1)


KNOBS = {
    "gated norm folded like the others (1 + w)": lambda m, mp: [
        layer.linear_attn.norm.weight.add_(1.0) for layer in m.model.layers if layer.linear_attn is not None
    ],
    "output gate a constant (zero gate weights: sigmoid 0.5)": lambda m, mp: [
        layer.self_attn.gate_proj.weight.zero_() for layer in m.model.layers if layer.self_attn is not None
    ],
    "key heads tiled, not repeated per value head": lambda m, mp: mp.setattr(
        "onecall.model.qwen35.prepare_qk", _tiled_prepare_qk
    ),
    "conv state dropped between chunks": lambda m, mp: mp.setattr(
        CausalConv1d, "chunk", lambda self, x, before: _conv_chunk(self, x, torch.zeros_like(before))
    ),
}
_conv_chunk = CausalConv1d.chunk


@pytest.mark.parametrize("models", ["qwen3_5"], indirect=True)
@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_every_detail_is_needed(models: Models, knob: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each detail, done the other plausible way, breaks the match with transformers by far more than
    the tolerance (so the tests above would see it)."""
    ours = copy.deepcopy(models.ours)
    with torch.no_grad():
        KNOBS[knob](ours, monkeypatch)
    seq = tokens(20, seed=15)
    got = run_alone(ours, seq, [9, 2, 9])
    assert max_diff(got, hf_logits(models.hf64, seq)) > 100 * ATOL


def test_bfloat16_rounds_like_transformers(models: Models) -> None:
    """bfloat16 weights, activations, KV and conv states (the recurrent state stays float32): our logits
    are as close to the exact (float64) ones as transformers' bfloat16 model's are, on average (the
    largest errors are routing flips in the MoE models, either way)."""
    hf16 = copy.deepcopy(models.hf).to(torch.bfloat16)
    ours = DecoderLM(models.ours.config, dtype=torch.bfloat16)
    load_weights(ours, ((n, p.to(torch.bfloat16)) for n, p in models.hf.state_dict().items()))
    seq = tokens(40, seed=16)
    got = run_alone(ours, seq, [30] + [1] * 10, dtype=torch.bfloat16)
    exact = hf_logits(models.hf64, seq)
    ours_err = (got.double() - exact).abs().mean().item()
    theirs_err = (hf_logits(hf16, seq).double() - exact).abs().mean().item()
    assert ours_err <= BF16_AS_TRANSFORMERS * theirs_err, (
        f"ours {ours_err:.4f}, transformers' {theirs_err:.4f}"
    )


# ---------------------------------------------------------------- (5) loading


def _tiny_multimodal() -> Qwen3_5ForConditionalGeneration:
    """tiny_hybrid_hf("qwen3_5")'s language model beside a 1-block vision tower, tied by the top level."""
    text = {
        k: v
        for k, v in tiny_hybrid_hf("qwen3_5").config.to_dict().items()
        if k in Qwen3_5TextConfig.__annotations__
    }
    text["tie_word_embeddings"] = False  # the text part says untied; the top level's true wins
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
    )  # fmt: skip
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=VOCAB - 4, video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 0.0)
            elif not name.endswith("bias"):
                p.copy_(0.15 * torch.randn_like(p))
    return model


def test_multimodal_checkpoint_loads_its_language_model() -> None:
    """Qwen3_5ForConditionalGeneration (every released Qwen3.5): the config's text_config with the top
    level's tie_word_embeddings (the text part says false, transformers ties by the top level), tensors
    under model.language_model.*, the vision tower (model.visual.*) and an MTP head (mtp.*) skipped."""
    hf = _tiny_multimodal()
    assert hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    config = model_config_from_hf(hf.config.to_dict())
    assert config.architecture == "qwen3_5" and config.tie_word_embeddings
    ours = DecoderLM(config)
    state = dict(hf.state_dict())
    assert any(n.startswith("model.visual.") for n in state)
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    load_weights(ours, state.items())
    prompt = tokens(19, seed=13)
    with torch.no_grad():
        want = float64_copy(hf)(torch.tensor([prompt])).logits[0]
    got = run_alone(ours, prompt, [11, 1, 1, 1, 1, 1, 1, 1, 1])
    assert max_diff(got, want) <= ATOL
    state["model.language_model.layers.0.linear_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedModelError, match="bogus"):
        load_weights(DecoderLM(config), state.items())


def test_config_translation() -> None:
    """config.json dicts: the text-only model_types, layer_types derived from full_attention_interval,
    transformers' partial rotary default (0.25), and what we refuse by name."""
    base: dict[str, Any] = {
        "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    }  # fmt: skip
    config = model_config_from_hf(base)
    spec = config.linear_attention
    assert spec is not None and spec.layer_types == (LINEAR, LINEAR, LINEAR, GLOBAL) * 2
    assert (
        config.rotary_dim == 4
        and config.attn_output_gate
        and config.qk_norm
        and not config.tie_word_embeddings
    )
    assert config.num_kv_layers == 2 and config.linear_state_shape is not None
    assert model_config_from_hf({**base, "full_attention_interval": 2}).num_kv_layers == 4
    # the real checkpoints' RoPE keys: mrope sections (plain RoPE for text), theta and the partial factor
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}  # fmt: skip
    config = model_config_from_hf({**base, "rope_parameters": rope})
    assert config.rope_theta == 1e7 and config.rope_scaling is None and config.rotary_dim == 4
    moe = model_config_from_hf({**base, "model_type": "qwen3_5_moe_text", "intermediate_size": None})
    assert moe.moe is not None and moe.moe.shared_expert_intermediate_size == 512 and moe.moe.norm_topk_prob
    nxt = model_config_from_hf({**base, "model_type": "qwen3_next", "mlp_only_layers": [0]})
    assert nxt.moe is not None and nxt.moe.sparse_layers[:2] == (False, True) and nxt.moe.num_experts == 512
    for bad, match in (
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 4}, "sliding_attention"),
        ({"layer_types": ["linear_attention"] * 8}, "full_attention"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ):
        with pytest.raises(UnsupportedModelError, match=match):
            model_config_from_hf({**base, **bad})
    with pytest.raises(UnsupportedModelError, match="tensor parallel"):
        DecoderLM(model_config_from_hf(base), tp=_FakeTP())


class _FakeTP:
    world_size = 2


def test_attention_probabilities_are_refused_by_name_for_a_hybrid(models: Models) -> None:
    """LLM.attention_probs' probe runs Llama-shaped layers only: a hybrid's linear layers are refused
    with a typed error naming them, not an assert."""
    from onecall.errors import UnsupportedModelError
    from onecall.model.attention_probe import last_position_attention

    with pytest.raises(UnsupportedModelError, match="HybridDecoderLayer"):
        last_position_attention(models.ours, torch.tensor(tokens(5, seed=1)))
