"""Gemma 4 (text) from GGUF files laid out as llama.cpp's converter writes them (arch `gemma4`), loaded
through onecall as the engine loads them (resolve_model -> config -> DecoderLM -> load_weights).

tests/helpers/make_models.py's write_gemma4_gguf follows llama.cpp's Gemma4Model (conversion/gemma.py, on Gemma3Model and
TextModel) and gguf-py's MODEL_ARCH.GEMMA4 name table, independently of onecall's reader:

- norms as they are (Gemma 4's norm_shift is 0: no 1 + w), no lm_head when tied;
- attention.key_length / value_length the global head size, *_swa the sliding one;
  attention.head_count_kv one per layer when num_global_key_value_heads is set;
  attention.sliding_window_pattern one flag per layer; attention.shared_kv_layers;
  feed_forward_length per layer (doubled on the KV-sharing layers) with use_double_wide_mlp;
  embedding_length_per_layer_input; rope.freq_base (global), rope.freq_base_swa (sliding);
  rope.dimension_count the whole global head, rope.dimension_count_swa the sliding head;
  final_logit_softcapping when set; expert_count / expert_used_count / expert_feed_forward_length;
- rope_freqs.weight: 1.0 for the rotated pairs of the global (proportional) RoPE, 1e30 for the rest;
- layer_scalar -> blk.N.layer_output_scale.weight, router.scale -> blk.N.ffn_gate_inp.scale,
  router.per_expert_scale -> blk.N.ffn_down_exps.scale, experts stacked as transformers holds them
  (ffn_gate_up_exps (E, 2I, H), ffn_down_exps (E, H, I)), K = V layers without attn_v.

The converter does not carry the proportional RoPE's `factor` (it writes 1.0 in rope_freqs), so the
tiny configs of tests/model/test_gemma4.py are used with factor 1 here; a file whose rope_freqs holds
another factor is read as that factor (test_rope_freqs_factor).

Tolerances (float32, transformers' eager attention against ours; measured max abs diff on logits):
- F32 file: config equal to the folder's, every parameter bit for bit; prefill (20 tokens, past the
  6-token window) and 6 greedy decode steps within test_gemma4's ATOL 2e-4, greedy tokens equal;
  measured prefill / decode 6.4e-6 / 8.5e-6 (e2b), 1.4e-5 / 1.4e-5 (31b), 8.2e-6 / 7.0e-6 (moe): the
  float32 summation-order noise test_gemma4 explains (the weights are the checkpoint's, bit for bit).
- F16 file: every tensor of 2+ dimensions stored F16 (1-D F32, as the converter keeps them): the
  loaded weights equal the file's values exactly (F16 -> float32 is exact), logits against
  transformers running the same F16-rounded weights within ATOL; measured 7.8e-6 / 9.2e-6 (e2b),
  1.2e-5 / 1.0e-5 (moe).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.config import GLOBAL
from onecall.model.decoder import DecoderLM
from tests.helpers.family_checks import check_prefill_then_decode
from tests.helpers.make_models import write_gemma4_gguf
from tests.model.test_gemma4 import _COMMON, ATOL, VARIANTS

pytestmark = pytest.mark.usefixtures("single_thread")

F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16


def _config(variant: str, factor: float = 1.0) -> dict[str, Any]:
    """test_gemma4's tiny config, the global RoPE's factor as given (the converter writes none)."""
    common = copy.deepcopy(_COMMON)
    common["rope_parameters"][GLOBAL]["factor"] = factor
    return common | VARIANTS[variant]


def build_hf(variant: str, seed: int = 0, factor: float = 1.0) -> Any:
    """test_gemma4.build's transformers model (norms 1 + 0.2 N, layer_scalar 0.5 .. 1.5, the rest 0.15 N)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**_config(variant, factor))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1))
    return hf


def load(path: Path) -> DecoderLM:
    """What the engine does with a model path (engine/engine_parts.py), float32 on CPU."""
    files = resolve_model(path)
    model = DecoderLM(model_config_from_hf(load_hf_config_dict(files)), kernels="reference")
    load_weights(model, iter_weights(files, torch.float32))
    return model.eval()


def from_state(hf: Any) -> DecoderLM:
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return ours.eval()


def _convert(tmp_path: Path, hf: Any, weight_type: GGMLQuantizationType = F32, **kw: Any) -> Path:
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return write_gemma4_gguf(tmp_path / "model.gguf", state, hf.config.to_dict(), weight_type, **kw)


def _check_against_transformers(hf: Any, ours: DecoderLM) -> None:
    """20-token prefill, then 6 greedy steps through the paged cache: logits within ATOL, tokens equal."""
    seq, ref = check_prefill_then_decode(hf, ours, ATOL)
    assert seq.tokens[21:] == [int(t) for t in ref[20:-1].argmax(-1)]  # greedy tokens transformers' too


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_f32_file_equals_the_checkpoint(variant: str, tmp_path: Path) -> None:
    hf = build_hf(variant)
    path = _convert(tmp_path, hf)
    want = model_config_from_hf(hf.config.to_dict())
    assert model_config_from_hf(gguf_config_dict(GGUFFile(path))) == want
    ours, reference = load(path), from_state(hf)
    got, expected = ours.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    _check_against_transformers(hf, ours)


def test_f16_file_round_trips(tmp_path: Path) -> None:
    """Every 2+-D tensor F16 (the MoE's stacked experts included): loaded exactly as stored."""
    for variant in ("e2b", "moe"):
        hf = build_hf(variant)
        with torch.no_grad():  # transformers on the weights the file holds
            for p in hf.parameters():
                if p.dim() >= 2:
                    p.copy_(p.half().float())
        path = _convert(tmp_path, hf, F16)
        ours, reference = load(path), from_state(hf)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(ours.state_dict()[name], tensor), name
        _check_against_transformers(hf, ours)
        path.unlink()


