"""The GGUF format's numeric tags: tensor (ggml) types with their block sizes, and metadata value types.

These are fixed by the GGUF specification; the `gguf` package defines them too, but importing it
runs its whole package (writer, vocab, yaml, ...) at cold start for two tables.
GGMLType lists the types onecall can load; GGML_TYPE_SIZES lists every type ggml defines, so the
reader can size (and bounds-check) a tensor of any of them and name the ones it will not load.
tests/formats/test_gguf.py checks both tables against `gguf.constants`. Also here: `checked_value`, which reads
one metadata value of an expected kind (a positive integer, a finite number, ...) or refuses it by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from onecall.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch


class GGMLType(IntEnum):
    """The ggml tensor types onecall can load (values as in ggml.h's `enum ggml_type`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30
    MXFP4 = 39


# type -> (elements per block, bytes per block), for the types onecall loads
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),  # d:f16, 32 nibbles
    GGMLType.Q4_1: (32, 2 + 2 + 16),  # d, m:f16, 32 nibbles
    GGMLType.Q5_0: (32, 2 + 4 + 16),  # d:f16, high bits:u32, 32 nibbles
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),  # d:f16, 32 int8
    GGMLType.Q2_K: (256, 16 + 64 + 2 + 2),  # 4-bit scale and min per 16, 2-bit values, d, dmin:f16
    GGMLType.Q3_K: (256, 32 + 64 + 12 + 2),  # high bits, low 2 bits, 6-bit scales per 16, d:f16
    GGMLType.Q4_K: (256, 2 + 2 + 12 + 128),  # d, dmin:f16, 6-bit scales, 256 nibbles
    GGMLType.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
    GGMLType.Q6_K: (256, 128 + 64 + 16 + 2),  # low 4 bits, high 2 bits, int8 scales, d:f16
    GGMLType.IQ4_NL: (32, 2 + 16),  # d:f16, 32 nibbles indexing a 16-entry int8 codebook
    GGMLType.IQ4_XS: (256, 2 + 2 + 4 + 128),  # d:f16, 6-bit scales per 32 (high 2 bits, low 4), nibbles
    GGMLType.BF16: (1, 2),
    GGMLType.MXFP4: (32, 1 + 16),  # e8m0 exponent, 32 e2m1 nibbles
}

# every type a GGUF file may hold: id -> (name, elements per block, bytes per block). Ids 4, 5, 31-33
# and 36-38 were removed from ggml (Q4_2, Q4_3, the Q4_0/IQ4_NL repacks): a file using one is invalid.
GGML_TYPE_SIZES: dict[int, tuple[str, int, int]] = {
    **{int(t): (t.name, *GGML_BLOCK_SIZES[t]) for t in GGMLType},
    9: ("Q8_1", 32, 40), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip


class GGUFValueType(IntEnum):
    """Metadata value tags (GGUF specification, `gguf_metadata_value_type`)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


def ggml_type_name(type_id: int) -> str:
    """A type's name for messages, also for types onecall does not load."""
    known = GGML_TYPE_SIZES.get(type_id)
    return known[0] if known is not None else f"unknown type id {type_id}"


# the kinds of metadata value checked_value accepts, as named in its errors
_KIND_NAMES = {"count": "a positive integer", "size": "a non-negative integer", "number": "a finite number",
               "flag": "a boolean", "string": "a string"}  # fmt: skip


def checked_value(meta: dict[str, Any], key: str, default: Any, kind: str) -> Any:
    """meta[key] if it holds a `kind` (a key of _KIND_NAMES), `default` if absent; UnsupportedModelError
    naming the key otherwise. An array is refused too: it is how per-layer values (OpenELM's head
    counts) are written, which onecall does not run."""
    if key not in meta:
        return default
    value = meta[key]
    if isinstance(value, list):
        raise UnsupportedModelError(
            f"GGUF key {key} is an array where {_KIND_NAMES[kind]} was expected (per-layer values, as "
            "some converters write head counts, are not supported)"
        )
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "count": is_int and value > 0,
        "size": is_int and value >= 0,
        "number": is_int or (isinstance(value, float) and math.isfinite(value)),
        "flag": isinstance(value, bool) or is_int,
        "string": isinstance(value, str),
    }[kind]
    if not ok:
        raise UnsupportedModelError(f"GGUF key {key} must be {_KIND_NAMES[kind]}, got {value!r}")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF's tensor directory."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order (out_features, in_features): GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFView(Protocol):
    """What the layout readers (gguf_layout.py, gguf_rope_scaling.py) need of an open GGUF file
    (gguf.py's GGUFFile), so that they do not import the reader that imports them."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    architecture: str

    def raw_data(self, info: TensorInfo) -> torch.Tensor: ...
