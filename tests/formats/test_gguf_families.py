"""Phi-3, Gemma 2, Gemma 3, Qwen3-MoE and Mixtral from GGUF files laid out as llama.cpp's converter
writes them (tests/helpers/make_models.write_converted_gguf: gguf-py's own name table, Q/K permuted for
Mixtral, Gemma's norms stored as 1 + w, stacked experts, Phi-3's fused qkv / gate_up and longrope
factor tensors), loaded through onecall as the engine loads them (resolve_model -> config -> DecoderLM
-> load_weights(iter_weights)).

Each family is a tiny random transformers model (float32, eager attention), saved as a Hugging Face
folder and converted. Checks:
  1. the GGUF's config and every loaded parameter equal the folder's, bit for bit (F32 file);
  2. against transformers (tests/test_model_numerics' ATOL, 1e-4 on logits): prefill, greedy decode
     through the paged cache (each greedy token transformers' argmax too), a prefix-cache hit;
  3. Q8_0 and Q4_0 files (every weight of 2+ dimensions, experts included; norms and router F32)
     against transformers running the same dequantized weights (gguf.quants' round trip): the reference
     kernels within ATOL, and the engine's fast path (pack_on_load), whose rows run the file's own
     groups where a native kernel takes them, experts included (FAST_ATOL);
  4. LLM(model=file.gguf) end to end: greedy tokens equal transformers';
  5. the metadata rules llama.cpp applies where the converter writes no key, other expert layouts
     (per-expert tensors, fused gate_up), and the refusals, each naming what it refuses.
The configs are what a GGUF can say: llama.cpp fixes Gemma's query_pre_attn_scalar to head_dim (27B
aside), Gemma 3's layer pattern to 5 sliding : 1 global, and always renormalises Qwen3-MoE's top-k,
so the transformers models here are built that way (test_gguf_config_rules checks the rules).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import StoredGroups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.experts import NativeExperts
from onecall.kernels.cpu.fast_linear import FastLinear
from onecall.loading.weights import load_weights
from onecall.model.config import GLOBAL, SLIDING, ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.moe import Experts
from tests.helpers.make_models import write_converted_gguf, write_tiny_hf_folder
from tests.model.test_model_numerics import VOCAB, Harness, Seq, assert_close, hf_logits, prompt

Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
_TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, attn_implementation="eager",
)  # fmt: skip
_GEMMA: dict[str, Any] = dict(head_dim=16, intermediate_size=128, sliding_window=8, query_pre_attn_scalar=16)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # longrope past a 16-token original context (long factors on both sides), 12 of 16 dims rotated,
    # every layer within an 8-token window
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(
        num_hidden_layers=2, intermediate_size=128, pad_token_id=0, eos_token_id=2, sliding_window=8,
        partial_rotary_factor=0.75, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 2.0, 4.0, 6.0, 9.0, 12.0]})),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
        num_hidden_layers=2, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **_GEMMA)),
    # six layers: llama.cpp's 5 sliding : 1 global; the global RoPE linearly scaled, the local at 1e4
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_hidden_layers=6, layer_types=[SLIDING] * 5 + [GLOBAL], final_logit_softcapping=3.0,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         GLOBAL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, **_GEMMA)),
    # every layer routed: llama.cpp's qwen3moe has no dense layers (mlp_only_layers cannot be converted)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
}  # fmt: skip

# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


def random_hf(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of `family` with every parameter random (norms 1 + 0.2 N, the rest 0.15 N)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**(_TINY | overrides), **extra)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf


def load(path: Path, stored: dict[str, StoredGroups] | None = None) -> DecoderLM:
    """What the engine does with a model path (engine/engine_parts.py), float32 on CPU."""
    files = resolve_model(path)
    model = DecoderLM(model_config_from_hf(load_hf_config_dict(files)), kernels="reference" if stored is None else "fast")
    load_weights(model, iter_weights(files, torch.float32, stored), stored)
    return model.eval()


@dataclass
class Converted:
    family: str
    hf: Any
    folder: Path
    gguf: Path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    family = request.param
    hf = random_hf(family)
    tmp = tmp_path_factory.mktemp(family)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}  # tied tensors unshared
    folder = write_tiny_hf_folder(tmp / "hf", state, hf.config.to_dict(), shards=1)
    gguf = write_converted_gguf(tmp / f"{family}.gguf", state, hf.config.to_dict())
    return Converted(family, hf, folder, gguf)


def _factors_in_float32(config: ModelConfig) -> ModelConfig:
    """A GGUF holds longrope's factors as float32 tensors (transformers computes with them in float32)."""
    rope = config.rope_scaling
    if rope is None or rope.long_factor is None or rope.short_factor is None:
        return config
    long, short = (tuple(float(np.float32(x)) for x in f) for f in (rope.long_factor, rope.short_factor))
    return dataclasses.replace(
        config, rope_scaling=dataclasses.replace(rope, long_factor=long, short_factor=short)
    )