def test_per_layer_embeddings_stay_stored_on_the_fast_path(tmp_path: Path) -> None:
    """As the engine loads a file (packed on load, the fast kernels): the per-layer token table, a third
    of an E2B's parameters, stays the file's F16 groups (a StoredEmbedding, no float32 copy), its rows
    exactly the file's values widened; every layer's per-layer gate and projection run on the F16 kernel;
    and the logits match transformers on the F16-rounded weights."""
    from onecall.kernels.cpu import native
    from onecall.kernels.cpu.fast_embedding import StoredEmbedding
    from onecall.kernels.cpu.fast_linear import FastLinear

    if native.load() is None:
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    hf = build_hf("e2b")
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
    path = _convert(tmp_path, hf, F16)
    files = resolve_model(path)
    ours = DecoderLM(model_config_from_hf(load_hf_config_dict(files)), kernels="fast")
    stored: dict[str, Any] = {}  # the engine's load (engine_parts.load_model): groups not expanded
    load_weights(ours, iter_weights(files, torch.float32, stored, expand_stored=False), stored)
    table = ours.model.embed_tokens_per_layer
    assert isinstance(table, StoredEmbedding)
    ids = torch.tensor([0, 5, 17, hf.config.vocab_size - 1])
    want = hf.model.embed_tokens_per_layer.weight[ids]
    assert torch.equal(table(ids), want)  # F16 widened: exact
    for i, layer in enumerate(ours.model.layers):  # the per-layer input's own projections too: F16 as stored
        for name in ("per_layer_input_gate", "per_layer_projection"):
            linear = getattr(layer, name)
            assert isinstance(linear, FastLinear) and linear.every_row, f"layer {i} {name}: {linear}"
    _check_against_transformers(hf, ours.eval())


def test_rope_freqs_factor(tmp_path: Path) -> None:
    """rope_freqs' rotated pairs at f (not the converter's 1) read as the proportional RoPE's factor f."""
    hf = build_hf("e2b", factor=2.0)
    path = _convert(tmp_path, hf, rope_factor=2.0)
    config = model_config_from_hf(gguf_config_dict(GGUFFile(path)))
    assert config == model_config_from_hf(hf.config.to_dict())
    assert config.gemma4 is not None and config.gemma4.global_rope_factor == 2.0
    _check_against_transformers(hf, load(path))


def _rewrite(tmp_path: Path, hf: Any, edit: Any) -> Path:
    """The converted file with its config or state edited first."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = hf.config.to_dict()
    edit(state, cfg)
    return write_gemma4_gguf(tmp_path / "edited.gguf", state, cfg)


def test_refusals(tmp_path: Path) -> None:
    """What a gemma4 file can say that onecall would run differently is refused by name."""
    hf = build_hf("31b")

    def no_v_in_one_layer(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
        del state["model.layers.0.self_attn.v_proj.weight"]  # a sliding layer without attn_v

    with pytest.raises(UnsupportedModelError, match="attn_v"):
        gguf_config_dict(GGUFFile(_rewrite(tmp_path, hf, no_v_in_one_layer)))

    def last_layer_sliding(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
        cfg["layer_types"] = cfg["layer_types"][::-1]  # global, sliding, ..., sliding

    with pytest.raises(UnsupportedModelError, match="last layer sliding"):
        gguf_config_dict(GGUFFile(_rewrite(tmp_path, hf, last_layer_sliding)))

    def partial_sliding_rope(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
        cfg["partial_rotary_factor"] = 0.5

    with pytest.raises(UnsupportedModelError, match="dimension_count_swa"):
        gguf_config_dict(GGUFFile(_rewrite(tmp_path, hf, partial_sliding_rope)))

    def unknown_tensor(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
        state["model.layers.0.mlp.up_proj.bias"] = torch.zeros(cfg["intermediate_size"])

    with pytest.raises(UnsupportedModelError, match="ffn_up.bias"):
        path = _rewrite(tmp_path, hf, unknown_tensor)
        list(iter_weights(resolve_model(path), torch.float32))


def test_a_gemma4_gguf_with_its_tokenizer_runs_in_the_engine(tmp_path: Path) -> None:
    """The file as a user has it: the e2b model and a gemma4 tokenizer (tests/text/test_tokenizer_gemma4.py's
    vocabulary, as Gemma4Model.set_vocab writes it) through LLM: the text's ids are the tokenizer's
    (BOS first), and the greedy reply is transformers' generate on them."""
    from onecall import LLM, SamplingParams
    from tests.text.test_tokenizer_gemma4 import add_gemma4_tokenizer, gemma4_vocab

    hf = build_hf("e2b")
    vocab = gemma4_vocab()
    assert len(vocab[0]) <= hf.config.vocab_size
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    path = write_gemma4_gguf(
        tmp_path / "model.gguf",
        state,
        hf.config.to_dict(),
        add_tokenizer=lambda w: add_gemma4_tokenizer(w, vocab),
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(path), kv_cache_gib=0.01, num_threads=1) as llm:
        ids = llm.tokenizer.encode("the quick brown fox\n\njumps over the lazy dog", add_special_tokens=True)
        out = llm.generate([ids], params)[0]
    assert ids[0] == vocab[0].index("<bos>") and len(ids) > 8
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    assert list(out.token_ids) == want
