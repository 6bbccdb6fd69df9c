"""DeepSeek-V3 from GGUF files laid out as llama.cpp's converter writes them (arch `deepseek2`,
tests/helpers/make_models.write_converted_deepseek_gguf), loaded through onecall as the engine loads
them (resolve_model -> config -> DecoderLM -> load_weights(iter_weights)) and held against transformers'
DeepseekV3ForCausalLM, float32 on CPU.

The tiny models (hidden 64, 4 heads, kv_lora_rank 32, qk_nope_head_dim 32, qk_rope_head_dim 8,
v_head_dim 32, 1 dense + 2 MoE layers, 8 routed experts in 4 groups (topk_group 2, top 2,
routed_scaling_factor 2.5, norm_topk_prob), 1 shared expert; rows of 32 so that Q8_0 blocks fit):

| variant | what it has                                                                                |
|---------|--------------------------------------------------------------------------------------------|
| lora    | q_lora_rank 32 (attn_q_a, attn_q_a_norm, attn_q_b), untied lm_head                         |
| plain   | q_proj (no q_lora_rank key), yarn (factor 4, mscale = mscale_all_dim = 0.707: the softmax |
|         | scale changes, written as yarn_log_multiplier 0.0707), attention biases, tied embeddings   |

Both in the converter's layouts: kv_b split into attn_k_b (transposed) / attn_v_b (late-2025
converters) and whole as attn_kv_b (converters before the split, with key_length / value_length the
per-head sizes). rope_interleave is true in both: llama.cpp rotates adjacent pairs and the converter
permutes nothing, which is transformers' interleaved RoPE.

Tolerances (max abs diff of logits of size up to ~6; measured here, torch 2.13, transformers 5.25):
- F32 files: the config equals the checkpoint's, every parameter bit for bit; 20-token prefill and 6
  greedy decode steps within test_deepseek's ATOL 2e-4 on the reference kernels and on the fast path as
  the engine loads it; measured 5.1e-6 / 6.3e-6 (lora, reference / fast) and 4.9e-6 / 4.7e-6 (plain),
  either kv_b layout.
- F16 and Q8_0 files (every row here whole Q8_0 blocks, attn_k_b's of qk_nope_head_dim too): the loaded parameters
  equal gguf.quants.dequantize of the file's bytes (read back with gguf's own GGUFReader), and the logits
  equal transformers' on those weights within ATOL (reference kernels: measured 3.7e-6 F16, 3.8e-6
  Q8_0) and within FAST_ATOL 2e-3 on the fast path as the engine loads it (3.3e-6 F16; 3.0e-4 Q8_0,
  whose kernels round activations per group).
- llama.cpp itself (llama-cpp-python 0.3.36, F32 KV cache) runs the same files (both kv_b layouts,
  lora variant: llama.cpp requires q_lora_rank for a 3-layer model): its logits within LLAMA_ATOL 1e-4
  of onecall's, measured 1.1e-5 (split) and 1.2e-5 (whole) on logits up to 5.6; greedy tokens equal.
  F32 only: llama.cpp rounds activations to the weight's type (F16 activations for F16 weights, Q8_0
  for Q8_0), measured 1.3e-2 (F16 file) and 0.26 (Q8_0, every expert used) off onecall's exact float32
  on these 0.15-scale random weights, and with top-2 routing a flipped expert choice moves a row by 2.6.
- LLM(model=file.gguf), Q8_0, default (fast) kernels: greedy tokens equal transformers' on the file's
  weights (top-2 margins of at least MARGIN checked first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict, hf_tensor_name
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import StoredGroups
from onecall.loading.weights import load_weights
from onecall.model.decoder import DecoderLM
from tests.helpers.family_checks import KVHarness
from tests.helpers.make_models import write_converted_deepseek_gguf
from tests.model.test_model_numerics import Seq, hf_logits

# slow: ~8 s in all (the engine, llama.cpp beside it); make test runs it
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]

F32, F16, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0
ATOL = 2e-4  # test_deepseek's: float32 both sides, summation order
FAST_ATOL = 2e-3  # the fast kernels round activations per group on a Q8_0 file: measured 3.0e-4
LLAMA_ATOL = 1e-4  # llama.cpp (F32 KV cache) against onecall on the same file
# the engine test's premise: the top two logits at least this far apart at every step (150x the fast path's
# measured 3.0e-4; random 49,152-token vocabularies give gaps of 0.02 to 0.17 over 6 steps: seed 6, 0.165)
MARGIN = 0.05
VOCAB = 256
LAYOUTS = ("split", "whole")

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=32,
    v_head_dim=32, first_k_dense_replace=1, max_position_embeddings=256, attn_implementation="eager",
)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "lora": dict(q_lora_rank=32),
    "plain": dict(
        q_lora_rank=None, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
                         "rope_theta": 10000.0},
    ),
}  # fmt: skip


def build_hf(variant: str = "lora", seed: int = 0, vocab: int = VOCAB) -> Any:
    """A tiny DeepseekV3ForCausalLM, every weight random: norms 1 + 0.2 N, e_score_correction_bias 0.3 N
    (so it changes the choice), the rest 0.15 N."""
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=vocab, **_COMMON, **VARIANTS[variant])).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf


def _state(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def load(path: Path, stored: dict[str, StoredGroups] | None = None) -> DecoderLM:
    """What the engine does with a model path, float32 on CPU; with `stored`, the fast kernels packed on
    load from the stored groups, as the engine loads them."""
    files = resolve_model(path)
    config = model_config_from_hf(load_hf_config_dict(files))
    model = DecoderLM(config, kernels="reference" if stored is None else "fast")
    load_weights(model, iter_weights(files, torch.float32, stored), stored)
    return model.eval()


def from_state(hf: Any) -> DecoderLM:
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return ours.eval()


def prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _against_transformers(hf: Any, ours: DecoderLM, atol: float = ATOL) -> float:
    """A 20-token prefill, then 6 greedy decode steps through the latent cache: every row's logits within
    `atol` of transformers', the greedy tokens its own. Returns the max abs difference."""
    harness, seq = KVHarness(ours), Seq(prompt(20, seed=3))
    rows = list(harness.step([(seq, 20)]))
    for _ in range(6):
        seq.tokens.append(int(rows[-1][-1].argmax()))
        rows.append(harness.step([(seq, 1)])[0])
    got, ref = torch.cat(rows), hf_logits(hf, seq.tokens)
    diff = float((got - ref[: got.shape[0]]).abs().max())
    assert diff <= atol, f"max abs diff {diff:.2e} > {atol}"
    assert seq.tokens[20:] == [int(t) for t in ref[19:-1].argmax(-1)]
    return diff