def test_the_gguf_loads_the_folders_model(converted: Converted) -> None:
    from_folder, from_gguf = load(converted.folder), load(converted.gguf)
    assert from_gguf.config == _factors_in_float32(from_folder.config)
    folder_params = dict(from_folder.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, folder_params[name]), name  # Gemma norms: 1 + w, added once


def _check_against_transformers(model: DecoderLM, hf: Any, decode_steps: int = 4) -> None:
    """Prefill 21 tokens (past every window and Phi-3's original context), greedy decode, a prefix hit."""
    harness = Harness(model)
    seq = Seq(prompt(21, seed=5))
    (logits,) = harness.step([(seq, 21)])
    assert_close(logits, hf_logits(hf, seq.tokens))
    steps = []
    for _ in range(decode_steps):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    ref = hf_logits(hf, seq.tokens)
    assert seq.tokens[21:] == ref[20 : 20 + decode_steps].argmax(-1).tolist()  # transformers' greedy tokens
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[21 + i])
    shared = 20  # whole blocks: the second sequence reads the first's cached blocks
    other = Seq(seq.tokens[:shared] + prompt(5, seed=6), num_cached=shared)
    other.block_table = seq.block_table[: shared // 4]
    (logits,) = harness.step([(other, len(other.tokens) - shared)])
    assert_close(logits, hf_logits(hf, other.tokens)[shared:])


def test_the_gguf_matches_transformers(converted: Converted) -> None:
    _check_against_transformers(load(converted.gguf), converted.hf)


def _dequantized(state: dict[str, torch.Tensor], qtype: GGMLQuantizationType) -> dict[str, torch.Tensor]:
    """The weights a quantized conversion holds: every tensor of 2+ dimensions but the router round-
    tripped through gguf's quantizer (blocks of 32 along rows, so Q/K permutation, fused parts and
    expert stacking all commute with it)."""
    out = {}
    for name, t in state.items():
        if t.ndim >= 2 and not name.endswith(".mlp.gate.weight"):
            t = torch.from_numpy(gguf_dequantize(gguf_quantize(t.float().numpy(), qtype), qtype)).reshape(
                t.shape
            )
        out[name] = t
    return out


# The fast path against transformers: every row of a Q8_0 or Q4_0 projection (prompt rows too) and a
# Q8_0 output weight's logits run the file's own groups on the native kernels, which round
# activations to int16 steps per group of 32 in every projection of every layer (measured on a Gemma 3
# prefill, whose inputs are scaled by sqrt(hidden_size): up to 2.7e-3 for Q8_0, 1e-2 for Q4_0, whose
# coarser weights amplify it; 1e-3 to 2e-3 elsewhere; about 2x allowed). Stored groups in a wrong row
# order (Phi-3's split or partial-rotary permutation left out) are off by > 2.
FAST_ATOL = {Q8_0: 5e-3, Q4_0: 2e-2}


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_quantized_gguf_matches_transformers_on_its_weights(
    family: str, qtype: GGMLQuantizationType, tmp_path: Path
) -> None:
    hf = random_hf(family, seed=1)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    path = write_converted_gguf(tmp_path / f"{family}.gguf", state, hf.config.to_dict(), weight_type=qtype)
    hf.load_state_dict(_dequantized(state, qtype))  # transformers on exactly the file's weights
    _check_against_transformers(load(path), hf, decode_steps=2)
    # the engine's fast path: packed projections, decode rows on the file's own groups (Phi-3's fused
    # qkv / gate_up split into parts, Phi-4-style partial rotary rows permuted with them; each routed
    # expert's groups)
    stored: dict[str, StoredGroups] = {}
    fast = load(path, stored)
    projections = [m for m in fast.modules() if isinstance(m, FastLinear)]
    assert projections and all(m.has_decode_kernel for m in projections)
    assert all(m.stored is not None for m in fast.modules() if isinstance(m, Experts))  # experts too
    harness, seq = Harness(fast), Seq(prompt(21, seed=7))
    (logits,) = harness.step([(seq, 21)])  # prompt rows: the file's own groups too
    diff = (logits - hf_logits(hf, seq.tokens)).abs().max().item()
    assert diff <= FAST_ATOL[qtype], f"prefill: max abs diff {diff:.2e}"
    for _ in range(2):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])  # one row: the stored groups' kernel
        diff = (logits[-1] - hf_logits(hf, seq.tokens)[-1]).abs().max().item()
        assert diff <= FAST_ATOL[qtype], f"decode: max abs diff {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "qtype"), [("gemma3", Q8_0), ("phi3", Q4_0), ("qwen3_moe", Q4_0)])
