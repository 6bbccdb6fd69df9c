"""The fast CPU kernels (kernels/cpu/fast_linear.py) against the reference nn.Linear / dequantize path.

Tolerances, written down:
* int4 groups: Int4Groups.dequantize() equals quants.dequantize() of the same blocks to float32
  rounding (exact for Q4_1 and Q4_K; Q4_0 computes q*d - 8d instead of (q-8)*d: 1 ulp).
* oneDNN path (rows > INT4_MAX_ROWS): same float32 math in another summation order:
  |fast - ref| <= 1e-5 * (|x| @ |W|^T) + 1e-6.
* int4 path (rows <= INT4_MAX_ROWS), torch's kernel: activations, group scales and zeros rounded to
  bfloat16 (relative error <= 2^-9 each), so |fast - ref| <= 2^-7 * (|x| @ (|W| + |s (q-8)| + |z|)^T)
  + 1e-5, a bound with a 2x margin over the three rounding terms.
* int4 path, the native kernel: activations rounded to int16 steps of absmax/32767 per group of 32, so
  |fast - ref| <= sum_g (step_g / 2) * sum_{j in g} |w_j| + 1e-5 * (|x| @ |W|^T) + 1e-6
  (tests/kernels/test_native_kernels.py checks the kernel itself against the same bound).
* int8 groups (Q8_0, Q6_K: projections' decode rows, the logits), the native q8b kernel: the same
  int16 activation steps, so the same bound (`_int16_bound`).
* engine level, tiny model with int4-representable weights: greedy tokens equal to the reference
  path's; the first token's logprob (prefill, oneDNN) within 1e-4 and later ones (decode, int4) within
  0.5 nats: the tiny model's logits are ~50 in magnitude (weights scaled for wide greedy gaps), so
  bfloat16's 2^-9 relative rounding moves them by a few tenths (the native kernel's int16 steps far less).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from onecall.engine.engine import Engine
from onecall.formats.quants import Int4Groups, StoredGroups, dequantize, int4_groups, int8_groups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import INT4_MAX_ROWS, FastLinear, FastLMHead, onednn_available
from onecall.sampling_params import SamplingParams
from tests.helpers.int4 import int4_engine, quantize_int4
from tests.helpers.tiny_engine import run_all

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fast - x @ w^T| allowed for a kernel that rounds x to int16 steps per group of 32 (see above)."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 32767
    rounding = (step / 2) @ w.double().abs().view(w.shape[0], -1, 32).sum(-1).T
    return (rounding + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6).float()


def _random_blocks(ggml_type: T, num_blocks: int, rng: np.random.Generator) -> torch.Tensor:
    """Random raw blocks of a 4-bit type with finite, moderate f16 scale fields."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    num_f16 = 1 if ggml_type == T.Q4_0 else 2  # Q4_0: d; Q4_1: d, m; Q4_K: d, dmin
    scales = rng.uniform(-0.05, 0.05, (num_blocks, num_f16)).astype(np.float16)
    if ggml_type == T.Q4_K:
        scales = np.abs(scales)
    raw[:, : 2 * num_f16] = scales.view(np.uint8).reshape(num_blocks, 2 * num_f16)
    return torch.from_numpy(raw.reshape(-1).copy())


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_int4_groups_expand_to_the_dequantized_weight(ggml_type: T) -> None:
    rows, cols = 48, 256
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    raw = _random_blocks(ggml_type, rows * cols // block_size, np.random.default_rng(1))
    groups = int4_groups(raw, ggml_type, (rows, cols))
    assert groups is not None and groups.q.shape == (rows, cols) and int(groups.q.max()) <= 15
    ref = dequantize(raw, ggml_type, (rows, cols), torch.float32)
    torch.testing.assert_close(groups.dequantize(), ref, rtol=1e-6, atol=1e-7)


def test_other_types_have_no_int4_groups() -> None:
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    assert int4_groups(raw, T.Q8_0, (4, 32)) is None


def test_q8_0_int8_groups_are_the_stored_values() -> None:
    """Int8Groups of Q8_0 blocks: q * scale equals quants.dequantize() exactly (both are the stored
    int8 times the stored float16 scale in float32); other types have none."""
    rows, cols = 12, 96
    rng = np.random.default_rng(3)
    raw = rng.integers(-127, 128, (rows * cols // 32, 34)).astype(np.int8).view(np.uint8)
    raw[:, :2] = rng.uniform(-0.05, 0.05, (rows * cols // 32, 1)).astype(np.float16).view(np.uint8)
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    groups = int8_groups(blocks, T.Q8_0, (rows, cols))
    assert groups is not None and groups.q.dtype == torch.int8 and groups.scale.shape == (rows, cols // 32)
    expanded = (groups.q.view(rows, -1, 32).float() * groups.scale.unsqueeze(-1)).view(rows, cols)
    assert torch.equal(expanded, dequantize(blocks, T.Q8_0, (rows, cols), torch.float32))
    assert int8_groups(blocks, T.Q8_0, (rows * cols,)) is None  # 1-D: not a matrix
    assert int8_groups(_random_blocks(T.Q4_0, 8, rng), T.Q4_0, (8, 32)) is None


def _q6_k_blocks(num_blocks: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q6_K blocks (ql, qh, int8 sub-block scales, then the float16 super-block scale)."""
    raw = rng.integers(0, 256, (num_blocks, 210), dtype=np.uint8)
    raw[:, 192:208] = rng.integers(-64, 64, (num_blocks, 16)).astype(np.int8).view(np.uint8)
    raw[:, 208:210] = rng.uniform(1e-4, 1e-3, (num_blocks, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(-1).copy())


def test_q6_k_int8_groups_are_the_dequantized_values() -> None:
    """Q6_K as int8 groups of 16 (q - 32, d * scale): q * scale is quants.dequantize() exactly."""
    rows, cols = 6, 512
    blocks = _q6_k_blocks(rows * cols // 256, np.random.default_rng(4))
    groups = int8_groups(blocks, T.Q6_K, (rows, cols))
    assert groups is not None and groups.group_size == 16 and groups.scale.shape == (rows, cols // 16)
    assert int(groups.q.min()) >= -32 and int(groups.q.max()) <= 31
    assert torch.equal(groups.dequantize(), dequantize(blocks, T.Q6_K, (rows, cols), torch.float32))


@pytest.mark.skipif(native.load() is None, reason="the int8 decode path is the native kernel's")
@pytest.mark.parametrize("rows", [1, 5, INT4_MAX_ROWS])
def test_fast_linear_decodes_int8_and_mixed_parts(rows: int) -> None:
    """A fused projection stored in three types (as Q4_K_M files store q/k/v): an int4 part, a Q8_0
    part and a Q6_K part. Decode rows run each part's own kernel. The int8 parts round activations to
    int16 steps (`_int16_bound`); the int4 part gives the same bits as a projection of that part alone."""
    rng = np.random.default_rng(rows)
    cols = 256
    q4 = quantize_int4(torch.randn(32, cols, generator=torch.Generator().manual_seed(rows)))
    q8 = int8_groups(_q8_0_blocks(24 * cols // 32, rng), T.Q8_0, (24, cols))
    q6 = int8_groups(_q6_k_blocks(16 * cols // 256, rng), T.Q6_K, (16, cols))
    assert q8 is not None and q6 is not None
    weight = torch.cat((q4.dequantize(), q8.dequantize(), q6.dequantize()))
    bias = torch.randn(72)
    fast = FastLinear(weight, bias, [(0, 32, q4), (32, 56, q8), (56, 72, q6)])
    assert fast.decode_kernel == "native int4+int8"
    x = torch.randn(rows, cols)
    with torch.no_grad():
        got = fast(x)
        alone = FastLinear(q4.dequantize(), bias[:32], q4)(x)
    want = x @ weight.T + bias
    bound = _int16_bound(x, weight)
    assert bool(((got[:, 32:] - want[:, 32:]).abs() <= bound[:, 32:]).all())
    assert torch.equal(got[:, :32], alone)
    int8_only = FastLinear(weight[32:], bias[32:], [(0, 24, q8), (24, 40, q6)])
    assert int8_only.decode_kernel == "native int8"
    # each part packed in units of 16 rows: 24 -> 32 rows of Q8_0, 16 of Q6_K
    assert int8_only.weight_bytes_read(rows) == 48 * cols + (32 * cols // 32 + 16 * cols // 16) * 4
    with torch.no_grad():
        assert torch.equal(int8_only(x), got[:, 32:])


@pytest.mark.skipif(native.load() is None, reason="the int8 decode path is the native kernel's")
def test_a_q8_0_gguf_decodes_on_its_own_int8_groups(tmp_path: Path) -> None:
    """A whole Q8_0 GGUF (Llama: q/k rows permuted in the file): the streaming load stores every
    projection's int8 groups (un-permuted with the rows), decode rows run them, and each projection
    gives the reference model's float32 product within the int16 activation rounding."""
    from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
    from onecall.formats.hf_config import model_config_from_hf
    from onecall.loading.weights import load_weights
    from onecall.model.decoder import DecoderLM
    from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf

    config = tiny_hf_config("llama")
    files = resolve_model(
        write_tiny_gguf(tmp_path / "q8.gguf", random_state_dict(config, 5), config, weight_type=T.Q8_0)
    )
    mc = model_config_from_hf(load_hf_config_dict(files))
    stored: dict[str, StoredGroups] = {}
    fast = DecoderLM(mc, kernels="fast")
    load_weights(fast, iter_weights(files, torch.float32, stored), stored)
    ref = DecoderLM(mc)
    load_weights(ref, iter_weights(files, torch.float32))
    n = 4 * mc.num_hidden_layers
    assert f"native int8 ({n} of {n} projections, every row)" in fast.kernels, fast.kernels
    x = torch.randn(3, mc.hidden_size)
    for (_, name, owner, attr), (_, _, ref_owner, _) in zip(
        fast.projections(), ref.projections(), strict=True
    ):
        proj, ref_proj = getattr(owner, attr), getattr(ref_owner, attr)
        xin = x if proj.in_features == mc.hidden_size else torch.randn(3, proj.in_features)
        with torch.no_grad():
            got, want = proj(xin), ref_proj(xin)
        bound = _int16_bound(xin, ref_proj.weight) + (0 if ref_proj.bias is None else 1e-6)
        assert bool(((got - want).abs() <= bound).all()), name


@pytest.mark.skipif(native.load() is None, reason="the int8 logits path is the native kernel's")
def test_a_q6_k_output_weight_runs_the_logits_on_its_groups_of_16() -> None:
    """Q4_K_M files store output.weight as Q6_K: the logits head takes its int8 groups of 16 as they
    are (int16 activation steps: `_int16_bound`)."""
    rows, cols = 40, 256
    groups = int8_groups(_q6_k_blocks(rows * cols // 256, np.random.default_rng(6)), T.Q6_K, (rows, cols))
    assert groups is not None
    weight = groups.dequantize()
    head = FastLMHead(weight, groups)
    assert head.kernel == "native q8" and head.q8 is not None and head.q8.group_size == 16
    x = torch.randn(3, cols)
    assert bool(((head(x) - x @ weight.T).abs() <= _int16_bound(x, weight)).all())


def _q8_0_blocks(num_blocks: int, rng: np.random.Generator) -> torch.Tensor:
    raw = rng.integers(-127, 128, (num_blocks, 34)).astype(np.int8).view(np.uint8)
    raw[:, :2] = rng.uniform(-0.05, 0.05, (num_blocks, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(-1).copy())


def _linear(groups: Int4Groups, bias: bool) -> torch.nn.Linear:
    out_features, in_features = groups.q.shape
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(groups.dequantize())
    return lin


@pytest.mark.parametrize("rows", [1, 3, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_within_its_written_tolerance(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    groups = quantize_int4(torch.randn(96, 160))
    lin = _linear(groups, bias)
    fast = FastLinear(lin.weight, lin.bias, groups)
    assert fast.has_decode_kernel
    x = torch.randn(rows, 160)
    with torch.no_grad():
        ref, got = lin(x), fast(x)
    w = groups.dequantize()
    if fast.decode_kernel == "native int4":  # every row, prompt rows too: int16 activation steps
        step = x.view(rows, -1, 32).abs().amax(-1) / 32767
        bound = (step / 2) @ w.abs().view(96, -1, 32).sum(-1).T + 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    elif rows <= INT4_MAX_ROWS:
        s = groups.scale.repeat_interleave(32, dim=1)
        z = groups.offset.repeat_interleave(32, dim=1)
        spread = w.abs() + (s * (groups.q.float() - 8)).abs() + (s * 8 + z).abs()
        bound = 2**-7 * (x.abs() @ spread.T) + 1e-5
    else:
        bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    assert got.shape == ref.shape
    assert bool(((got - ref).abs() <= bound).all()), float(((got - ref).abs() / bound).max())


def test_fast_linear_without_int4_is_float32_everywhere() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 40)
    # groups of 64 (the native kernel takes 32) and 40 rows (torch's int4 kernel wants a multiple of
    # 16): neither 4-bit kernel fits, so no int4 copy is kept even though one is offered
    fast = FastLinear(lin.weight, lin.bias, quantize_int4(lin.weight.detach(), group_size=64))
    assert not fast.has_decode_kernel
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "int8_group"),
    [("qwen2", 0), ("qwen3", 0), ("qwen2", 32), ("qwen3", 16)],  # qwen3: q/k norms in the native RoPE pass
)
def test_engine_greedy_tokens_match_the_reference_path(arch: str, int8_group: int) -> None:
    prompts = {f"r{i}": f"Tell me about the number {i}, please." for i in range(3)}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    ref = run_all(int4_engine("reference", arch=arch, int8_group=int8_group), prompts, params)
    fast = run_all(int4_engine("fast", arch=arch, int8_group=int8_group), prompts, params)
    for rid in prompts:
        assert fast[rid].token_ids == ref[rid].token_ids
        diffs = [abs(a - b) for a, b in zip(fast[rid].logprobs, ref[rid].logprobs, strict=True)]
        # the prompt's logits, a prefill chunk of > INT4_MAX_ROWS rows: float32 on oneDNN (summation
        # order only), or, where the native kernel takes every row of a 4-bit weight, int16 activation
        # steps (2^-15 of each group's largest value; 8e-4 to 1.5e-3 measured on logits of ~50 here)
        assert diffs[0] < (1e-2 if native.load() is not None else 1e-4)
        assert max(diffs) < 0.5  # decode rows: bfloat16 activations on logits of magnitude ~50 here


@pytest.mark.slow
def test_embedded_gguf_packs_while_loading_with_its_own_int4_groups() -> None:
    """The streaming load (pack_on_load) of the real 4-bit GGUF: every projection gets the file's own
    int4 groups, no dense projection weight is left in the model, and a prefill (> INT4_MAX_ROWS rows:
    the native int4 kernel with int16 activation steps, else oneDNN float32) matches the reference
    kernels' top logprobs (1e-2 with int16 steps: 1.4e-3 measured over 30 layers; else 1e-3)."""
    from onecall.config import EngineConfig
    from onecall.engine.engine_parts import load_engine_parts

    fast = load_engine_parts(EngineConfig(kernels="fast", kv_cache_gib=0.05))
    ref = load_engine_parts(EngineConfig(kernels="reference", kv_cache_gib=0.05))
    num_layers = fast.model_config.num_hidden_layers
    n = 4 * num_layers
    projections, logits_kernel, step = (
        (f"native int4 ({n} of {n} projections, every row)", "native q8", ", native decode step")
        if native.load()
        else (f"onednn float32 + torch int4 decode ({n} of {n} projections)", "onednn float32", "")
    )
    # the embedded GGUF's tied embedding is Q8_0: kept as int8
    assert fast.kernels == f"{projections}, {logits_kernel} logits{step}"
    assert (fast.model.native_step is not None) == bool(step)
    head = fast.model.fast_lm_head
    if head is not None and head.q8 is not None:
        # the file's own Q8_0 groups, taken as stored: re-quantizing the expanded weight finds them again
        q, scale = native.quantize_q8_groups(ref.model.output_weight())
        want = native.pack_q8_blocked(q, scale)
        assert torch.equal(head.q8.qs, want.qs)
        torch.testing.assert_close(head.q8.scale, want.scale, rtol=2**-20, atol=0)
        # ... and the tied embedding is looked up in those bytes: no float32 table, the same rows
        embed = fast.model.model.embed_tokens
        assert isinstance(embed, StoredEmbedding) and embed.table is head.q8 and head.from_stored
        ids_all = torch.arange(fast.model.vocab_size)
        assert torch.equal(embed(ids_all), ref.model.model.embed_tokens(ids_all))
    assert not any(name.endswith(("proj.weight",)) for name, _ in fast.model.named_parameters())
    ids = fast.tokenizer.encode("The streaming loader packs each projection as it arrives. " * 3)
    assert len(ids) > INT4_MAX_ROWS
    logits = {}
    for name, parts in (("fast", fast), ("ref", ref)):
        engine = Engine(EngineConfig(kernels=name if name == "fast" else "reference"), parts=parts)
        engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
        (out,) = [o for o in engine.step() if o.finished]
        logits[name] = out
    assert logits["fast"].token_ids == logits["ref"].token_ids
    got = dict(logits["fast"].top_logprobs[0])
    want = dict(logits["ref"].top_logprobs[0])
    assert set(got) == set(want)
    tolerance = 1e-2 if native.load() is not None else 1e-3
    for token, lp in want.items():
        assert abs(got[token] - lp) < tolerance, (token, got[token], lp)


@pytest.mark.slow
def test_gguf_4bit_tensors_need_no_float32_copy() -> None:
    """With expand_stored=False the GGUF loader yields each 4-bit or int8 tensor as a meta tensor (no
    float32 expansion) with its groups stored; the engine's load packs the projections from those
    groups alone and expands anything else (here: the embedding, stored as Q8_0)."""
    from onecall.formats.checkpoint import iter_weights, resolve_model
    from onecall.formats.quants import Int4Groups

    stored: dict[str, object] = {}
    tensors = dict(iter_weights(resolve_model(None), torch.float32, stored, expand_stored=False))  # type: ignore[arg-type]
    meta = [name for name, t in tensors.items() if t.is_meta]
    assert meta and all(name in stored for name in meta)
    assert {name for name in meta if not name.endswith("_proj.weight")} == {"model.embed_tokens.weight"}
    assert all(isinstance(stored[name], Int4Groups) for name in meta if name.endswith("_proj.weight"))
    assert not any(t.is_meta for name, t in tensors.items() if name not in stored)
