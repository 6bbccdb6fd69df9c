"""The GGUF format's numeric tags: tensor (ggml) types with their block sizes, and metadata value types.

These are fixed by the GGUF specification; the `gguf` package defines them too, but importing it
runs its whole package (writer, vocab, yaml, ...: about 90 ms of cold start) for two tables. Only
the types onecall reads are listed; tests/test_gguf.py checks every entry against `gguf.constants`,
and error messages name other types through the package (imported only on that error path).
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """The ggml tensor types onecall can load (values as in ggml.h's `enum ggml_type`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# type -> (elements per block, bytes per block)
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),  # d:f16, 32 nibbles
    GGMLType.Q4_1: (32, 2 + 2 + 16),  # d, m:f16, 32 nibbles
    GGMLType.Q5_0: (32, 2 + 4 + 16),  # d:f16, high bits:u32, 32 nibbles
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),  # d:f16, 32 int8
    GGMLType.Q4_K: (256, 2 + 2 + 12 + 128),  # d, dmin:f16, 6-bit scales, 256 nibbles
    GGMLType.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
    GGMLType.Q6_K: (256, 128 + 64 + 16 + 2),  # low 4 bits, high 2 bits, int8 scales, d:f16
    GGMLType.BF16: (1, 2),
}


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
    try:
        return GGMLType(type_id).name
    except ValueError:
        pass
    from gguf.constants import GGMLQuantizationType  # error path only: see the module docstring

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type id {type_id}"
