"""gpt-oss from GGUF files laid out as llama.cpp's converter writes them (arch `gpt-oss`), loaded through
onecall as the engine loads them (resolve_model -> config -> DecoderLM -> load_weights).

tests/helpers/make_models.py's write_gpt_oss_gguf follows llama.cpp's GptOssModel (convert_hf_to_gguf.py, on TextModel) and
gguf-py's MODEL_ARCH.GPT_OSS name table, independently of onecall's reader:

- metadata: context_length, embedding_length, feed_forward_length and expert_feed_forward_length (both
  intermediate_size), block_count, head_count(_kv), key/value_length (head_dim), rope.freq_base,
  layer_norm_rms_epsilon, expert_count, expert_used_count, attention.sliding_window, and
  rope.scaling.type yarn with .factor and .original_context_length (the converter asserts YaRN); no
  layer pattern and no SwiGLU limit (llama.cpp fixes both: even layers slide, limit 7.0);
- self_attn.sinks -> blk.N.attn_sinks.weight, mlp.router -> blk.N.ffn_gate_inp (.weight, .bias),
  q/k/v/o with biases, post_attention_layernorm -> blk.N.post_attention_norm;
- transformers' gate_up_proj (E, H, 2I), columns interleaved (gate 2i, up 2i + 1): float experts are
  transposed and split into ffn_gate_exps / ffn_up_exps (E, I, H); down_proj (E, I, H) transposed to
  ffn_down_exps (E, H, I); gate_up_proj_bias split the same way into the two .bias (E, I);
- MXFP4 experts: from a checkpoint's *_blocks (E, rows, G, 16) / *_scales (E, rows, G) (rows of gate_up
  split 0::2 / 1::2), the 32 nibbles of each block reordered to ggml's (value j low, j + 16 high in byte
  j; transformers': 2j low, 2j + 1 high), the scale byte first: ggml's block_mxfp4 (test_repacked_
  checkpoint_mxfp4); or quantized from float by gguf.quants.quantize (test_mxfp4_file).

Tolerances (float32 on CPU; transformers' eager attention and experts against ours; max abs diff on logits
of magnitude up to ~5.4, a 20-token prefill past the 8-token window then 12 greedy decode steps). The
experts' gate_up is scaled x12 so that at gpt-oss's limit 7.0 both clamps bite (on N(0, 1) inputs ~30% of
the gate and ~60% of the up values are clamped):
- F32 file: config equal to the folder's, every parameter bit for bit; logits within test_gpt_oss's
  ATOL 1e-4, greedy tokens transformers' own; measured 3.2e-5 (reference backend), 3.6e-5 (paged), the
  fast kernels loaded as the engine loads (stored groups on the way in) 1.3e-5: float32 summation-order
  noise, the weights being the checkpoint's bit for bit.
- MXFP4 file (gguf.quants.quantize): the loaded experts equal gguf.quants.dequantize of the file's bytes
  bit for bit; logits against transformers run on those dequantized experts within ATOL; measured
  2.0e-5 (reference). The fast kernels, loaded as the engine loads, run the experts natively on their
  own 4-bit codes (the iq4 kernel with MXFP4's codebook, quants.py; the q8b kernel's arithmetic), which
  round activations to int16 steps per group of 32 in both projections of every expert (gate_up scaled
  x12 here): NATIVE_ATOL, test_gguf_families' FAST_ATOL for int8 groups (5e-3); measured 1.8e-3, greedy
  tokens transformers' own.
- Repacked checkpoint MXFP4: the loaded experts equal transformers' own dequantization of the blocks and
  scales (convert_moe_packed_tensors) bit for bit; logits within ATOL, measured 8.9e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict, hf_tensor_name
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import StoredGroups
from onecall.loading.weights import load_weights
from onecall.model.decoder import DecoderLM
from tests.helpers.make_models import hf_and_ours, mxfp4_bytes, write_gpt_oss_gguf
from tests.model.test_gpt_oss import ATOL, _prefill_and_decode, prompt, tiny_gpt_oss_config
from tests.model.test_model_numerics import hf_logits

pytestmark = pytest.mark.usefixtures("single_thread")

F32, MXFP4 = GGMLQuantizationType.F32, GGMLQuantizationType.MXFP4


def build_hf(seed: int = 0) -> Any:
    """test_gpt_oss's tiny model at gpt-oss's own SwiGLU limit (7.0: a GGUF cannot carry another), its
    experts' gate_up scaled so the clamps still bite, sinks ~2 N(0, 1)."""
    from transformers import GptOssForCausalLM

    hf, _ = hf_and_ours(
        tiny_gpt_oss_config(swiglu_limit=7.0), GptOssForCausalLM, weight_scale=0.15, seed=seed
    )
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
            layer.mlp.experts.gate_up_proj.mul_(12.0)
    return hf