def _assert_same_parameters(ours: DecoderLM, reference: DecoderLM) -> None:
    got, expected = ours.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_f32_file_is_the_checkpoint(variant: str, layout: str, tmp_path: Path) -> None:
    hf = build_hf(variant)
    path = write_converted_deepseek_gguf(
        tmp_path / "m.gguf", _state(hf), hf.config.to_dict(), split_kv_b=layout == "split"
    )
    config = model_config_from_hf(gguf_config_dict(GGUFFile(path)))
    assert config == model_config_from_hf(hf.config.to_dict())
    assert config.deepseek is not None and config.deepseek.rope_interleave
    ours = load(path)
    _assert_same_parameters(ours, from_state(hf))
    _against_transformers(hf, ours)
    _against_transformers(hf, load(path, {}))  # the fast kernels, packed as the engine loads


def file_weights(path: Path, hf: Any) -> dict[str, torch.Tensor]:
    """The checkpoint a GGUF holds, read with gguf's own reader and dequantizer (not onecall's): the
    writer's renames undone (gguf-py's table), the experts restacked, kv_b put back together."""
    cfg = hf.config
    tensors = {
        t.name: torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
        for t in GGUFReader(path).tensors
    }
    name_map = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for name, value in hf.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""

        def at(stem: str, kind: str = "weight", layer: str = layer) -> torch.Tensor:
            return tensors[f"blk.{layer}.{stem}.{kind}"]

        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            got = tensors["token_embd.weight"]
        elif name.endswith("e_score_correction_bias"):
            got = at("exp_probs_b", "bias")
        elif name.endswith("mlp.experts.gate_up_proj"):
            got = torch.cat((at("ffn_gate_exps"), at("ffn_up_exps")), dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            got = at("ffn_down_exps")
        elif name.endswith("kv_b_proj.weight") and f"blk.{layer}.attn_k_b.weight" in tensors:
            got = torch.cat((at("attn_k_b").transpose(1, 2), at("attn_v_b")), dim=1)
        else:
            got = tensors[str(name_map.get_name(name, try_suffixes=(".weight", ".bias")))]
        out[name] = got.reshape(value.shape)
    return out


@pytest.mark.parametrize("qtype", [F16, Q8_0], ids=lambda t: t.name)
def test_a_quantized_file_runs_its_own_weights(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    hf = build_hf("lora", seed=1)
    path = write_converted_deepseek_gguf(tmp_path / "q.gguf", _state(hf), hf.config.to_dict(), qtype)
    kinds = {t.tensor_type for t in GGUFReader(path).tensors}
    assert kinds == {F32, qtype}  # F32: the norms, the router and its bias; attn_k_b too in qtype
    hf.load_state_dict(file_weights(path, hf))
    ours = load(path)
    _assert_same_parameters(ours, from_state(hf))
    _against_transformers(hf, ours)
    fast = _against_transformers(hf, load(path, {}), FAST_ATOL)
    assert fast <= FAST_ATOL, fast


def _tokenizer() -> dict[str, Any]:
    """The embedded model's tokenizer metadata, for files an engine (ours or llama.cpp) can open."""
    meta = GGUFFile(resolve_model(None).path).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def test_the_engine_serves_a_deepseek_gguf(tmp_path: Path) -> None:
    """What a user runs: LLM(model=file.gguf), Q8_0, default kernels; greedy tokens from a token-id
    prompt equal transformers' on the file's weights."""
    from onecall import LLM, SamplingParams

    tokenizer = _tokenizer()
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    hf = build_hf("lora", seed=2, vocab=vocab)
    path = write_converted_deepseek_gguf(
        tmp_path / "e.gguf", _state(hf), hf.config.to_dict(), Q8_0, extra_metadata=tokenizer
    )
    hf.load_state_dict(file_weights(path, hf))
    ids = prompt(21, seed=6, vocab=vocab)
    want = list(ids)
    for _ in range(6):
        top = hf_logits(hf, want)[-1].topk(2)
        assert (top.values[0] - top.values[1]).item() >= MARGIN  # the premise: no near-tie to flip
        want.append(int(top.indices[0]))
    with LLM(model=str(path), kv_cache_gib=0.01, num_threads=1) as llm:
        assert llm.engine.model_config.architecture == "deepseek_v3"
        # the routed experts run on the native kernels in the file's Q8_0 groups, no float32 copy, and
        # so does every projection: 3 layers of q_a, q_b, kv_a and o; the dense layer's gate, up and down;
        # the 2 MoE layers' shared gate, up and down
        assert "experts native int8 (2 of 2 MoE layers)" in llm.info.kernels, llm.info.kernels
        projections = 3 * 4 + 3 + 2 * 3
        assert f"native int8 ({projections} of {projections} projections, every row)" in llm.info.kernels
        assert "onednn" not in llm.info.kernels, llm.info.kernels
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == want[21:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_cpp_runs_the_same_model(layout: str, tmp_path: Path) -> None:
    """llama.cpp's own loader and graph on the written file (the proof the layout is llama.cpp's): its
    prefill logits equal onecall's within LLAMA_ATOL, and so do 6 greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizer = _tokenizer()
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    hf = build_hf("lora", seed=3, vocab=vocab)
    path = write_converted_deepseek_gguf(
        tmp_path / "l.gguf", _state(hf), hf.config.to_dict(), split_kv_b=layout == "split",
        extra_metadata=tokenizer,
    )  # fmt: skip
    ours = load(path)
    ids = prompt(20, seed=4, vocab=vocab)
    harness, seq = KVHarness(ours), Seq(list(ids))
    (logits,) = harness.step([(seq, 20)])
    for _ in range(6):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
    f32 = 0  # GGML_TYPE_F32: the KV cache in float32, as ours
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32
    )
    try:
        llm.eval(ids)
        theirs = torch.tensor(np.array(llm.scores[:20]))
        greedy: list[int] = []
        for _ in range(6):  # greedy decode, one token a step through llama.cpp's cache
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(greedy[-1:])
    finally:
        llm.close()
    ref = hf_logits(hf, ids)
    (ours_prefill,) = KVHarness(ours).step([(Seq(list(ids)), 20)])
    diff = float((theirs - ours_prefill).abs().max())
    assert diff <= LLAMA_ATOL, diff
    assert float((ref - ours_prefill).abs().max()) <= ATOL
    assert greedy == seq.tokens[20:]


def _refused(tmp_path: Path, match: str, variant: str = "lora", **kwargs: Any) -> None:
    hf = build_hf(variant)
    path = write_converted_deepseek_gguf(tmp_path / f"r{len(list(tmp_path.iterdir()))}.gguf", _state(hf),
                                         hf.config.to_dict(), **kwargs)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=match):
        gguf_config_dict(GGUFFile(path))
        list(iter_weights(resolve_model(path), torch.float32))


def test_what_onecall_would_run_differently_is_refused(tmp_path: Path) -> None:
    """Softmax routing (DeepSeek-V2, or no expert_gating_func: llama.cpp's softmax), a router without its
    bias, a layer plan the tensors contradict, half of a split kv_b, attention temperature tuning, and
    yarn without the multiplier llama.cpp scales the softmax by: each refused by name."""
    _refused(tmp_path, "expert_gating_func is 1", metadata_overrides={"expert_gating_func": 1})
    _refused(tmp_path, "absent: softmax", metadata_overrides={"expert_gating_func": None})
    _refused(tmp_path, "exp_probs_b", omit=("blk.2.exp_probs_b.bias",))
    _refused(tmp_path, "leading_dense_block_count is 2", metadata_overrides={"leading_dense_block_count": 2})
    _refused(tmp_path, "attn_k_b and attn_v_b", omit=("blk.1.attn_v_b.weight",))
    _refused(tmp_path, "temperature", metadata_overrides={"attention.temperature_scale": 0.5})
    _refused(tmp_path, "expert_shared_count", metadata_overrides={"expert_shared_count": 0})
    _refused(
        tmp_path,
        "yarn_log_multiplier",
        "plain",
        metadata_overrides={"rope.scaling.yarn_log_multiplier": None},
    )
    hf = build_hf()
    half = write_converted_deepseek_gguf(
        tmp_path / "half.gguf", _state(hf), hf.config.to_dict(), omit=("blk.0.attn_k_b.weight",)
    )
    with pytest.raises(UnsupportedModelError, match="only one of attn_k_b.weight and attn_v_b.weight"):
        list(iter_weights(resolve_model(half), torch.float32))
    with pytest.raises(UnsupportedModelError, match="no counterpart in onecall's deepseek2"):
        hf_tensor_name("blk.0.attn_k.weight", "deepseek2")
