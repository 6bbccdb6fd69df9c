"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next from GGUF files laid out as llama.cpp's converter writes them
(tests/helpers/make_models.write_converted_hybrid_gguf: gguf-py's name table for the qwen35 / qwen35moe
/ qwen3next archs, ssm_a = -exp(A_log), the conv squeezed, (1 + w) norms stored with the 1 added,
Qwen3-Next's in_proj_qkvz split per key head, Qwen3.5's value heads tiled, ssm.* and
full_attention_interval metadata), loaded through onecall as the engine loads them (resolve_model ->
config -> DecoderLM -> load_weights(iter_weights)) and compared with the same model's Hugging Face folder.

Each family is a tiny random transformers model (tiny_hybrid_hf) with a layer plan a GGUF can say (6
layers, every third full attention: llama.cpp reads the plan from full_attention_interval), Qwen3-Next
without dense layers and with its top-k renormalised (llama.cpp runs it so). The writer was checked
against llama.cpp itself (llama-cpp-python 0.3.36's library, F32 KV cache, key and value heads of 12):
its files run there within 2.7e-4 of transformers' logits (~12), and within 16 with the value-head
reorder left out. Measured here (torch 2.13, transformers 5.25), tolerance in brackets:
  1. the F32 GGUF's config equals the folder's and every parameter is the folder's bit for bit, but
     A_log (log(-ssm_a) rounded to float32: within 6e-8); logits through the paged KV cache and the
     state cache (prefill, decode rows, uneven chunks) equal the folder's: 0 [EXACT 1e-5];
  2. Q8_0 and Q4_K files (Q4_K where a row is whole super-blocks, llama-quantize's Q5_0 elsewhere; the
     converter's F16 where a row is not whole Q8_0 blocks) against the folder of the file's own weights
     (make_models.hybrid_file_weights): parameters bit for bit (A_log aside), logits on the reference
     kernels 0 [ATOL 1e-4, test_gguf_families']; the engine's fast path on the file's groups (value heads
     of 32 and 64: ssm_out's columns move whole groups; of 12: an F16 ssm_out): each projection within
     7.9e-5 of x @ w.T over its largest output [PROJECTION_RTOL 1e-3], the logits within 1.2e-2 of
     their largest (0.22 on 17.8, Qwen3-Next Q4_K; 9.8e-3 on 8.7, Qwen3.5 Q8_0) [FAST_RTOL 0.05: see
     there];
  3. LLM(model=file.gguf), Q8_0, fast kernels: greedy tokens equal transformers' on the file's weights;
  4. other layouts llama.cpp loads (Qwen3-Next's unsplit ssm_in, a multi-token-prediction block) load
     the same model; a file missing a key the DeltaNet needs, or whose layer plan does not match its
     tensors, is refused naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.ggml_types import GGMLType
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict, hf_tensor_name
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import HalfWeights, Int4Groups, Int5Groups, Int8Groups, StoredGroups, dequantize
from onecall.kernels.cpu.fast_linear import FastLinear
from onecall.loading.weights import load_weights
from onecall.model.config import GLOBAL, LINEAR
from onecall.model.decoder import DecoderLM
from tests.helpers.make_models import (
    HYBRID_FAMILIES,
    hybrid_file_weights,
    quantize_q4_k,
    tiny_hybrid_hf,
    write_converted_hybrid_gguf,
)
from tests.model.test_qwen35 import hf_logits, run_alone, tokens

F32, Q8_0, Q4_K = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K
EXACT = 1e-5  # the F32 GGUF's logits vs the folder's (logits ~10; only A_log's rounding differs)
ATOL = 1e-4  # a quantized GGUF on the reference kernels vs the folder of its weights (as test_gguf_families)
# The fast path's native kernels round activations per group of 32 (int16): up to 7.9e-5 of a
# projection's output here, where float32 rounds at ~6e-8. These random hybrids amplify whatever rounding
# a DeltaNet head's cancelling output carries (the gated RMSNorm scales it to unit size; the reference
# path in float32 vs float64 differs by up to 3.5e-4 on the same models), so the fast path's logits
# differ by up to 1.2e-2 of their size, and are held to a fraction of it; each projection is held to the
# reference's weight. A value head or group out of place is off by ~100% (ssm_out's groups left tiled:
# 12 to 24 on logits of 9 to 20).
PROJECTION_RTOL = 1e-3  # a fast projection's output vs x @ w.T, over its largest (measured <= 7.9e-5)
FAST_RTOL = 0.05  # the fast path's logits vs the reference's, over their largest (measured <= 1.3e-2)
LAYERS = [LINEAR, LINEAR, GLOBAL] * 2  # full_attention_interval 3: KV cache layers 0, 1; state layers 0..3
CHUNKS = [9, 1, 1, 7, 1, 3, 1]  # prefill, decode rows, uneven chunks

# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


def hybrid(family: str, seed: int = 0, **overrides: Any) -> Any:
    """tiny_hybrid_hf(family) as a GGUF can say it (LAYERS; Qwen3-Next all sparse, renormalised)."""
    extra: dict[str, Any] = dict(num_hidden_layers=len(LAYERS), layer_types=LAYERS)
    if family == "qwen3_next":
        extra |= dict(mlp_only_layers=[], norm_topk_prob=True)
    return tiny_hybrid_hf(family, seed=seed, **(extra | overrides))


def state_of(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}  # tied tensors unshared


def load(path: Path, stored: dict[str, StoredGroups] | None = None) -> DecoderLM:
    """What the engine does with a model path (engine/engine_parts.py), float32 on CPU."""
    files = resolve_model(path)
    config = model_config_from_hf(load_hf_config_dict(files))
    model = DecoderLM(config, kernels="reference" if stored is None else "fast")
    load_weights(model, iter_weights(files, torch.float32, stored), stored)
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_same_parameters(got: DecoderLM, want: DecoderLM) -> None:
    """Bit for bit, but A_log: log(-(-exp(A_log))) comes back within a float32 rounding or two."""
    want_params = dict(want.named_parameters())
    for name, param in got.named_parameters():
        if name.endswith(".A_log"):
            torch.testing.assert_close(param, want_params[name], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(param, want_params[name]), name


@dataclass
class Converted:
    family: str
    hf: Any
    folder: Path
    gguf: Path


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    family = request.param
    hf = hybrid(family)
    tmp = tmp_path_factory.mktemp(family)
    hf.save_pretrained(tmp / "hf")
    gguf = write_converted_hybrid_gguf(tmp / f"{family}.gguf", state_of(hf), hf.config.to_dict())
    return Converted(family, hf, tmp / "hf", gguf)


# ---------------------------------------------------------------- (1) the F32 file is the folder's model


def test_the_gguf_loads_the_folders_model(converted: Converted) -> None:
    from_folder, from_gguf = load(converted.folder), load(converted.gguf)
    assert from_gguf.config == from_folder.config
    assert from_gguf.config.linear_attention is not None
    assert from_gguf.config.linear_attention.layer_types == tuple(LAYERS)
    assert_same_parameters(from_gguf, from_folder)
    seq = tokens(24, seed=3)
    diff = max_diff(run_alone(from_gguf, seq, CHUNKS), run_alone(from_folder, seq, CHUNKS))
    assert diff <= EXACT, f"max abs diff {diff:.2e}"


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_tensor_names_invert_the_converters_table(family: str) -> None:
    """gguf-py's TensorNameMap (what the converter renames with) and gguf_layout's names agree on every
    parameter that is not renamed by hand (stacked experts, A_log, dt_bias, in_proj_qkvz)."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    arch = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}[family]
    hf = hybrid(family)
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], hf.config.num_hidden_layers)
    for hf_name in hf.state_dict():
        if ".experts." in hf_name or hf_name.endswith((".A_log", ".dt_bias", ".in_proj_qkvz.weight")):
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None and hf_tensor_name(gguf_name, arch) == hf_name, hf_name
    assert hf_tensor_name("blk.3.ssm_a", arch) == "model.layers.3.linear_attn.A_log"
    assert hf_tensor_name("blk.3.ssm_dt.bias", arch) == "model.layers.3.linear_attn.dt_bias"
    if arch == "qwen3next":  # what older converters wrote: in_proj_qkvz whole
        assert hf_tensor_name("blk.0.ssm_in.weight", arch) == "model.layers.0.linear_attn.in_proj_qkvz.weight"


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("qwen3_next", {"split_qkvz": False}),
        ("qwen3_5", {"mtp_layers": 1}),
        ("qwen3_5_moe", {"mtp_layers": 1}),
    ],
)
def test_other_layouts_load_the_same_model(family: str, layout: dict[str, Any], tmp_path: Path) -> None:
    """Layouts llama.cpp also loads: Qwen3-Next's in_proj_qkvz unsplit (ssm_in, converters before the
    split), and the checkpoint's multi-token-prediction block kept as a block after the decoder's
    (nextn_predict_layers, newer converters), which onecall skips."""
    hf = hybrid(family)
    state, config = state_of(hf), hf.config.to_dict()
    other = write_converted_hybrid_gguf(tmp_path / "other.gguf", state, config, **layout)
    names = GGUFFile(other).tensor_names()
    assert ("blk.0.ssm_in.weight" in names) == ("split_qkvz" in layout)
    assert ("blk.6.nextn.eh_proj.weight" in names) == ("mtp_layers" in layout)
    plain = load(write_converted_hybrid_gguf(tmp_path / "plain.gguf", state, config))
    got = load(other)
    assert got.config == plain.config
    assert_same_parameters(got, plain)


# ---------------------------------------------------------------- (2) quantized files
# Value heads a multiple of 32 wide, so out_proj's columns move in whole blocks (hybrid_file_weights);
# Q4_K rows need 256 columns: the Q4_K models are 256 wide, heads of 64.
_QUANTIZED: dict[GGMLQuantizationType, dict[str, Any]] = {
    Q8_0: dict(linear_key_head_dim=16, linear_value_head_dim=32),
    Q4_K: dict(hidden_size=256, head_dim=64, intermediate_size=256, linear_key_head_dim=32,
               linear_value_head_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=128),
}  # fmt: skip


def test_quantize_q4_k_writes_ggml_blocks() -> None:
    """The test writer's Q4_K blocks decode with gguf's own dequantizer (and onecall's, bit for bit) to
    within about half a 4-bit step of what they hold."""
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32) * 0.15
    blocks = quantize_q4_k(x)
    assert blocks.shape == (3, 2 * 144) and blocks.dtype == np.uint8
    back = gguf_dequantize(blocks, Q4_K)
    assert np.abs(back - x).max() <= 0.15 * 4 / 15  # a sub-block spans ~4.5 sigma in 15 steps
    ours = dequantize(torch.from_numpy(blocks).flatten(), GGMLType.Q4_K, x.shape, torch.float32)
    assert torch.equal(ours, torch.from_numpy(back))


def check_fast_path(fast: DecoderLM, reference: DecoderLM, want: torch.Tensor, seq: list[int]) -> float:
    """The engine's fast path on a quantized file: every projection on its native kernel equals the
    reference's weight (x @ w.T) within PROJECTION_RTOL of its largest output, for prompt rows and a
    decode row, so each stored form is the file's weight in our layout; the logits within FAST_RTOL of
    their largest. Returns the logits' max abs diff."""
    weights = {name: m.weight for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
    projections = {name: m for name, m in fast.named_modules() if isinstance(m, FastLinear)}
    assert projections and all(m.has_decode_kernel for m in projections.values())
    gen = torch.Generator().manual_seed(0)
    for name, m in projections.items():
        x = torch.randn(5, weights[name].shape[1], generator=gen)
        with torch.no_grad():
            exact = x @ weights[name].T
            for got, rows in ((m(x, 0), slice(None)), (m(x[:1], 1), slice(0, 1))):
                error = max_diff(got, exact[rows]) / exact[rows].abs().max().item()
                assert error <= PROJECTION_RTOL, f"{name}: relative error {error:.1e}"
    got = run_alone(fast, seq, CHUNKS)
    diff = max_diff(got, want)
    assert diff <= FAST_RTOL * want.abs().max().item(), f"fast path: max abs diff {diff:.2e}"
    return diff


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_quantized_gguf_runs_the_files_weights(
    family: str, qtype: GGMLQuantizationType, tmp_path: Path
) -> None:
    overrides = dict(_QUANTIZED[qtype])
    if family == "qwen3_5_moe":
        overrides.pop("intermediate_size", None)
    hf = hybrid(family, seed=1, **overrides)
    state, config = state_of(hf), hf.config.to_dict()
    path = write_converted_hybrid_gguf(tmp_path / f"{family}.gguf", state, config, weight_type=qtype)
    types = {t.name: t.ggml_type for t in GGUFFile(path).tensors}
    assert types["blk.0.attn_qkv.weight"] == qtype and types["blk.0.ssm_conv1d.weight"] == F32
    hf.load_state_dict(hybrid_file_weights(state, qtype))  # the file's own weights, in the folder's layout
    hf.save_pretrained(tmp_path / "hf")
    folder = load(tmp_path / "hf")
    reference = load(path)
    assert reference.config == folder.config
    assert_same_parameters(reference, folder)
    seq = tokens(24, seed=4)
    want = run_alone(folder, seq, CHUNKS)
    diff = max_diff(run_alone(reference, seq, CHUNKS), want)
    assert diff <= ATOL, f"reference kernels: max abs diff {diff:.2e}"
    # the engine's fast path, on the file's groups: rows of the tiled value heads put back, ssm_out's
    # columns moved whole groups at a time
    fast = load(path, {})
    stored: dict[str, StoredGroups] = {}  # what the reader keeps (the packer lets each go once packed)
    for _ in GGUFFile(path).iter_tensors(torch.float32, stored, expand_stored=False):
        pass
    out_proj = stored["model.layers.0.linear_attn.out_proj.weight"]
    assert isinstance(out_proj, Int8Groups if qtype == Q8_0 else (Int4Groups, Int5Groups)), type(out_proj)
    check_fast_path(fast, reference, want, seq)


def test_value_heads_narrower_than_a_group_keep_their_order(tmp_path: Path) -> None:
    """Value heads of 12 (not whole Q8_0 blocks): the converter stores a 48-wide ssm_out as F16, whose
    columns move freely, and the in_proj rows as Q8_0 (rows move freely whatever their width)."""
    hf = hybrid("qwen3_5_moe", seed=2)
    state = state_of(hf)
    path = write_converted_hybrid_gguf(tmp_path / "q8.gguf", state, hf.config.to_dict(), weight_type=Q8_0)
    fast = load(path, {})
    stored: dict[str, StoredGroups] = {}  # what the reader keeps (the packer lets each go once packed)
    for _ in GGUFFile(path).iter_tensors(torch.float32, stored, expand_stored=False):
        pass
    assert isinstance(stored["model.layers.0.linear_attn.out_proj.weight"], HalfWeights)
    assert isinstance(stored["model.layers.0.linear_attn.in_proj_z.weight"], Int8Groups)
    reference = load(path)
    seq = tokens(24, seed=5)
    check_fast_path(fast, reference, run_alone(reference, seq, CHUNKS), seq)


# ---------------------------------------------------------------- (3) end to end


# a prompt per family whose greedy continuation has a margin (top logit over the second) of at least
# MARGIN at every step on transformers' side: several times the fast path's error on these models, so
# the tokens compare (random prompts give margins down to 0.001)
_PROMPT_SEEDS = {"qwen3_5": 23, "qwen3_5_moe": 13, "qwen3_next": 26}
MARGIN = 0.4


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_engine_serves_a_converted_hybrid_gguf(family: str, tmp_path: Path) -> None:
    """What a user runs: LLM(model=file.gguf), Q8_0, on the default (fast) kernels, the file carrying the
    embedded model's tokenizer; greedy tokens from a token-id prompt equal transformers' on the file's
    weights."""
    from onecall import LLM, SamplingParams

    tokenizer = {
        k: v for k, v in GGUFFile(resolve_model(None).path).metadata.items() if k.startswith("tokenizer.")
    }
    hf = hybrid(family, seed=3, vocab_size=len(tokenizer["tokenizer.ggml.tokens"]), **_QUANTIZED[Q8_0])
    state = state_of(hf)
    path = write_converted_hybrid_gguf(
        tmp_path / f"{family}.gguf", state, hf.config.to_dict(), weight_type=Q8_0, extra_metadata=tokenizer
    )
    hf.load_state_dict(hybrid_file_weights(state, Q8_0))
    gen = torch.Generator().manual_seed(_PROMPT_SEEDS[family])
    ids = torch.randint(3, hf.config.vocab_size, (21,), generator=gen).tolist()
    want = list(ids)
    for _ in range(6):
        top = hf_logits(hf, want)[-1].topk(2)
        assert (top.values[0] - top.values[1]).item() >= MARGIN  # the premise: no near-tie to flip
        want.append(int(top.indices[0]))
    with LLM(model=str(path), kv_cache_gib=0.01) as llm:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == want[21:]


# ---------------------------------------------------------------- (4) what a hybrid GGUF must say


@pytest.mark.parametrize("missing", ["ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.conv_kernel"])  # fmt: skip
def test_a_missing_deltanet_key_is_refused_by_name(missing: str, tmp_path: Path) -> None:
    hf = hybrid("qwen3_5")
    path = write_converted_hybrid_gguf(
        tmp_path / "m.gguf", state_of(hf), hf.config.to_dict(), metadata_overrides={missing: None}
    )
    key = re.escape(f"qwen35.{missing}")
    with pytest.raises(UnsupportedModelError, match=key):
        gguf_config_dict(GGUFFile(path))
    with pytest.raises(UnsupportedModelError, match=key):
        next(GGUFFile(path).iter_tensors(torch.float32))


def test_the_layer_plan_comes_from_the_file(tmp_path: Path) -> None:
    """full_attention_interval absent: llama.cpp's 4, which these tensors contradict (refused, naming the
    key); attention.recurrent_layers, where a file has it, wins over the interval."""
    hf = hybrid("qwen3_next")
    state, config = state_of(hf), hf.config.to_dict()
    no_interval = write_converted_hybrid_gguf(
        tmp_path / "a.gguf", state, config, metadata_overrides={"full_attention_interval": None}
    )
    with pytest.raises(UnsupportedModelError, match=r"qwen3next\.full_attention_interval \(4\)"):
        gguf_config_dict(GGUFFile(no_interval))
    flags = [t == LINEAR for t in LAYERS]
    by_flags = write_converted_hybrid_gguf(
        tmp_path / "b.gguf", state, config,
        metadata_overrides={"full_attention_interval": 4, "attention.recurrent_layers": flags},
    )  # fmt: skip
    spec = model_config_from_hf(gguf_config_dict(GGUFFile(by_flags))).linear_attention
    assert spec is not None and spec.layer_types == tuple(LAYERS)


def test_a_hybrid_config_says_what_llama_cpp_runs(tmp_path: Path) -> None:
    """Qwen3-Next's top-k renormalised and every layer sparse whatever the checkpoint said (llama.cpp's
    qwen3next has no dense layers and always renormalises); the rotary fraction from
    rope.dimension_count (without it llama.cpp rotates the whole head, not transformers' 0.25)."""
    hf = hybrid("qwen3_next")
    path = write_converted_hybrid_gguf(tmp_path / "n.gguf", state_of(hf), hf.config.to_dict())
    config = model_config_from_hf(gguf_config_dict(GGUFFile(path)))
    assert config.moe is not None and config.moe.norm_topk_prob and all(config.moe.sparse_layers)
    assert config.moe.shared_expert_intermediate_size == 48 and config.partial_rotary_factor == 0.5
    whole = write_converted_hybrid_gguf(
        tmp_path / "w.gguf",
        state_of(hf),
        hf.config.to_dict(),
        metadata_overrides={"rope.dimension_count": None},
    )
    assert model_config_from_hf(gguf_config_dict(GGUFFile(whole))).partial_rotary_factor == 1.0
