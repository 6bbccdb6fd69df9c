"""Hostile GGUF files: every malformed file is a typed error naming the problem, never a raw exception.

Two fuzzers, both deterministic:

  * a seeded mutation loop over files the test writer (tests/helpers/make_models.py, llama.cpp's
    layout) produces: a spec-following walker, written here independently of onecall/formats/gguf.py,
    lists every numeric header field (counts, lengths, type tags, dimensions, offsets); each mutant
    sets one to three of them to a boundary value (0, 1, 2**31, 2**63 - 1, 2**64 - 1, the file's
    size, ...), or overwrites header bytes, cuts the file short, or drops or repeats a span of the
    header so that everything after it shifts;
  * hypothesis, building files from scratch with the spec's encoding: a tiny model's metadata with up
    to four of the keys a config is read from (or general.alignment, split.count, the token ids...)
    holding any GGUF value (wrong types, zeros, NaN, nested arrays), and a few tensors the loader
    knows by name, of random types and shapes.

Each file is loaded as a model would be: opened (which may raise only ModelFileError), its config
built and checked, its tensors dequantized (which may raise only UnsupportedModelError: a mutated
architecture name or head count is an unsupported model, not a malformed file).
"""

from __future__ import annotations

import math
import random
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from onecall.errors import ModelFileError, UnsupportedModelError
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import gguf_config_dict
from onecall.formats.hf_config import model_config_from_hf
from tests.helpers.make_models import llama3_rope_freqs, random_state_dict, tiny_hf_config, write_tiny_gguf

NUM_MUTANTS = 5000
# GGUF value types: scalar type -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


def load_like_a_model(path: Path) -> None:
    """Open (only ModelFileError may come out), then build the config and dequantize every tensor
    (only UnsupportedModelError)."""
    try:
        gguf = GGUFFile(path)
    except ModelFileError as e:
        assert str(path) in str(e)
        return
    assert isinstance(gguf.metadata, dict)
    assert all(t.nbytes > 0 and t.offset + t.nbytes <= path.stat().st_size for t in gguf.tensors)
    try:
        model_config_from_hf(gguf_config_dict(gguf))
        for _ in gguf.iter_tensors(torch.float32):
            pass
    except UnsupportedModelError:
        pass


# ---------------------------------------------------------------- mutations of the writer's files