def _state(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def load(path: Path, stored: dict[str, StoredGroups] | None = None) -> DecoderLM:
    """What the engine does with a model path (engine/engine_parts.py), float32 on CPU; with `stored`,
    the fast kernels packed on load from the stored groups, as the engine loads them."""
    files = resolve_model(path)
    config = model_config_from_hf(load_hf_config_dict(files))
    model = DecoderLM(config, kernels="reference" if stored is None else "fast")
    load_weights(model, iter_weights(files, torch.float32, stored), stored)
    return model.eval()


def from_state(hf: Any) -> DecoderLM:
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return ours.eval()


# the experts on the native kernels (int16 activation steps): test_gguf_families' FAST_ATOL for Q8_0
NATIVE_ATOL = 5e-3


def _check_against_transformers(
    hf: Any, ours: DecoderLM, backend: str = "reference", atol: float = ATOL
) -> float:
    """20-token prefill past the window, then 12 greedy steps: logits within `atol`, the greedy tokens
    transformers' own. Returns the max abs difference."""
    seq, got = _prefill_and_decode(ours, prompt(20, seed=1), backend)
    ref = hf_logits(hf, seq.tokens)
    diff = float((got - ref[: got.shape[0]]).abs().max())
    assert diff <= atol, diff
    assert seq.tokens[20:] == [int(t) for t in ref[19:-1].argmax(-1)]
    return diff


def _assert_same_parameters(ours: DecoderLM, reference: DecoderLM) -> None:
    got, expected = ours.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_f32_file_equals_the_checkpoint(tmp_path: Path) -> None:
    hf = build_hf()
    path = write_gpt_oss_gguf(tmp_path / "model.gguf", _state(hf), hf.config.to_dict())
    want = model_config_from_hf(hf.config.to_dict())
    assert model_config_from_hf(gguf_config_dict(GGUFFile(path))) == want
    ours = load(path)
    _assert_same_parameters(ours, from_state(hf))
    for backend in ("reference", "paged"):
        _check_against_transformers(hf, ours, backend)
    _check_against_transformers(hf, load(path, {}))  # the fast kernels, packed as the engine loads


def _set_experts(hf: Any, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """Layer `layer`'s experts in transformers' layout from GGUF-oriented gate / up (E, I, H), down (E, H, I)."""
    experts = hf.model.layers[layer].mlp.experts
    with torch.no_grad():
        gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)  # (E, 2I, H), rows interleaved
        experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
        experts.down_proj.copy_(down.transpose(1, 2))


def test_mxfp4_file(tmp_path: Path) -> None:
    """Experts quantized to MXFP4 by gguf.quants: loaded as gguf.quants.dequantize reads the same bytes,
    and the logits transformers gives over those values."""
    hf = build_hf(seed=1)
    state, cfg = _state(hf), hf.config.to_dict()
    experts: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        t = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)
        halves = {
            "gate": t[:, ::2],
            "up": t[:, 1::2],
            "down": state[f"model.layers.{i}.mlp.experts.down_proj"].mT,
        }
        deq = {}
        for part, value in halves.items():
            data = gguf_quantize(value.contiguous().numpy(), MXFP4)
            experts[f"blk.{i}.ffn_{part}_exps.weight"] = data
            deq[part] = torch.from_numpy(gguf_dequantize(data, MXFP4).copy())
            assert deq[part].shape == value.shape
        _set_experts(hf, i, deq["gate"], deq["up"], deq["down"])
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", state, cfg, experts)
    want = {}
    for i in range(cfg["num_hidden_layers"]):
        for part in ("gate", "up", "down"):
            deq_all = torch.from_numpy(
                gguf_dequantize(experts[f"blk.{i}.ffn_{part}_exps.weight"], MXFP4).copy()
            )
            for e in range(cfg["num_local_experts"]):
                want[f"model.layers.{i}.mlp.experts.{e}.{part}_proj.weight"] = deq_all[e]
    seen = 0
    for name, tensor in iter_weights(resolve_model(path), torch.float32):
        if name in want:
            assert torch.equal(tensor, want[name]), name
            seen += 1
    assert seen == len(want)
    ours = load(path)
    _assert_same_parameters(ours, from_state(hf))
    _check_against_transformers(hf, ours)
    fast = load(path, {})  # as the engine loads: the experts on their own codes (iq4 kernel), no float32 copy
    assert "experts native mxfp4" in fast.kernels, fast.kernels
    _check_against_transformers(hf, fast, atol=NATIVE_ATOL)


