"""GGUF reading: dequantization per type, metadata, names, llama's Q/K un-permutation.

References, independent of onecall/formats/gguf.py:
  * blocks packed here from logical values (scales, mins, small ints) following ggml's
    block layouts (ggml-common.h / ggml-quants.c), with the expected floats computed from
    the logical values, not by decoding bytes; checked exactly (same float32 operation order);
  * gguf.quants.dequantize (llama.cpp's numpy reference) on the same bytes, exactly;
  * for the embedded SmolLM2 file: gguf.GGUFReader's metadata and tensor data, and
    transformers' GGUF processor for the inverse Q/K permutation and tensor names.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.gguf import SUPPORTED_QUANT_TYPES, GGUFFile, hf_tensor_name
from onecall.formats.hf_config import model_config_from_hf
from tests.helpers.make_models import gguf_tensor_name, random_state_dict, tiny_hf_config, write_tiny_gguf

T = GGMLQuantizationType
f32 = np.float32
rng = np.random.default_rng(1234)


def _f16_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def _f16(x: float) -> np.float32:  # the scale's value once stored as f16
    return f32(np.float16(x))


def _scale() -> float:
    return float(rng.uniform(0.001, 0.05) * rng.choice([-1, 1]))


# ---------------------------------------------------------------- one block per type, from the spec
# Each packer returns (block bytes, expected float32 values of the block's elements).


def _pack_q8_0() -> tuple[bytes, np.ndarray]:
    d, q = _scale(), rng.integers(-128, 128, 32)
    return _f16_bytes(d) + q.astype(np.int8).tobytes(), _f16(d) * q.astype(f32)


def _pack_32_nibbles(q: np.ndarray) -> bytes:  # element j in byte j's low nibble, j+16 in its high one
    return bytes(int(q[j] & 15) | int(q[j + 16] & 15) << 4 for j in range(16))


def _pack_q4_0() -> tuple[bytes, np.ndarray]:
    d, q = _scale(), rng.integers(0, 16, 32)
    return _f16_bytes(d) + _pack_32_nibbles(q), _f16(d) * (q - 8).astype(f32)


def _pack_q4_1() -> tuple[bytes, np.ndarray]:
    d, m, q = _scale(), _scale(), rng.integers(0, 16, 32)
    return _f16_bytes(d) + _f16_bytes(m) + _pack_32_nibbles(q), _f16(d) * q.astype(f32) + _f16(m)


def _high_bits_u32(q: np.ndarray) -> bytes:  # bit j of a little-endian uint32 = bit 4 of element j
    return struct.pack("<I", sum(int(q[j] >> 4) << j for j in range(32)))


def _pack_q5_0() -> tuple[bytes, np.ndarray]:
    d, q = _scale(), rng.integers(0, 32, 32)
    raw = _f16_bytes(d) + _high_bits_u32(q) + _pack_32_nibbles(q)
    return raw, _f16(d) * (q - 16).astype(f32)


def _pack_q5_1() -> tuple[bytes, np.ndarray]:
    d, m, q = _scale(), _scale(), rng.integers(0, 32, 32)
    raw = _f16_bytes(d) + _f16_bytes(m) + _high_bits_u32(q) + _pack_32_nibbles(q)
    return raw, _f16(d) * q.astype(f32) + _f16(m)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """8 six-bit scales and mins in 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-7,
    sub-blocks 4-7 split into a low nibble (bytes 8-11) and 2 high bits (top of bytes 0-7)."""
    out = [0] * 12
    for j in range(4):
        out[j] = int(sc[j]) | (int(sc[j + 4]) >> 4) << 6
        out[j + 4] = int(mn[j]) | (int(mn[j + 4]) >> 4) << 6
        out[j + 8] = (int(sc[j + 4]) & 15) | (int(mn[j + 4]) & 15) << 4
    return bytes(out)


def _pack_k4_nibbles(q: np.ndarray) -> bytes:  # chunk c: sub-block 2c low nibbles, 2c+1 high
    return bytes(
        int(q[64 * c + j] & 15) | int(q[64 * c + 32 + j] & 15) << 4 for c in range(4) for j in range(32)
    )


def _expected_k(d: float, dmin: float, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    sub = np.arange(256) // 32
    return (_f16(d) * sc[sub].astype(f32)) * q.astype(f32) - _f16(dmin) * mn[sub].astype(f32)


def _pack_q4_k() -> tuple[bytes, np.ndarray]:
    d, dmin = abs(_scale()), abs(_scale())
    sc, mn, q = rng.integers(0, 64, 8), rng.integers(0, 64, 8), rng.integers(0, 16, 256)
    raw = _f16_bytes(d) + _f16_bytes(dmin) + _pack_k4_scales(sc, mn) + _pack_k4_nibbles(q)
    return raw, _expected_k(d, dmin, sc, mn, q)


def _pack_q5_k() -> tuple[bytes, np.ndarray]:
    d, dmin = abs(_scale()), abs(_scale())
    sc, mn, q = rng.integers(0, 64, 8), rng.integers(0, 64, 8), rng.integers(0, 32, 256)
    qh = bytes(sum(int(q[32 * s + j] >> 4) << s for s in range(8)) for j in range(32))  # bit s: sub-block s
    raw = _f16_bytes(d) + _f16_bytes(dmin) + _pack_k4_scales(sc, mn) + qh + _pack_k4_nibbles(q)
    return raw, _expected_k(d, dmin, sc, mn, q)


def _pack_q6_k() -> tuple[bytes, np.ndarray]:
    """Element 128h + 32k + j: low nibble in ql[64h + j + 32(k % 2)] (high half of the byte if
    k >= 2), top 2 bits at bits 2k..2k+1 of qh[32h + j]; scale sc[(128h + 32k + j) // 16]."""
    d, sc, q = _scale(), rng.integers(-128, 128, 16), rng.integers(0, 64, 256)
    ql, qh = [0] * 128, [0] * 64
    for i in range(256):
        h, k, j = i // 128, (i % 128) // 32, i % 32
        ql[64 * h + j + 32 * (k % 2)] |= (int(q[i]) & 15) << (4 * (k // 2))
        qh[32 * h + j] |= (int(q[i]) >> 4) << (2 * k)
    raw = bytes(ql) + bytes(qh) + sc.astype(np.int8).tobytes() + _f16_bytes(d)
    expected = (_f16(d) * sc[np.arange(256) // 16].astype(f32)) * (q - 32).astype(f32)
    return raw, expected


def _pack_2bit(q: np.ndarray) -> bytes:  # element 128h + 32s + l in bits 2s..2s+1 of byte 32h + l
    return bytes(sum(int(q[128 * h + 32 * s + j] & 3) << (2 * s) for s in range(4)) for h in range(2) for j in range(32))


def _pack_q2_k() -> tuple[bytes, np.ndarray]:
    """Per 16 elements a byte: scale (low nibble), min (high); d * scale * q - dmin * min, q in 0..3."""
    d, dmin, sc, q = abs(_scale()), abs(_scale()), rng.integers(0, 256, 16), rng.integers(0, 4, 256)
    raw = bytes(sc.astype(np.uint8)) + _pack_2bit(q) + _f16_bytes(d) + _f16_bytes(dmin)
    sub = np.arange(256) // 16
    expected = (_f16(d) * (sc[sub] & 15).astype(f32)) * q.astype(f32) - _f16(dmin) * (sc[sub] >> 4).astype(f32)
    return raw, expected


def _pack_q3_k() -> tuple[bytes, np.ndarray]:
    """Values q - 4 for q in 0..7: bit 2 of q in hmask (element 32j + l: bit j of byte l), the low two
    bits as Q2_K's; 16 six-bit scales s (value d * (s - 32)): low nibbles in bytes 0-7 (scales 0-7 low,
    8-15 high), their top two bits in bytes 8-11 (scale 4k + j at bits 2k of byte 8 + j)."""
    d, s, q = _scale(), rng.integers(0, 64, 16), rng.integers(0, 8, 256)
    hmask = bytes(sum(int(q[32 * j + e] >> 2) << j for j in range(8)) for e in range(32))
    scales = [int(s[i] & 15) | int(s[i + 8] & 15) << 4 for i in range(8)]
    scales += [sum(int(s[4 * k + j] >> 4) << (2 * k) for k in range(4)) for j in range(4)]
    raw = hmask + _pack_2bit(q) + bytes(scales) + _f16_bytes(d)
    return raw, (_f16(d) * (s[np.arange(256) // 16] - 32).astype(f32)) * (q - 4).astype(f32)


_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=f32)


def _pack_iq4_nl() -> tuple[bytes, np.ndarray]:
    d, q = _scale(), rng.integers(0, 16, 32)
    return _f16_bytes(d) + _pack_32_nibbles(q), _f16(d) * _IQ4[q]


def _pack_iq4_xs() -> tuple[bytes, np.ndarray]:
    """8 sub-blocks of 32 with 6-bit scales s (d * (s - 32)): the low nibbles two a byte, the top two
    bits of sub-block i at bits 2i of a u16; each sub-block's codebook indices as IQ4_NL's."""
    d, s, q = _scale(), rng.integers(0, 64, 8), rng.integers(0, 16, 256)
    scales_h = struct.pack("<H", sum(int(s[i] >> 4) << (2 * i) for i in range(8)))
    scales_l = bytes(int(s[2 * j] & 15) | int(s[2 * j + 1] & 15) << 4 for j in range(4))
    qs = b"".join(_pack_32_nibbles(q[32 * i : 32 * i + 32]) for i in range(8))
    expected = (_f16(d) * (s[np.arange(256) // 32] - 32).astype(f32)) * _IQ4[q]
    return _f16_bytes(d) + scales_h + scales_l + qs, expected


def _pack_mxfp4() -> tuple[bytes, np.ndarray]:
    """An e8m0 exponent byte e (2^(e - 127)), 32 e2m1 values as IQ4_NL's nibbles."""
    e, q = int(rng.integers(110, 140)), rng.integers(0, 16, 32)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=f32)
    return bytes([e]) + _pack_32_nibbles(q), np.ldexp(f32(1), e - 127).astype(f32) * e2m1[q]


def _pack_f32() -> tuple[bytes, np.ndarray]:
    x = rng.standard_normal(1).astype(f32)
    return x.tobytes(), x


def _pack_f16() -> tuple[bytes, np.ndarray]:
    x = rng.standard_normal(1).astype(np.float16)
    return x.tobytes(), x.astype(f32)


def _pack_bf16() -> tuple[bytes, np.ndarray]:
    bits = (rng.standard_normal(1).astype(f32).view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
    return bits.tobytes(), (bits.astype(np.uint32) << 16).view(f32)


PACKERS: dict[T, Callable[[], tuple[bytes, np.ndarray]]] = {
    T.F32: _pack_f32, T.F16: _pack_f16, T.BF16: _pack_bf16,
    T.Q8_0: _pack_q8_0, T.Q4_0: _pack_q4_0, T.Q4_1: _pack_q4_1, T.Q5_0: _pack_q5_0, T.Q5_1: _pack_q5_1,
    T.Q4_K: _pack_q4_k, T.Q5_K: _pack_q5_k, T.Q6_K: _pack_q6_k, T.Q2_K: _pack_q2_k, T.Q3_K: _pack_q3_k,
    T.IQ4_NL: _pack_iq4_nl, T.IQ4_XS: _pack_iq4_xs, T.MXFP4: _pack_mxfp4,
}  # fmt: skip


def _write_raw_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, T]]) -> Path:
    """A GGUF holding raw (already quantized) tensors: name -> (uint8 (rows, row_bytes), type)."""
    writer = GGUFWriter(str(path), arch)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_supported_types_cover_the_contract() -> None:
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= SUPPORTED_QUANT_TYPES
    assert set(PACKERS) == set(SUPPORTED_QUANT_TYPES)  # every supported type is tested below


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
def test_dequantize_hand_packed_blocks(qtype: T, tmp_path: Path) -> None:
    # 3 rows x 2 blocks (a 2-D weight; float types: 3 x 64 elements)
    num_blocks = 2 if qtype not in (T.F32, T.F16, T.BF16) else 64
    blocks = [[PACKERS[qtype]() for _ in range(num_blocks)] for _ in range(3)]
    raw = np.array([list(b"".join(b for b, _ in row)) for row in blocks], dtype=np.uint8)
    expected = torch.from_numpy(np.stack([np.concatenate([e for _, e in row]) for row in blocks]))
    _write_raw_gguf(tmp_path / "q.gguf", "qwen2", {"blk.0.ffn_up.weight": (raw, qtype)})

    [(name, got)] = list(GGUFFile(tmp_path / "q.gguf").iter_tensors(torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.equal(got, expected)  # same float32 operation order as ggml: exact
    reference = gguf_dequantize(raw, qtype).reshape(expected.shape)
    assert torch.equal(got, torch.from_numpy(reference))
    [(_, got_bf16)] = list(GGUFFile(tmp_path / "q.gguf").iter_tensors(torch.bfloat16))
    assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, expected.to(torch.bfloat16))


def test_unsupported_quant_type_is_refused_by_name(tmp_path: Path) -> None:
    raw = np.zeros((2, 74), dtype=np.uint8)  # one IQ2_XS block (256 elements, 74 bytes) per row
    _write_raw_gguf(tmp_path / "iq2.gguf", "llama", {"blk.0.ffn_up.weight": (raw, T.IQ2_XS)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XS"):
        next(GGUFFile(tmp_path / "iq2.gguf").iter_tensors(torch.float32))


def test_unknown_tensor_name_is_refused(tmp_path: Path) -> None:
    raw = np.zeros((2, 34), dtype=np.uint8)
    _write_raw_gguf(tmp_path / "x.gguf", "llama", {"blk.0.ffn_gate_exps.weight": (raw, T.Q8_0)})
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        next(GGUFFile(tmp_path / "x.gguf").iter_tensors(torch.float32))


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    )  # a tensor promised, none there
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        GGUFFile(tmp_path / "bad.gguf")


def test_metadata_decodes_every_value_type(tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    tokenizer = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"tok{i}" for i in range(96)] + ["é", "<|im_end|>"],
        "tokenizer.ggml.token_type": [1] * 98,
        "tokenizer.ggml.merges": ["t o", "to k"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config), config, tokenizer=tokenizer)
    meta = GGUFFile(path).metadata
    for key, value in tokenizer.items():
        assert meta[key] == value and type(meta[key]) is type(value), key
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # float32 shown as its shortest decimal
    assert meta["llama.block_count"] == 2 and isinstance(meta["llama.block_count"], int)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_names_invert_llama_cpp_mapping(arch: str) -> None:
    # gguf-py's TensorNameMap is the table llama.cpp's converter renames HF tensors with.
    config = tiny_hf_config(arch, attention_bias=True)
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for hf_name in random_state_dict(config) | {"lm_head.weight": torch.zeros(1)}:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None and hf_tensor_name(gguf_name) == hf_name
        assert gguf_tensor_name(hf_name) == gguf_name  # the test helper's writer agrees


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_round_trip(arch: str, tmp_path: Path) -> None:
    # llama: Q/K permuted by the writer as llama.cpp does; qwen2: q/k/v biases, tied
    # embeddings; qwen3: q/k norms and head_dim (16) != hidden_size / heads (8).
    config = tiny_hf_config(arch)
    state = random_state_dict(config, seed=7)
    files = resolve_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", state, config))
    got = dict(iter_weights(files, torch.float32))
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    gguf_config = load_hf_config_dict(files)
    assert model_config_from_hf(gguf_config) == model_config_from_hf(config)


def test_quantized_tiny_llama_matches_gguf_reference(tmp_path: Path) -> None:
    # Q8_0 blocks run along rows, so the Q/K row permutation commutes with quantization.
    config = tiny_hf_config("llama")
    state = random_state_dict(config, seed=3)
    path = write_tiny_gguf(tmp_path / "q8.gguf", state, config, weight_type=T.Q8_0)
    got = dict(GGUFFile(path).iter_tensors(torch.float32))
    for name, tensor in state.items():
        expected = tensor.numpy()
        if tensor.ndim == 2:
            expected = gguf_dequantize(gguf_quantize(expected, T.Q8_0), T.Q8_0)
        assert torch.equal(got[name], torch.from_numpy(expected)), name
        assert torch.allclose(got[name], tensor, atol=0.01)  # and close to the original


# ---------------------------------------------------------------- the embedded SmolLM2 file
# Q8_0 embedding, Q4_1 projections (Q/K permuted), an F32 norm; all early in the file, so the
# tensor iteration can stop after a few layers.
SMOLLM2_CHECKED = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight",
                   "blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.ffn_down.weight"]  # fmt: skip


@pytest.mark.slow
def test_embedded_smollm2_against_transformers() -> None:
    """Config, names and a few tensors of the default model: Q8_0/Q4_1/F32 dequantized by gguf's
    numpy reference, Q/K un-permuted by transformers' GGUF loader (LlamaTensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # 1. config
    files = resolve_model(None)
    assert files.kind == "gguf" and files.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = load_hf_config_dict(files)
    expected_cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                    "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
                    "tie_word_embeddings": True, "head_dim": 64, "intermediate_size": 1536}  # fmt: skip
    assert {k: cfg[k] for k in expected_cfg} == expected_cfg
    assert "rope_scaling" not in cfg and model_config_from_hf(cfg).architecture == "llama"

    # 2. names: llama.cpp's own HF -> GGUF name map, inverted, over all 272 tensors
    gguf = GGUFFile(files.path)
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    assert len(gguf.tensor_names()) == 272
    for name in gguf.tensor_names():
        assert name_map.get_name(hf_tensor_name(name), try_suffixes=(".weight", ".bias")) == name

    # 3. tensors
    processor = LlamaTensorProcessor(config=cfg)
    wanted = {hf_tensor_name(n) for n in SMOLLM2_CHECKED}
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in gguf.iter_tensors(torch.float32):
        if name in wanted:
            ours[name] = tensor
        if len(ours) == len(wanted):
            break
    for info in gguf.tensors:
        if info.name in SMOLLM2_CHECKED:
            raw = gguf.raw_data(info).numpy().reshape(*info.shape[:-1], -1)
            weights = gguf_dequantize(raw, T(info.ggml_type)).reshape(info.shape)
            weights = processor.process(weights=weights, name=info.name).weights
            expected = torch.from_numpy(np.array(weights))
            got = ours[hf_tensor_name(info.name)]
            assert got.shape == expected.shape and (got - expected).abs().max() <= 1e-6, info.name


@pytest.mark.slow
def test_embedded_smollm2_matches_gguf_reader() -> None:
    """Our header parse of a file written by llama.cpp vs gguf's GGUFReader: every metadata
    field (tokens, merges, chat template...) and the tensor directory. GGUFReader's parse
    dominates this test (~7 s on an idle 2-core machine)."""
    from gguf import GGUFReader

    path = resolve_model(None).path
    reader, ours = GGUFReader(path), GGUFFile(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == ours.metadata.keys()
    for key, value in fields.items():
        if isinstance(value, float):  # we show float32 as its shortest decimal
            assert np.float32(ours.metadata[key]) == np.float32(value), key
        else:
            assert ours.metadata[key] == value, key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [
        (t.name, t.tensor_type.value, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
    ] == [(t.name, t.ggml_type, t.shape) for t in ours.tensors]
    for info, tensor in zip(ours.tensors, reader.tensors, strict=True):
        if info.name in SMOLLM2_CHECKED:
            assert np.array_equal(ours.raw_data(info).numpy(), tensor.data.view(np.uint8).reshape(-1))


def test_our_ggml_tables_agree_with_the_gguf_package() -> None:
    """onecall.formats.ggml_types restates the spec's tags so loading need not import `gguf`."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGUFValueType as TheirValueType

    from onecall.formats.ggml_types import (
        GGML_BLOCK_SIZES,
        GGML_TYPE_SIZES,
        GGMLType,
        GGUFValueType,
        ggml_type_name,
    )

    for t in GGMLType:
        assert GGMLQuantizationType[t.name] == t.value
        assert GGML_BLOCK_SIZES[t] == GGML_QUANT_SIZES[GGMLQuantizationType(t.value)]
    # every type a file may hold (so the reader can bounds-check tensors it will not load), sized alike
    assert {
        int(t): (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()
    }.items() <= GGML_TYPE_SIZES.items()
    assert {v.name: v.value for v in GGUFValueType} == {v.name: v.value for v in TheirValueType}
    assert ggml_type_name(int(GGMLQuantizationType.IQ2_XS)) == "IQ2_XS"
    assert ggml_type_name(9999) == "unknown type id 9999"
