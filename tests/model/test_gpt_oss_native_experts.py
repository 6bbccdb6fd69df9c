"""gpt-oss's experts on the native kernels in their stored groups (GptOssExperts.use_stored, moe.Experts'):
no float32 copy of a held weight, the biases added after each projection and the clamped SwiGLU in torch.

1. The MoE block alone: transformers' GptOssMLP (eager) on int8-group weights (the Q8_0 recipe, the
   dequantized values loaded into transformers) against GptOssMoE running those groups on the q8b kernel
   (int16 activation steps per group of 32), inputs scaled so both clamps bite; tolerance 1e-4 of the
   outputs' largest magnitude (measured 3.0e-5 of it, on outputs up to ~220); the float32 weights freed,
   the biases kept; zeroed groups (and zeroed biases) change every row, decode and prompt: each is read.
2. An MXFP4 GGUF (gguf.quants.quantize, as test_gguf_gpt_oss.test_mxfp4_file writes it) loaded as the
   engine loads it (kernels "fast", stored groups on the way in): every MoE layer's experts native mxfp4
   (their own 4-bit codes on the iq4 kernel with the mxfp4 codebook: native.IQ4Packed, at most 0.6x the
   bytes of the same weight as int8 groups), no float32 expert weight left (only the biases); logits
   against transformers run on the dequantized experts within NATIVE_ATOL (test_gguf_gpt_oss's, 5e-3:
   test_gguf_families' FAST_ATOL for int8 groups: the codes' values are the int8 groups' exactly and the
   kernel's arithmetic is q8b's), measured 1.8e-3, 12 greedy tokens transformers' own.
3. LLM(model=file.gguf) on the default kernels, the file carrying the embedded model's tokenizer: the
   start-up kernels line says the MoE layers run native mxfp4, and greedy tokens from a token-id prompt
   equal transformers' on the file's dequantized experts (each step's top-2 gap at least 2 * NATIVE_ATOL,
   so the kernels' rounding cannot flip one: checked as the premise).
4. A safetensors checkpoint's MXFP4 pairs (transformers' nibble order): with the loader's stored groups,
   loading/weights.py's _gpt_oss_layout yields them per expert, their codes kept
   (quants.mxfp4_code_groups) dequantizing to dequantize_mxfp4's values bit for bit (every nibble, the
   subnormal and overflowing exponents), as do quants.mxfp4_int8_groups' int8 values, a pair with a scale
   of 255 (NaN) left on the float path; and a model packed on load with them runs its experts native
   mxfp4 with no float32 copy, logits within
   NATIVE_ATOL of transformers' over convert_moe_packed_tensors (measured 1.0e-4, a 20-token prefill).
   load_weights does not pass its stored groups to _gpt_oss_layout yet (another helper's function): the
   last test makes that one call as the wiring would.
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

from onecall.formats.checkpoint import resolve_model
from onecall.formats.gguf import GGUFFile
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import Int4CodeGroups, Int8Groups, StoredGroups, mxfp4_int8_groups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.experts import NativeExperts, native_experts
from onecall.loading.weights import _gpt_oss_layout
from onecall.model.decoder import DecoderLM
from onecall.model.gpt_oss import GptOssExperts, GptOssMoE
from tests.formats.test_gguf_gpt_oss import (
    NATIVE_ATOL,
    _check_against_transformers,
    _set_experts,
    _state,
    load,
)
from tests.helpers.int4 import quantize_int8
from tests.helpers.make_models import hf_and_ours, write_gpt_oss_gguf
from tests.model.test_gpt_oss import prompt, tiny_gpt_oss_config
from tests.model.test_model_numerics import Harness, Seq, hf_logits

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
    ),
]

MXFP4 = GGMLQuantizationType.MXFP4


def _hf(seed: int, vocab_size: int | None = None) -> Any:
    """test_gguf_gpt_oss.build_hf's model (limit 7.0, sinks ~2 N(0, 1), gate_up x12 so the clamps bite),
    with another vocabulary where given."""
    from transformers import GptOssForCausalLM

    extra = {} if vocab_size is None else {"vocab_size": vocab_size}
    hf, _ = hf_and_ours(
        tiny_gpt_oss_config(swiglu_limit=7.0, **extra), GptOssForCausalLM, weight_scale=0.15, seed=seed
    )
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
            layer.mlp.experts.gate_up_proj.mul_(12.0)
    return hf


def _write_mxfp4(path: Path, hf: Any, extra_metadata: dict[str, Any] | None = None) -> Path:
    """The model as an MXFP4 GGUF (experts quantized by gguf.quants, the rest F32); transformers' experts
    set to the file's dequantized values, so it is the reference for exactly the file's weights."""
    state, cfg = _state(hf), hf.config.to_dict()
    experts: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)  # (E, 2I, H)
        parts = {
            "gate": gate_up[:, ::2],
            "up": gate_up[:, 1::2],
            "down": state[f"model.layers.{i}.mlp.experts.down_proj"].mT,
        }
        dequantized = {}
        for part, value in parts.items():
            data = gguf_quantize(value.contiguous().numpy(), MXFP4)
            experts[f"blk.{i}.ffn_{part}_exps.weight"] = data
            dequantized[part] = torch.from_numpy(gguf_dequantize(data, MXFP4).copy())
        _set_experts(hf, i, dequantized["gate"], dequantized["up"], dequantized["down"])
    return write_gpt_oss_gguf(path, state, cfg, experts, extra_metadata=extra_metadata)


def _float_expert_weights(model: DecoderLM) -> list[str]:
    """Names of expert weights (not biases) that still hold float values."""
    return [
        name
        for name, p in model.named_parameters()
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and p.numel() > 0
    ]


# ---------------------------------------------------------------- 1. the block alone
def test_the_block_runs_its_int8_groups_with_biases() -> None:
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
    ours.load_state_dict(
        {k.removeprefix("model.layers.0.mlp."): v for k, v in _gpt_oss_layout(state.items(), torch.float32)}
    )
    experts = ours.experts
    assert isinstance(experts, GptOssExperts)
    with torch.no_grad():  # int8 groups; transformers gets their values back in its (E, in, out) layout
        gate_up = [quantize_int8(w) for w in experts.gate_up_proj]
        down = [quantize_int8(w) for w in experts.down_proj]
        inter = experts.weight_shapes[1][1]
        for e, (gu, d) in enumerate(zip(gate_up, down, strict=True)):
            rows = gu.dequantize()  # [gate; up] -> interleaved columns
            mlp.experts.gate_up_proj[e].copy_(
                torch.stack((rows[:inter], rows[inter:]), dim=1).flatten(0, 1).T
            )
            mlp.experts.down_proj[e].copy_(d.dequantize().T)
    held = native_experts(gate_up, down, experts.weight_shapes)
    assert held is not None and held.kinds() == {"int8"}
    assert experts.use_stored(held)
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0  # freed
    assert experts.gate_up_proj_bias.numel() > 0 and experts.down_proj_bias.numel() > 0  # kept
    x = 4.0 * torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = mlp(x[None])
        want = want[0]
        got = ours(x, 2)  # 2 decode rows planned, 7 prompt rows: one kernel for all
        pre = x @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    clamped = float((pre[:, ::2] > 7.0).float().mean() + (pre[:, 1::2].abs() > 7.0).float().mean())
    assert clamped > 0.2, clamped
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * scale
    # bytes one decode row streams: the router, then top_k experts' groups and biases
    one_expert = sum(held.nbytes(0, which) or 0 for which in (0, 1))
    biases = 4 * (experts.gate_up_proj_bias.shape[1] + experts.down_proj_bias.shape[1])
    router = 4 * sum(p.numel() for p in ours.router.parameters())
    assert ours.weight_bytes_read(1) == router + ours.top_k * (one_expert + biases)
    # every row reads the groups (zeroed: all rows move) and adds the biases
    zeroed = [Int8Groups(g.q, g.scale * 0, g.group_size) for g in gate_up]
    experts.use_stored(native_experts(zeroed, down, experts.weight_shapes))
    with torch.no_grad():
        poisoned = ours(x, 2)
    assert bool(((poisoned - want).abs().amax(-1) > 1e-2 * scale).all())
    experts.use_stored(held)
    with torch.no_grad():
        experts.down_proj_bias.zero_()
        unbiased = ours(x, 2)
    assert bool(((unbiased - want).abs().amax(-1) > 1e-3).all())


# ---------------------------------------------------------------- 2. an MXFP4 GGUF, as the engine loads it
def test_an_mxfp4_gguf_runs_its_experts_natively(tmp_path: Path) -> None:
    hf = _hf(seed=1)
    path = _write_mxfp4(tmp_path / "mxfp4.gguf", hf)
    fast = load(path, {})
    layers = hf.config.num_hidden_layers
    assert f"experts native mxfp4 ({layers} of {layers} MoE layers)" in fast.kernels, fast.kernels
    experts = [m for m in fast.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == layers
    assert all(m.stored is not None and m.stored.covers(0) and m.stored.covers(1) for m in experts)
    for m in experts:  # the codes, not int8 groups: about half the bytes of the same weight as int8
        assert isinstance(m.stored, NativeExperts)
        for gate_up, down in m.stored.weights:
            for w in (gate_up, down):
                assert isinstance(w, native.IQ4Packed) and w.codebook == "mxfp4"
                n, k = w.out_features, w.in_features  # the int8 form's bytes depend on the shape only
                int8 = native.pack_q8_blocked(torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // 32))
                assert w.nbytes <= 0.6 * int8.nbytes, (w.nbytes, int8.nbytes)
    assert _float_expert_weights(fast) == []  # no float32 copy of any expert weight
    _check_against_transformers(hf, fast, atol=NATIVE_ATOL)


# ---------------------------------------------------------------- 3. what a user runs
def test_llm_serves_an_mxfp4_gguf(tmp_path: Path) -> None:
    from onecall import LLM, SamplingParams

    meta = GGUFFile(resolve_model(None).path).metadata
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    hf = _hf(seed=3, vocab_size=vocab)
    path = _write_mxfp4(tmp_path / "llm.gguf", hf, extra_metadata=tokenizer)
    ids = torch.randint(3, vocab, (21,), generator=torch.Generator().manual_seed(9)).tolist()
    want = list(ids)
    for _ in range(8):
        top = hf_logits(hf, want)[-1].topk(2)
        assert float(top.values[0] - top.values[1]) >= 2 * NATIVE_ATOL  # the premise: no near-tie
        want.append(int(top.indices[0]))
    with LLM(model=str(path), kv_cache_gib=0.01, num_threads=1) as llm:
        assert llm.engine.model_config.architecture == "gpt_oss"
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        kernels = llm.info.kernels
    layers = hf.config.num_hidden_layers
    assert f"experts native mxfp4 ({layers} of {layers} MoE layers)" in kernels, kernels
    assert out.token_ids == want[21:]


# ---------------------------------------------------------------- 4. a safetensors checkpoint's MXFP4 pairs
def _mxfp4(
    shape: tuple[int, ...], scale_range: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (*shape, 16) and scales (*shape) in [lo, hi] (uint8), as test_gpt_oss's."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_range[0], scale_range[1] + 1, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_pairs_come_per_expert_as_their_exact_codes() -> None:
    blocks, scales = _mxfp4((3, 40, 4), (0, 254), seed=0)
    scales[0, :11, 0] = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254], dtype=torch.uint8)
    nibbles = torch.arange(16, dtype=torch.uint8)
    blocks[0, :, 0] = (nibbles | (nibbles.flip(0) << 4)).repeat(40, 1)  # every nibble, low and high
    down_blocks, down_scales = _mxfp4((3, 20, 4), (110, 130), seed=1)
    nan_blocks, nan_scales = _mxfp4((3, 20, 4), (110, 130), seed=2)
    nan_scales[1, 3, 2] = 255
    base = "model.layers.0.mlp.experts"
    checkpoint = {
        f"{base}.gate_up_proj_blocks": blocks, f"{base}.gate_up_proj_scales": scales,
        f"{base}.down_proj_scales": down_scales, f"{base}.down_proj_blocks": down_blocks,
        "model.layers.1.mlp.experts.down_proj_blocks": nan_blocks,
        "model.layers.1.mlp.experts.down_proj_scales": nan_scales,
    }  # fmt: skip
    stored: dict[str, StoredGroups] = {}
    got = dict(_gpt_oss_layout(checkpoint.items(), torch.float32, stored))
    want = dict(_gpt_oss_layout(checkpoint.items(), torch.float32))  # the stacked float path
    gate_up, down = want[f"{base}.gate_up_proj"], want[f"{base}.down_proj"]  # rows [gate; up]
    assert bool(gate_up.isinf().any()) and bool(((gate_up.abs() < 1e-37) & (gate_up != 0)).any())
    inter = gate_up.shape[1] // 2
    for e in range(3):
        for part, value in (
            ("gate_proj", gate_up[e, :inter]),
            ("up_proj", gate_up[e, inter:]),
            ("down_proj", down[e]),
        ):
            name = f"{base}.{e}.{part}.weight"
            groups = stored[name]
            assert isinstance(groups, Int4CodeGroups) and groups.codebook == "mxfp4"
            assert torch.equal(got[name], value) and torch.equal(groups.dequantize(), value), name
            rows = slice(None) if part == "down_proj" else slice(part == "up_proj", None, 2)
            pair = (down_blocks, down_scales) if part == "down_proj" else (blocks, scales)
            int8 = mxfp4_int8_groups(pair[0][e, rows], pair[1][e, rows])
            assert int8 is not None and torch.equal(int8.dequantize(), value), name
    nan_name = "model.layers.1.mlp.experts.down_proj"
    assert not any(k.startswith("model.layers.1.") for k in stored)  # a NaN scale: no groups
    assert torch.equal(got[nan_name].isnan(), want[nan_name].isnan()) and bool(got[nan_name].isnan().any())
    assert len(stored) == 9 and set(got) == set(stored) | {nan_name}


def test_an_mxfp4_checkpoint_packed_on_load_runs_its_experts_natively() -> None:
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from onecall.loading import weights

    hf, _ = hf_and_ours(tiny_gpt_oss_config(), GptOssForCausalLM, weight_scale=0.15)
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for j, (proj, rows, cols) in enumerate((("gate_up_proj", 128, 64), ("down_proj", 64, 64))):
                blocks, scales = _mxfp4((4, rows, cols // 32), (120, 123), seed=10 * i + j)
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
                quantized |= {f"model.layers.{i}.mlp.experts.{proj}_blocks": blocks,
                              f"model.layers.{i}.mlp.experts.{proj}_scales": scales}  # fmt: skip
    dense = (".experts.gate_up_proj", ".experts.down_proj")
    checkpoint = [(k, v) for k, v in hf.state_dict().items() if not k.endswith(dense)]
    stored: dict[str, StoredGroups] = {}
    model = DecoderLM(model_config_from_hf(hf.config.to_dict()), kernels="fast")
    weights.load_weights(model, [*checkpoint, *quantized.items()], stored)
    layers = hf.config.num_hidden_layers
    assert f"experts native mxfp4 ({layers} of {layers} MoE layers)" in model.kernels, model.kernels
    assert _float_expert_weights(model.eval()) == []
    assert not stored  # every expert's groups taken and packed
    tokens = prompt(20, seed=4)
    (logits,) = Harness(model).step([(Seq(tokens), 20)])
    assert float((logits - hf_logits(hf, tokens)).abs().max()) <= NATIVE_ATOL