def test_the_engine_serves_a_converted_gguf(family: str, qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    """What a user runs: LLM(model=file.gguf) on the default (fast) kernels, the file carrying the
    embedded model's tokenizer; greedy tokens from a token-id prompt equal transformers' greedy tokens on
    the file's (dequantized) weights."""
    from onecall import LLM, SamplingParams

    tokenizer = {
        k: v for k, v in GGUFFile(resolve_model(None).path).metadata.items() if k.startswith("tokenizer.")
    }
    hf = random_hf(family, seed=2, vocab_size=len(tokenizer["tokenizer.ggml.tokens"]))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    path = write_converted_gguf(
        tmp_path / f"{family}.gguf", state, hf.config.to_dict(), weight_type=qtype, extra_metadata=tokenizer
    )
    hf.load_state_dict(_dequantized(state, qtype))
    ids = torch.randint(3, hf.config.vocab_size, (21,), generator=torch.Generator().manual_seed(9)).tolist()
    want = list(ids)
    for _ in range(8):
        want.append(int(hf_logits(hf, want)[-1].argmax()))
    with LLM(model=str(path), kv_cache_gib=0.01) as llm:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        kernels = llm.info.kernels
    # every projection on the file's own groups (Q8_0 and Q4_0 alike: no float32 copy, no oneDNN; a
    # float output weight's logits may still run oneDNN)
    assert "every row" in kernels and kernels.count("onednn") == kernels.count("onednn float32 logits"), (
        kernels
    )
    assert ("MoE layers" in kernels) == (family == "qwen3_moe")
    assert out.token_ids == want[21:]


# ---------------------------------------------------------------- metadata rules and refusals


def _metadata_gguf(
    path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
) -> Path:
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _shapes(arch: str, layers: int, hidden: int = 64, heads: int = 4, **extra: Any) -> dict[str, Any]:
    return {f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden, f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.feed_forward_length": 128, f"{arch}.context_length": 256,
            f"{arch}.attention.key_length": 16, f"{arch}.attention.value_length": 16,
            f"{arch}.vocab_size": 32, **{f"{arch}.{k}": v for k, v in extra.items()}}  # fmt: skip


def _config(path: Path) -> ModelConfig:
    return model_config_from_hf(gguf_config_dict(GGUFFile(path)))


def test_gguf_config_rules(tmp_path: Path) -> None:
    """llama.cpp's per-architecture rules where the converter writes no key."""
    # Gemma 2: scale by head_dim ** -0.5, except the 46-layer 27B (hidden / heads); even layers slide
    g2 = _config(_metadata_gguf(tmp_path / "g2.gguf", "gemma2", _shapes("gemma2", 4)
                                | {"gemma2.attention.sliding_window": 8}))  # fmt: skip
    assert g2.gemma is not None and g2.gemma.query_pre_attn_scalar == 16.0
    assert g2.gemma.layer_types == (SLIDING, GLOBAL) * 2 and g2.gemma.sliding_window == 8
    assert (g2.gemma.attn_logit_softcapping, g2.gemma.final_logit_softcapping) == (50.0, 30.0)  # llama.cpp's
    assert g2.rope_theta == 10000.0 and g2.tie_word_embeddings
    zero_caps = {"gemma2.attention.sliding_window": 8, "gemma2.attn_logit_softcapping": 0.0,
                 "gemma2.final_logit_softcapping": 0.0}  # fmt: skip
    uncapped = _config(_metadata_gguf(tmp_path / "g2z.gguf", "gemma2", _shapes("gemma2", 2) | zero_caps))
    assert uncapped.gemma is not None
    assert (uncapped.gemma.attn_logit_softcapping, uncapped.gemma.final_logit_softcapping) == (None, None)
    old_file = _config(_metadata_gguf(tmp_path / "g2o.gguf", "gemma2", _shapes("gemma2", 2)))  # no window key
    assert old_file.gemma is not None and old_file.gemma.sliding_window == 4096
    g27 = _config(_metadata_gguf(tmp_path / "g27.gguf", "gemma2", _shapes("gemma2", 46, hidden=4608, heads=32)
                                 | {"gemma2.attention.sliding_window": 4096}))  # fmt: skip
    assert g27.gemma is not None and g27.gemma.query_pre_attn_scalar == 144.0
    # Gemma 3: 5 sliding : 1 global, the local base 10000 without freq_base_swa; no window: all global
    g3 = _config(_metadata_gguf(tmp_path / "g3.gguf", "gemma3", _shapes("gemma3", 7)
                                | {"gemma3.attention.sliding_window": 512, "gemma3.rope.freq_base": 1e6}))  # fmt: skip
    assert g3.gemma is not None and g3.gemma.layer_types == (SLIDING,) * 5 + (GLOBAL, SLIDING)
    assert g3.gemma.rope_local_base_freq == 10000.0 and g3.rope_theta == 1e6
    assert g3.gemma.final_logit_softcapping is None and g3.qk_norm
    every_third = {"gemma3.attention.sliding_window": 512, "gemma3.attention.sliding_window_pattern": 3}
    g3_3 = _config(_metadata_gguf(tmp_path / "g3p.gguf", "gemma3", _shapes("gemma3", 4) | every_third))
    assert g3_3.gemma is not None and g3_3.gemma.layer_types == (SLIDING, SLIDING, GLOBAL, SLIDING)
    g3_full = _config(_metadata_gguf(tmp_path / "g3f.gguf", "gemma3", _shapes("gemma3", 2)))
    assert g3_full.gemma is not None and g3_full.gemma.layer_types == (GLOBAL, GLOBAL)
    # Gemma 3 trims the embedding's padding rows: the vocabulary is the embedding's
    trimmed = _metadata_gguf(tmp_path / "g3v.gguf", "gemma3", _shapes("gemma3", 2),
                             {"token_embd.weight": np.zeros((30, 64), dtype=np.float32)})  # fmt: skip
    assert _config(trimmed).vocab_size == 30


@pytest.mark.parametrize(
    ("arch", "meta", "match"),
    [
        ("clip", {}, "multimodal projector"),
        ("gemma3n", {}, "Gemma 3n"),
        ("gemma", {}, "Gemma 1"),
        ("qwen2moe", {}, "shared expert"),
        ("gemma3", {"gemma3.attention.sliding_window_pattern": 0}, "sliding_window_pattern"),
        (
            "qwen3moe",
            {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_gating_func": 2},
            "expert_gating_func",
        ),  # fmt: skip
        ("qwen3moe", {"qwen3moe.expert_count": 4}, "expert_used_count"),
        ("phi3", {"phi3.rope.scaling.factor": 2.0}, r"phi3\.rope\.scaling\.factor"),
    ],
)
def test_what_a_gguf_cannot_say_is_refused_by_name(
    arch: str, meta: dict[str, Any], match: str, tmp_path: Path
) -> None:
    path = _metadata_gguf(tmp_path / "x.gguf", arch, _shapes(arch, 2) | meta)
    with pytest.raises(UnsupportedModelError, match=match):
        gguf_config_dict(GGUFFile(path))


def test_phi3_longrope_needs_both_factor_sets(tmp_path: Path) -> None:
    factors = {"rope_factors_long.weight": np.ones(6, dtype=np.float32)}
    path = _metadata_gguf(tmp_path / "p.gguf", "phi3", _shapes("phi3", 2), factors)
    with pytest.raises(UnsupportedModelError, match="rope_factors_short"):
        gguf_config_dict(GGUFFile(path))


def test_a_split_part_is_refused_whatever_its_name(tmp_path: Path) -> None:
    meta = _shapes("llama", 2) | {"split.no": 1, "split.count": 3}
    path = _metadata_gguf(tmp_path / "model.gguf", "llama", meta)
    with pytest.raises(UnsupportedModelError, match="part 2 of 3 of a split GGUF"):
        gguf_config_dict(GGUFFile(path))
    with pytest.raises(UnsupportedModelError, match="split GGUF"):
        next(GGUFFile(path).iter_tensors(torch.float32))


def test_a_folder_with_a_projector_beside_the_text_model_loads_the_text_model(tmp_path: Path) -> None:
    """Gemma 3's conversion writes the language model (gemma3) and the vision projector (mmproj, clip)."""
    hf = random_hf("gemma3")
    text = write_converted_gguf(tmp_path / "gemma3.gguf", dict(hf.state_dict()), hf.config.to_dict())
    projector = _metadata_gguf(tmp_path / "mmproj-gemma3.gguf", "clip", {"clip.has_vision_encoder": 1})
    assert resolve_model(tmp_path).path == text
    with pytest.raises(UnsupportedModelError, match="multimodal projector"):
        gguf_config_dict(GGUFFile(projector))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_names_invert_the_converters_table(family: str) -> None:
    """gguf-py's TensorNameMap (what the converter renames with) and gguf_layout's names agree on every
    parameter that is not a stacked expert."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    from onecall.formats.gguf_layout import hf_tensor_name

    hf = random_hf(family)
    arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(family, family)
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], hf.config.num_hidden_layers)
    for hf_name in hf.state_dict():
        if ".experts." in hf_name or (family.startswith("gemma") and hf_name == "lm_head.weight"):
            continue  # experts: stacked, checked by the round trips; Gemma's lm_head: not converted
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None and hf_tensor_name(gguf_name, arch, family == "mixtral") == hf_name


@pytest.mark.parametrize(
    ("family", "layout", "tensor"),
    [("mixtral", "per_expert_tensors", "blk.0.ffn_up.3.weight"),  # before experts were stacked
     ("qwen3_moe", "fuse_gate_up_exps", "blk.0.ffn_gate_up_exps.weight")],  # --fuse-gate-up-exps
)  # fmt: skip
def test_other_expert_layouts_load_the_same_model(
    family: str, layout: str, tensor: str, tmp_path: Path
) -> None:
    """Expert layouts llama.cpp also loads: one tensor per expert (Mixtral GGUFs converted before experts
    were stacked) and gate and up fused per expert; the same parameters as the stacked file's."""
    hf = random_hf(family)
    state, config = dict(hf.state_dict()), hf.config.to_dict()
    as_laid_out: dict[str, Any] = {layout: True}
    other = write_converted_gguf(tmp_path / "other.gguf", state, config, **as_laid_out)
    assert tensor in GGUFFile(other).tensor_names()
    stacked = dict(load(write_converted_gguf(tmp_path / "stacked.gguf", state, config)).named_parameters())
    for name, param in load(other).named_parameters():
        assert torch.equal(param, stacked[name]), name
    # quantized, on the fast path: the same stored groups per expert (a fused one split into its halves)
    stored_other: dict[str, StoredGroups] = {}
    stored_stacked: dict[str, StoredGroups] = {}
    other_q = write_converted_gguf(
        tmp_path / "other_q.gguf", state, config, weight_type=Q8_0, **{layout: True}
    )
    fast = load(other_q, stored_other)
    load(write_converted_gguf(tmp_path / "stacked_q.gguf", state, config, weight_type=Q8_0), stored_stacked)
    assert stored_other.keys() == stored_stacked.keys()
    for name, groups in stored_other.items():
        assert torch.equal(groups.q, stored_stacked[name].q) and torch.equal(
            groups.scale, stored_stacked[name].scale
        )
    assert all(m.stored is not None for m in fast.modules() if isinstance(m, Experts))


def test_4bit_experts_are_never_expanded_into_float32(tmp_path: Path) -> None:
    """On the fast path a Q4_0 file's experts run from their groups, packed as they arrive: their float32
    weights are never filled, and freed. In a mix (gate and down Q4_0, up Q8_0, as quantization mixes
    do), gate_up runs in float32, its Q4_0 half filled from its groups, and down from its groups."""
    hf = random_hf("qwen3_moe")
    state, config = dict(hf.state_dict()), hf.config.to_dict()
    path = write_converted_gguf(tmp_path / "q4.gguf", state, config, weight_type=Q4_0)
    experts = [m for m in load(path, {}).modules() if isinstance(m, Experts)]
    assert experts and all(m.gate_up_proj.numel() == 0 == m.down_proj.numel() for m in experts)
    mixed = write_converted_gguf(tmp_path / "mix.gguf", state, config, weight_type=Q4_0,
                                 type_overrides={"ffn_up_exps": Q8_0})  # fmt: skip
    reference = load(mixed)
    fast = load(mixed, {})
    for ours, ref in zip(
        (m for m in fast.modules() if isinstance(m, Experts)),
        (m for m in reference.modules() if isinstance(m, Experts)),
        strict=True,
    ):
        assert isinstance(ours.stored, NativeExperts) and all(
            gu is None and isinstance(d, native.Q4Packed) for gu, d in ours.stored.weights
        )
        assert torch.equal(ours.gate_up_proj, ref.gate_up_proj) and ours.down_proj.numel() == 0
    seq = Seq(prompt(21, seed=3))
    (want,) = Harness(reference).step([(seq, 21)])
    (got,) = Harness(fast).step([(Seq(list(seq.tokens)), 21)])
    assert (got - want).abs().max().item() <= FAST_ATOL[Q4_0]