def header_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every numeric field of a valid GGUF header, walked per the specification."""
    fields = [(4, 4), (8, 8), (16, 8)]  # version, tensor count, key/value count
    num_tensors, num_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == _STRING:
            string()
        elif vtype == _ARRAY:
            fields.extend([(pos, 4), (pos + 4, 8)])
            item_type, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                value(item_type)
        else:
            fields.append((pos, struct.calcsize(_SCALARS[vtype])))
            pos += fields[-1][1]

    for _ in range(num_kv):
        string()
        fields.append((pos, 4))
        pos += 4
        value(struct.unpack_from("<I", data, pos - 4)[0])
    for _ in range(num_tensors):
        string()
        num_dims = struct.unpack_from("<I", data, pos)[0]
        fields.extend([(pos, 4), *((pos + 4 + 8 * d, 8) for d in range(num_dims))])
        pos += 4 + 8 * num_dims
        fields.extend([(pos, 4), (pos + 4, 8)])  # type, offset
        pos += 12
    return fields


def seed_files(folder: Path) -> list[bytes]:
    """Small valid files: a llama with a tokenizer and llama3 RoPE factors, a Q8_0 qwen3."""
    llama = tiny_hf_config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})  # fmt: skip
    tokenizer = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(96)],
        "tokenizer.ggml.token_type": [1] * 96,
        "tokenizer.chat_template": "{{ messages }}",
    }
    qwen3 = tiny_hf_config("qwen3")
    paths = [
        write_tiny_gguf(
            folder / "llama.gguf",
            random_state_dict(llama),
            llama,
            tokenizer=tokenizer,
            extra_tensors={"rope_freqs.weight": llama3_rope_freqs(llama)},
        ),  # fmt: skip
        write_tiny_gguf(
            folder / "qwen3.gguf", random_state_dict(qwen3), qwen3, weight_type=GGMLQuantizationType.Q8_0
        ),
    ]
    return [p.read_bytes() for p in paths]


_BOUNDARY = [0, 1, 2, 3, 4, 7, 9, 12, 13, 31, 32, 33, 255, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
             2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]  # fmt: skip


def mutate(data: bytes, fields: list[tuple[int, int]], rng: random.Random) -> bytes:
    out = bytearray(data)
    header_end = max(offset + size for offset, size in fields)
    kind = rng.random()
    if kind < 0.6:  # one to three header fields set to a boundary value (or near the file's size)
        for _ in range(rng.choice((1, 1, 2, 3))):
            offset, size = rng.choice(fields)
            value = rng.choice([*_BOUNDARY, len(data), len(data) - offset, rng.getrandbits(8 * size)])
            value = (value + rng.choice((0, 0, -1, 1))) % 2 ** (8 * size)
            out[offset : offset + size] = value.to_bytes(size, "little")
    elif kind < 0.75:  # random header bytes
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(header_end)] = rng.randrange(256)
    elif kind < 0.85:  # cut short
        del out[rng.randrange(len(out)) :]
    else:  # a span of the header dropped or repeated: everything after it shifts
        start = rng.randrange(header_end)
        span = bytes(out[start : start + rng.randint(1, 16)])
        out[start : start + len(span)] = b"" if rng.random() < 0.5 else span * 2
    return bytes(out)


@pytest.mark.slow
def test_mutated_files_fail_cleanly(tmp_path: Path) -> None:
    seeds = seed_files(tmp_path)
    fields = [header_fields(data) for data in seeds]
    rng = random.Random(24)
    for i in range(NUM_MUTANTS):
        mutant = mutate(seeds[i % len(seeds)], fields[i % len(seeds)], rng)
        path = tmp_path / f"mutant{i}.gguf"
        path.write_bytes(mutant)
        try:
            load_like_a_model(path)
        except Exception as e:
            raise AssertionError(f"mutant {i} raised {type(e).__name__}: {e}") from e
        path.unlink()


# ---------------------------------------------------------------- files built from scratch
# A valid tiny model's metadata, some keys replaced by any GGUF value, and a small tensor directory laid
# out as llama.cpp's writer does (aligned, in order).

_BASE = {"embedding_length": 32, "attention.head_count": 4, "attention.head_count_kv": 2, "block_count": 1,
         "attention.key_length": 8, "attention.value_length": 8, "context_length": 64, "vocab_size": 16,
         "feed_forward_length": 64, "expert_count": 2, "expert_used_count": 1, "expert_feed_forward_length": 32}  # fmt: skip
_OTHER_KEYS = ["rope.dimension_count", "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_gating_func",
               "attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping",
               "rope.freq_base_swa", "expert_weights_norm", "expert_shared_count", "rope.scaling.type",
               "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
               "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast"]  # fmt: skip
_GLOBAL_KEYS = ["general.alignment", "split.count", "split.no", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.tokens", "phi3.context_length"]  # fmt: skip
_TENSORS = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
            "blk.0.attn_norm.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight",
            "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"]  # fmt: skip
_TYPE_IDS = [0, 0, 0, 1, 30, 8, 2, 12, 14, 17]  # mostly F32; IQ2_XS (17) cannot be loaded
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 12: (256, 144), 14: (256, 210),
               17: (256, 74)}  # fmt: skip
_RANGES = {0: (0, 255), 1: (-128, 127), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1), 4: (0, 2**32 - 1),
           5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1)}  # fmt: skip


def _encode(vtype: int, value: Any) -> bytes:
    if vtype == _STRING:
        raw = value.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == _ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(_encode(item_type, v) for v in items)
    return struct.pack(_SCALARS[vtype], value)


_scalars = st.one_of(
    st.tuples(st.just(4), st.integers(0, 5)),  # small counts: zeros, ones, odd head counts
    st.sampled_from(list(_RANGES)).flatmap(lambda t: st.tuples(st.just(t), st.integers(*_RANGES[t]))),
    st.tuples(st.sampled_from([6, 12]), st.floats(width=32)),  # NaN, infinities
    st.tuples(st.just(7), st.booleans()),
    st.tuples(st.just(_STRING), st.sampled_from(["linear", "yarn", "none", ""]) | st.text(max_size=6)),
)
# any GGUF value: mostly a scalar, else an array of items of one type (arrays nest)
_arrays = st.recursive(
    _scalars,
    lambda inner: inner.flatmap(
        lambda first: st.lists(st.just(first), max_size=3).map(
            lambda items: (_ARRAY, (first[0], [v for _, v in items]))
        )
    ),
    max_leaves=6,
)
_values = st.one_of(_scalars, _scalars, _scalars, _arrays)


@st.composite
def _gguf_bytes(draw: st.DrawFn) -> bytes:
    arch = draw(st.sampled_from(["llama", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3"]))
    metadata = {"general.architecture": (_STRING, arch)} | {f"{arch}.{k}": (4, v) for k, v in _BASE.items()}
    keys = [f"{arch}.{k}" for k in [*_BASE, *_OTHER_KEYS]] + _GLOBAL_KEYS
    for key in draw(st.lists(st.sampled_from(keys), unique=True, max_size=4)):
        metadata[key] = draw(_values)
    tensors, data_size = [], 0
    for name in draw(st.lists(st.sampled_from(_TENSORS), max_size=3, unique=True)):
        type_id = draw(st.sampled_from(_TYPE_IDS))
        block_size, type_size = _TYPE_SIZES[type_id]
        dims = [block_size * draw(st.sampled_from([1, 2, 8]))]  # innermost: whole blocks
        dims += draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), max_size=2))
        tensors.append((name, dims, type_id, data_size))
        nbytes = math.prod(dims) // block_size * type_size
        data_size += nbytes + -nbytes % 32
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, (vtype, value) in metadata.items():
        out += [_encode(_STRING, key), struct.pack("<I", vtype), _encode(vtype, value)]
    for name, dims, type_id, offset in tensors:
        out += [_encode(_STRING, name), struct.pack(f"<I{len(dims)}Q", len(dims), *dims),
                struct.pack("<IQ", type_id, offset)]  # fmt: skip
    header = b"".join(out)
    return header + bytes(-len(header) % 32) + bytes(data_size)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(data=_gguf_bytes())
def test_files_built_from_scratch_fail_cleanly(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "x.gguf"
        path.write_bytes(data)
        load_like_a_model(path)


# ---------------------------------------------------------------- named cases: the three, then each bound


def _file(
    kvs: bytes = b"", tensors: list[tuple[str, list[int], int, int]] | None = None, num_kv: int = 1
) -> bytes:
    """A GGUF v3 file: encoded key/values, tensor infos (name, dims, type id, offset), 256 data bytes."""
    infos = [_encode(_STRING, name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
             for name, dims, type_id, offset in tensors or []]  # fmt: skip
    return b"GGUF" + struct.pack("<IQQ", 3, len(infos), num_kv) + kvs + b"".join(infos) + bytes(256)


def _kv(key: str, vtype: int, value: Any) -> bytes:
    return _encode(_STRING, key) + struct.pack("<I", vtype) + _encode(vtype, value)


_ARCH = _kv("general.architecture", _STRING, "llama")
_DEEP = _encode(_STRING, "deep") + struct.pack("<I", _ARRAY) + struct.pack("<IQ", _ARRAY, 1) * 5000


@pytest.mark.parametrize(
    ("data", "match"),
    [  # what each raised before, where it was not already a typed error:
        pytest.param(  # the product wrapped to 0 bytes: the file opened, loading it raised ValueError
            _file(_ARCH, [("token_embd.weight", [2**40, 2**40], 0, 0)]),
            r"tensor 'token_embd\.weight' has dimensions \[1099511627776, 1099511627776\] whose product overflows",
            id="dims-overflow",
        ),
        pytest.param(  # ZeroDivisionError
            _file(_kv("general.alignment", 4, 0)),
            "general.alignment must be a power of two, got 0",
            id="alignment-0",
        ),
        pytest.param(_file(_kv("general.alignment", 4, 48)), "power of two, got 48", id="alignment-48"),
        pytest.param(  # RecursionError
            _file(_DEEP), r"metadata key 'deep'(\[0\]){7} nests arrays over 8 deep", id="nested-arrays"
        ),
        pytest.param(
            _file(num_kv=2**62),
            r"the header \(with 4611686018427387904 key/values and 0 tensor infos\)",
            id="kv-count",
        ),
        pytest.param(
            _file(_encode(_STRING, "k") + struct.pack("<IIQ", _ARRAY, 4, 2**61)),
            r"metadata key 'k' \(2305843009213693952 items of type 4\) needs .* past the end",
            id="array-length",
        ),
        pytest.param(
            _file(_kv("k", 4, 1) + _kv("k", 4, 2), num_kv=2), "key 'k' appears twice", id="duplicate-key"
        ),
        pytest.param(
            _file(_encode(_STRING, "k") + struct.pack("<I", 13)),
            "key 'k' has unknown value type 13",
            id="value-type",
        ),
        pytest.param(
            _file(b"\x02" + bytes(7) + b"\xff\xfe"),
            "metadata key #0 at offset 32 is not valid UTF-8",
            id="utf8",
        ),
        pytest.param(
            _file(_ARCH, [("t", [32], 77, 0)]), "tensor 't' has unknown ggml type id 77", id="ggml-type"
        ),
        pytest.param(_file(_ARCH, [("t", [1] * 5, 0, 0)]), "tensor 't' has 5 dimensions", id="num-dims"),
        pytest.param(
            _file(_ARCH, [("t", [33], 8, 0)]), "rows of 33 values, not whole Q8_0 blocks", id="blocks"
        ),
        pytest.param(
            _file(_ARCH, [("t", [4], 0, 8)]), "data offset 8, not a multiple of 32", id="misaligned"
        ),
        pytest.param(
            _file(_ARCH, [("t", [1024], 0, 0)]), r"tensor 't' \(bytes \d+ to \d+\) lies past", id="past-end"
        ),
        pytest.param(
            _file(_ARCH, [("a", [32], 0, 0), ("b", [8], 0, 64)]), "tensors 'a' and 'b' overlap", id="overlap"
        ),
        pytest.param(
            _file(_ARCH, [("t", [8], 0, 0), ("t", [8], 0, 32)]), "tensor 't' appears twice", id="twice"
        ),
    ],
)
def test_hostile_headers_are_named(data: bytes, match: str, tmp_path: Path) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=match):
        GGUFFile(path)


def test_a_file_too_short_for_a_header_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match="too short for a GGUF header"):
        GGUFFile(tmp_path / "empty.gguf")


@pytest.mark.parametrize(
    ("metadata", "match"),
    [  # before: ZeroDivisionError, TypeError, a per-layer list that size (Gemma, MoE), NaN into the config
        ({"llama.attention.head_count": 0}, "llama.attention.head_count must be a positive integer, got 0"),
        ({"split.count": "two"}, "split.count must be a positive integer, got 'two'"),
        ({"llama.block_count": 2**32 - 1}, "llama.block_count is 4294967295; onecall reads at most 4096"),
        ({"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base must be a finite number, got nan"),
    ],
)
def test_hostile_config_values_are_named(metadata: dict[str, Any], match: str, tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config), config, extra_metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        gguf_config_dict(GGUFFile(path))