def test_repacked_checkpoint_mxfp4(tmp_path: Path) -> None:
    """A released-style checkpoint's MXFP4 blocks and scales, repacked as the converter repacks them:
    the experts load as transformers' own dequantization of those blocks, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = build_hf(seed=2)
    state, cfg = _state(hf), hf.config.to_dict()
    e, h, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(5)
    experts: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        parts = {}
        for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(121, 125, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
            parts[proj] = (blocks, scales)
            with torch.no_grad():  # transformers' (E, in, out) from the pair
                getattr(hf.model.layers[i].mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales)
                )
        (gu_blocks, gu_scales), (d_blocks, d_scales) = parts["gate_up_proj"], parts["down_proj"]
        experts[f"blk.{i}.ffn_gate_exps.weight"] = mxfp4_bytes(gu_blocks[:, ::2], gu_scales[:, ::2])
        experts[f"blk.{i}.ffn_up_exps.weight"] = mxfp4_bytes(gu_blocks[:, 1::2], gu_scales[:, 1::2])
        experts[f"blk.{i}.ffn_down_exps.weight"] = mxfp4_bytes(d_blocks, d_scales)
    path = write_gpt_oss_gguf(tmp_path / "repacked.gguf", state, cfg, experts)
    ours = load(path)
    _assert_same_parameters(ours, from_state(hf))
    _check_against_transformers(hf, ours)


def test_refusals(tmp_path: Path) -> None:
    """What a gpt-oss file can say that onecall would run differently (or cannot place) is refused by name."""
    hf = build_hf()
    state, cfg = _state(hf), hf.config.to_dict()

    with pytest.raises(UnsupportedModelError, match="YaRN"):
        gguf_config_dict(GGUFFile(write_gpt_oss_gguf(tmp_path / "a.gguf", state, cfg, yarn=False)))
    with pytest.raises(UnsupportedModelError, match="expert_feed_forward_length"):
        wider = {"gpt-oss.feed_forward_length": 2 * cfg["intermediate_size"]}
        gguf_config_dict(GGUFFile(write_gpt_oss_gguf(tmp_path / "b.gguf", state, cfg, extra=wider)))
    with pytest.raises(UnsupportedModelError, match="attn_sinks"):
        gguf_config_dict(
            GGUFFile(write_gpt_oss_gguf(tmp_path / "c.gguf", state, cfg, omit=("blk.0.attn_sinks.weight",)))
        )
    path = write_gpt_oss_gguf(tmp_path / "d.gguf", state, cfg, omit=("blk.1.ffn_up_exps.bias",))
    with pytest.raises(UnsupportedModelError, match="ffn_up_exps.bias"):
        list(iter_weights(resolve_model(path), torch.float32))
    with pytest.raises(UnsupportedModelError, match="fused"):
        hf_tensor_name("blk.0.ffn_gate_up_exps.weight", "gpt-oss")
    with pytest.raises(UnsupportedModelError, match="ffn_norm"):
        hf_tensor_name("blk.0.ffn_norm.weight", "gpt-oss")
