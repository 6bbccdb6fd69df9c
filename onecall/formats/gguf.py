"""GGUF files -> metadata dict and Hugging Face-named torch tensors.

A GGUF file is: a header (magic, version, counts), key/value metadata, a tensor
directory (name, dims, ggml type, offset), then aligned tensor data. We parse the
header ourselves over a memory map (gguf.GGUFReader builds a numpy view per array
element and takes 7-10 s on SmolLM2's 49k-token vocabulary; this takes ~0.1 s);
dequantization is in quants.py. The `gguf` package supplies the type constants and
is the tests' reference reader. Float32 metadata scalars read as their shortest decimal
(1e-05, as written by the converter), float32 arrays as exact values. Every count, length, type
tag, dimension and offset is checked against the file before it is used (the table above _Cursor):
a truncated, corrupt or hostile file is a ModelFileError that names the key, tensor or byte offset.

Tensor data is never copied until a tensor is requested: `iter_tensors` yields one
dequantized, renamed tensor at a time, so the model is never held twice. What each family's
tensors are called and what its metadata means (llama.cpp's converter, per architecture) is
gguf_layout.py's; undoing what the converter did to the values (Q/K interleaving, Gemma's 1 + w,
stacked experts, the hybrids' A, conv, norms and value-head order, gpt-oss's split gate/up biases,
DeepSeek's split kv_b) is iter_tensors'.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onecall.errors import ModelFileError, UnsupportedModelError
from onecall.formats.ggml_types import GGML_TYPE_SIZES, GGMLType, GGUFValueType, TensorInfo, ggml_type_name
from onecall.formats.gguf_deepseek import DEEPSEEK_K_B, DEEPSEEK_V_B, deepseek_kv_b
from onecall.formats.gguf_layout import (
    GEMMA_ARCHITECTURES,
    GPT_OSS_GATE_BIAS,
    GPT_OSS_UP_BIAS,
    SKIPPED_TENSORS,
    HybridLayout,
    check_loadable,
    gpt_oss_gate_up_bias,
    hf_tensor_name,
    hybrid_layout,
    key_reader,
)
from onecall.formats.quants import (
    SUPPORTED_QUANT_TYPES,
    HalfWeights,
    Int4CodeGroups,
    Int8Groups,
    KQuantGroups,
    StoredGroups,
    dequantize,
    stored_groups,
)

T = GGMLType
# llama.cpp's converter interleaves the Q/K rows of these architectures for GGML's RoPE (Mixtral is
# written as llama, so its Q/K are interleaved too; Qwen, Phi-3 and Gemma use NeoX RoPE: not permuted).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# GGUF scalar value type -> (struct format, numpy dtype for fast array decoding)
_SCALARS: dict[int, tuple[struct.Struct, str]] = {
    vtype: (struct.Struct(fmt), np_dtype)
    for vtype, fmt, np_dtype in [
        (GGUFValueType.UINT8, "<B", "<u1"), (GGUFValueType.INT8, "<b", "<i1"),
        (GGUFValueType.UINT16, "<H", "<u2"), (GGUFValueType.INT16, "<h", "<i2"),
        (GGUFValueType.UINT32, "<I", "<u4"), (GGUFValueType.INT32, "<i", "<i4"),
        (GGUFValueType.UINT64, "<Q", "<u8"), (GGUFValueType.INT64, "<q", "<i8"),
        (GGUFValueType.FLOAT32, "<f", "<f4"), (GGUFValueType.FLOAT64, "<d", "<f8"),
        (GGUFValueType.BOOL, "<?", "<u1"),
    ]
}  # fmt: skip

# What a header is checked against before anything is allocated or looped over (a malformed or hostile
# file is a ModelFileError naming the key, tensor or byte offset, never a raw exception):
# | counts, lengths     | at most what the rest of the file could hold, at the smallest encodings below |
# | arrays of arrays    | at most _MAX_ARRAY_DEPTH deep (llama.cpp refuses any nesting)                  |
# | keys, tensor names  | valid UTF-8, each once                                                         |
# | tensor dims         | 1 to 4 of them (GGML_MAX_DIMS), each >= 1, their product at most INT64_MAX     |
# | tensor type         | one ggml defines (GGML_TYPE_SIZES); the innermost dim whole blocks of it       |
# | general.alignment   | an integer power of two (default 32); every data offset a multiple of it      |
# | tensor data         | inside the file, no two tensors overlapping                                    |
_MAX_ARRAY_DEPTH = 8
_MAX_DIMS = 4
_INT64_MAX = 2**63 - 1
_MIN_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8} | {
    vtype: fmt.size for vtype, (fmt, _) in _SCALARS.items()
}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type tag, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, dim count, type, offset


class _Malformed(Exception):
    """What is wrong with the file and where; GGUFFile turns it into a ModelFileError naming the file."""


# ---------------------------------------------------------------- file parsing


class _Cursor:
    """Little-endian reads over the memory-mapped header, advancing `pos`; every read is bounds-checked
    and names `what` it was reading when the file is malformed."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _Malformed(
                f"{what} needs {n} bytes at offset {self.pos}, past the end of the file ({self.size} bytes)"
            )

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def string(self, what: str) -> str:
        raw = self.take(self.unpack(_U64, f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            offset = self.pos - len(raw)
            raise _Malformed(f"{what} at offset {offset} is not valid UTF-8 ({e.reason})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings: the vocabulary's hot loop, kept free of method calls."""
        self.need(count * 8, f"{what} ({count} strings)")
        buf, pos, end, unpack_u64 = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        try:  # a length past the end cuts its slice short, then the next unpack (or the check below) fails
            for _ in range(count):
                (n,) = unpack_u64(buf, pos)
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except struct.error:
            index = len(out) - 1 if pos > end else len(out)  # the last one's length, or this one's
            raise _Malformed(f"{what}[{index}] runs past the end of the file ({end} bytes)") from None
        except UnicodeDecodeError as e:
            raise _Malformed(f"{what}[{len(out)}] at offset {pos} is not valid UTF-8 ({e.reason})") from None
        if pos > end:
            raise _Malformed(f"{what}[{count - 1}] runs past the end of the file ({end} bytes)")
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what, depth=0)
        if vtype not in _SCALARS:
            raise _Malformed(f"{what} has unknown value type {vtype} (offset {self.pos - 4})")
        value = self.unpack(_SCALARS[vtype][0], what)
        if vtype == GGUFValueType.FLOAT32:  # shortest decimal that is this float32: 1e-05, not 9.99999974e-06
            return float(str(np.float32(value)))
        return value

    def array(self, what: str, depth: int) -> list[Any]:
        item_type = self.unpack(_U32, f"the item type of {what}")
        count = self.unpack(_U64, f"the length of {what}")
        if item_type not in _MIN_BYTES:
            raise _Malformed(f"{what} is an array of unknown value type {item_type} (offset {self.pos - 12})")
        if item_type == GGUFValueType.ARRAY and depth + 1 >= _MAX_ARRAY_DEPTH:
            raise _Malformed(f"{what} nests arrays over {_MAX_ARRAY_DEPTH} deep (offset {self.pos - 12})")
        self.need(count * _MIN_BYTES[item_type], f"{what} ({count} items of type {item_type})")
        if item_type in _SCALARS:  # numeric arrays in one numpy read
            fmt, np_dtype = _SCALARS[item_type]
            items = np.frombuffer(self.take(count * fmt.size, what), dtype=np_dtype)
            return (items != 0).tolist() if item_type == GGUFValueType.BOOL else items.tolist()
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]


class GGUFFile:
    """A memory-mapped GGUF file: `metadata`, `architecture`, `tensors` and dequantized weights."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 4 + 4 + 8 + 8:
                raise ModelFileError(f"{self.path} is not a GGUF file: too short for a GGUF header")
            # private (copy-on-write) map: torch wraps it without warnings
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self.metadata, self.tensors = self._parse()
        except _Malformed as e:
            raise ModelFileError(f"{self.path} is not a readable GGUF file: {e}") from None
        arch = self.metadata.get("general.architecture")
        self.architecture: str = arch if isinstance(arch, str) else ""

    def release_pages(self) -> None:
        """Let the kernel drop the file's pages from this process once the weights are loaded: a packed
        copy does not read them again, and what still does (a 16-bit weight kept as a view of the file,
        the tokenizer) faults them back in from the page cache. Resident memory then counts the weights
        once, not the file beside its packed copy."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        """Phases: 1. header, 2. key/values, 3. tensor directory, 4. aligned data offsets."""
        cur = _Cursor(self._mmap)
        # 1. header
        if cur.take(4, "the magic bytes") != b"GGUF":
            raise _Malformed("missing GGUF magic bytes")
        version = cur.unpack(_U32, "the version")
        if version not in (2, 3):
            raise _Malformed(f"GGUF version {version} is not supported (need 2 or 3, little-endian)")
        num_tensors, num_kv = cur.unpack(_U64, "the tensor count"), cur.unpack(_U64, "the key/value count")
        min_size = num_kv * _MIN_KV_BYTES + num_tensors * _MIN_TENSOR_INFO_BYTES
        cur.need(min_size, f"the header (with {num_kv} key/values and {num_tensors} tensor infos)")
        # 2. key/values
        metadata: dict[str, Any] = {}
        for i in range(num_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise _Malformed(f"metadata key {key!r} appears twice")
            metadata[key] = cur.value(cur.unpack(_U32, f"the type of key {key!r}"), f"metadata key {key!r}")
        # 3. tensor directory
        directory: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for i in range(num_tensors):
            name = cur.string(f"the name of tensor #{i}")
            if name in directory:
                raise _Malformed(f"tensor {name!r} appears twice in the tensor directory")
            directory[name] = self._tensor_entry(cur, name)
        # 4. data offsets
        alignment = metadata.get("general.alignment", 32)
        is_int = isinstance(alignment, int) and not isinstance(alignment, bool)
        if not is_int or alignment <= 0 or alignment & (alignment - 1):
            raise _Malformed(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        tensors = [self._tensor_info(name, *info, data_start, alignment) for name, info in directory.items()]
        _check_no_overlap(tensors)
        return metadata, tensors

    @staticmethod
    def _tensor_entry(cur: _Cursor, name: str) -> tuple[tuple[int, ...], int, int]:
        """(torch shape, ggml type, data offset) of one directory entry, the shape and type checked."""
        num_dims = cur.unpack(_U32, f"the dimension count of tensor {name!r}")
        if not 1 <= num_dims <= _MAX_DIMS:
            raise _Malformed(f"tensor {name!r} has {num_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
        dims = [cur.unpack(_U64, f"the dimensions of tensor {name!r}") for _ in range(num_dims)]
        ggml_type = cur.unpack(_U32, f"the type of tensor {name!r}")
        offset = cur.unpack(_U64, f"the data offset of tensor {name!r}")
        if math.prod(dims) > _INT64_MAX:
            raise _Malformed(f"tensor {name!r} has dimensions {dims} whose product overflows int64")
        if not all(dims):
            raise _Malformed(f"tensor {name!r} has dimensions {dims}: no values")
        if ggml_type not in GGML_TYPE_SIZES:
            raise _Malformed(f"tensor {name!r} has unknown ggml type id {ggml_type}")
        type_name, block_size, _ = GGML_TYPE_SIZES[ggml_type]
        if dims[0] % block_size:
            raise _Malformed(f"tensor {name!r} has rows of {dims[0]} values, not whole {type_name} blocks "
                             f"of {block_size}")  # fmt: skip
        return tuple(reversed(dims)), ggml_type, offset

    def _tensor_info(
        self, name: str, shape: tuple[int, ...], ggml_type: int, offset: int, data_start: int, alignment: int
    ) -> TensorInfo:
        _, block_size, type_size = GGML_TYPE_SIZES[ggml_type]
        nbytes = math.prod(shape) // block_size * type_size
        if offset % alignment:
            raise _Malformed(f"tensor {name!r} has data offset {offset}, not a multiple of {alignment}")
        start = data_start + offset
        if start + nbytes > len(self._mmap):
            raise _Malformed(f"tensor {name!r} (bytes {start} to {start + nbytes}) lies past the end of the "
                             f"file ({len(self._mmap)} bytes): truncated download?")  # fmt: skip
        return TensorInfo(name, shape, ggml_type, start, nbytes)

    def tensor_names(self) -> list[str]:
        """GGUF tensor names in file order."""
        return [t.name for t in self.tensors]

    def raw_data(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 view of the memory map (no copy)."""
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def _check_loadable(self) -> list[tuple[TensorInfo, str]]:
        """Refuse before yielding anything: architecture, tensor names and quant types."""
        check_loadable(self.architecture, self.metadata, self.path.name)
        has_experts = bool(self.metadata.get(f"{self.architecture}.expert_count"))
        hybrid = hybrid_layout(self.metadata, self.architecture)
        plan = []
        for info in self.tensors:
            if info.name in SKIPPED_TENSORS or (hybrid is not None and hybrid.is_mtp(info.name)):
                continue  # a hybrid's MTP blocks: the checkpoint's mtp.*, which onecall does not run
            if info.ggml_type not in SUPPORTED_QUANT_TYPES:
                kind = ggml_type_name(info.ggml_type)
                raise UnsupportedModelError(
                    f"GGUF tensor {info.name!r} uses quantization type {kind}, which onecall cannot "
                    f"dequantize (supported: {', '.join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))})"
                )
            hf_name = hf_tensor_name(info.name, self.architecture, has_experts)
            if "*" in hf_name and len(info.shape) != 3:
                raise UnsupportedModelError(
                    f"GGUF tensor {info.name!r} stacks experts, so it must be 3-D, got shape {info.shape}"
                )
            plan.append((info, hf_name))
        halves = {hf_name for _, hf_name in plan if hf_name.endswith((GPT_OSS_GATE_BIAS, GPT_OSS_UP_BIAS))}
        for name in sorted(halves):
            gate = name.replace(GPT_OSS_UP_BIAS, GPT_OSS_GATE_BIAS)
            if gate not in halves or gate.replace(GPT_OSS_GATE_BIAS, GPT_OSS_UP_BIAS) not in halves:
                layer = name.split(".")[2]
                raise UnsupportedModelError(
                    f"GGUF: layer {layer} has only one of blk.{layer}.ffn_gate_exps.bias and ffn_up_exps.bias"
                )
        kv_b = {hf_name for _, hf_name in plan if hf_name.endswith((DEEPSEEK_K_B, DEEPSEEK_V_B))}
        for name in sorted(kv_b):
            layer = name.removesuffix(DEEPSEEK_K_B).removesuffix(DEEPSEEK_V_B)
            if {layer + DEEPSEEK_K_B, layer + DEEPSEEK_V_B} - kv_b:
                raise UnsupportedModelError(
                    f"GGUF: layer {layer.split('.')[2]} has only one of attn_k_b.weight and attn_v_b.weight"
                )
        return plan

    def iter_tensors(
        self,
        dtype: torch.dtype,
        stored_out: dict[str, StoredGroups] | None = None,
        expand_stored: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, dequantized CPU tensor in `dtype`), one tensor at a time, undoing what
        the converter changed (gguf_layout.py has the names):

        | GGUF                                   | yielded                                              |
        |----------------------------------------|------------------------------------------------------|
        | llama (and Mixtral) attn_q / attn_k    | rows un-interleaved (unpermute_qk_rows)              |
        | stacked experts (E, rows, cols)        | E tensors, `mlp.experts.{e}.gate_proj.weight`, ...   |
        | Gemma `*norm.weight`, stored as 1 + w  | w in float64, whatever `dtype`: x - 1 is exact there |
        |                                        | and model/gemma.py's fold adds 1 back in float64, so |
        |                                        | the loaded norm is the file's float32 x bit for bit  |
        | gpt-oss ffn_gate_exps / ffn_up_exps    | one `mlp.experts.gate_up_proj_bias` (E, 2I), columns |
        | .bias (E, I) each                      | interleaved back (gate 2i, up 2i + 1) as transformers|
        |                                        | holds it; the weights, already [gate; up] apart, are |
        |                                        | experts as any family's (their MXFP4 kept as exact   |
        |                                        | int8 groups: model/gpt_oss.py runs them natively)    |
        | deepseek2 attn_k_b (H, rank, nope) and | one `self_attn.kv_b_proj.weight` (H * (nope + v),    |
        | attn_v_b (H, v, rank)                  | rank), each head's [k; v] rows; its experts as any   |
        |                                        | family's (model/deepseek.py's moe.Experts runs them  |
        |                                        | in their stored groups)                              |
        | a hybrid's (HybridLayout's table)      | its norms as Gemma's (not the gated ssm_norm),       |
        |                                        | A_log = log(-ssm_a), the conv (channels, 1, kernel), |
        |                                        | value heads back in grouped order (qwen35*: rows and |
        |                                        | their stored groups; ssm_out's columns, its groups   |
        |                                        | kept where the heads are whole groups)               |

        With `stored_out`, every 2-D tensor a native kernel runs as stored (quants.stored_groups: 4-bit
        and 5-bit groups, int8 groups, F16/BF16 weights) is decoded once into its stored form, kept
        there under its name (the fast kernels' exact copy), and expanded from it. Stacked experts are
        expanded to dense tensors too (model/moe.py runs them in float unless the loader hands it the
        stored groups). With `expand_stored` False, a 2-D tensor with a stored form is yielded as a
        meta tensor of its shape instead (no float32 copy is made): the consumer takes its data from
        `stored_out` (weights.load_weights does: a projection the native kernels run every row of
        never needs the float32 copy, cold start's largest cost and, for a Q8_0 file, four times its
        size in memory).
        """
        plan = self._check_loadable()
        key = key_reader(self.metadata, self.architecture)
        num_heads = key("attention.head_count", 0)
        # read only where Q/K are permuted: gemma4 writes the KV heads per layer (an array)
        permuted = self.architecture in _PERMUTED_QK_ARCHITECTURES
        num_kv_heads = key("attention.head_count_kv", num_heads) if permuted else 0
        gemma = self.architecture in GEMMA_ARCHITECTURES
        hybrid = hybrid_layout(self.metadata, self.architecture)
        gpt_oss = self.architecture == "gpt-oss"
        bias_halves: dict[str, torch.Tensor] = {}  # gpt-oss: a gate or up bias waiting for the other
        kv_b_halves: dict[str, torch.Tensor] = {}  # deepseek2: a k_b or v_b waiting for the other
        for info, hf_name in plan:
            heads = 0
            if self.architecture in _PERMUTED_QK_ARCHITECTURES:
                if ".self_attn.q_proj." in hf_name:
                    heads = num_heads
                elif ".self_attn.k_proj." in hf_name:
                    heads = num_kv_heads
            raw, ggml_type = self.raw_data(info), T(info.ggml_type)
            if "*" in hf_name:  # stacked experts: one (rows, cols) tensor per expert
                yield from self._experts(info, hf_name, raw, dtype, stored_out)
                continue
            if hf_name.endswith((DEEPSEEK_K_B, DEEPSEEK_V_B)):
                part = dequantize(raw, ggml_type, info.shape, torch.float32)
                layer = hf_name.removesuffix(DEEPSEEK_K_B).removesuffix(DEEPSEEK_V_B)
                other = kv_b_halves.pop(layer, None)
                if other is None:
                    kv_b_halves[layer] = part
                    continue
                k_b, v_b = (part, other) if hf_name.endswith(DEEPSEEK_K_B) else (other, part)
                yield f"{layer}self_attn.kv_b_proj.weight", deepseek_kv_b(k_b, v_b).to(dtype)
                continue
            if gpt_oss and hf_name.endswith((GPT_OSS_GATE_BIAS, GPT_OSS_UP_BIAS)):
                half = dequantize(raw, ggml_type, info.shape, torch.float32)
                is_gate = hf_name.endswith(GPT_OSS_GATE_BIAS)
                partner = (
                    hf_name.replace(GPT_OSS_GATE_BIAS, GPT_OSS_UP_BIAS)
                    if is_gate
                    else hf_name.replace(GPT_OSS_UP_BIAS, GPT_OSS_GATE_BIAS)
                )
                other = bias_halves.pop(partner, None)
                if other is None:
                    bias_halves[hf_name] = half
                    continue
                gate, up = (half, other) if is_gate else (other, half)
                name = hf_name.rpartition(".mlp.")[0] + ".mlp.experts.gate_up_proj_bias"
                yield name, gpt_oss_gate_up_bias(gate, up).to(dtype)
                continue
            if gemma and hf_name.endswith("norm.weight"):
                yield hf_name, dequantize(raw, ggml_type, info.shape, torch.float32).double() - 1.0
                continue
            if hybrid is not None and hf_name.endswith(_HYBRID_VALUES):  # small tensors, never stored groups
                dense = dequantize(raw, ggml_type, info.shape, torch.float32)
                yield hf_name, _undo_hybrid(hybrid, hf_name, dense, dtype)
                continue
            rows = hybrid.value_rows(hf_name) if hybrid is not None else None
            columns = hybrid.value_columns(hf_name) if hybrid is not None else None
            groups = stored_groups(raw, ggml_type, info.shape) if stored_out is not None else None
            if groups is not None and rows is not None:
                groups = groups.select_rows(rows)
            if groups is not None and columns is not None:
                groups = _select_columns(groups, columns)
            if groups is not None and stored_out is not None:
                if heads:
                    groups = groups.select_rows(unpermute_qk_rows(torch.arange(info.shape[0]), heads))
                stored_out[hf_name] = groups
                if expand_stored:  # bit-exact with dequantize() (quants.py)
                    yield hf_name, groups.dequantize().to(dtype)
                else:
                    yield hf_name, torch.empty(groups.shape, dtype=dtype, device="meta")
                continue
            tensor = dequantize(raw, ggml_type, info.shape, dtype)
            if rows is not None:
                tensor = tensor[rows]
            if columns is not None:
                tensor = tensor[:, columns]
            yield hf_name, unpermute_qk_rows(tensor, heads) if heads else tensor

    @staticmethod
    def _experts(
        info: TensorInfo,
        hf_name: str,
        raw: torch.Tensor,
        dtype: torch.dtype,
        stored_out: dict[str, StoredGroups] | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A stacked expert tensor (num_experts, rows, cols) as one tensor per expert (a fused
        ffn_gate_up_exps as each expert's gate and up halves); with `stored_out`, each one's stored
        form (quants.stored_groups) kept under its name first, as for a 2-D weight."""
        ggml_type, (num_experts, rows, cols) = T(info.ggml_type), info.shape
        halves = [(hf_name, 0, rows)]
        if hf_name.endswith(".gate_up_proj.weight"):  # each expert's rows [gate; up], gate first
            halves = [(hf_name.replace("gate_up_proj", p), i * rows // 2, (i + 1) * rows // 2)
                      for i, p in enumerate(("gate_proj", "up_proj"))]  # fmt: skip
        per_expert = raw.view(num_experts, -1)  # experts outermost: each one's blocks are contiguous
        for e in range(num_experts):
            one = per_expert[e]
            groups = stored_groups(one, ggml_type, (rows, cols)) if stored_out is not None else None
            dense = groups.dequantize().to(dtype) if groups is not None else None
            if dense is None:
                dense = dequantize(one, ggml_type, (rows, cols), dtype)
            for name, start, end in halves:
                name = name.replace("*", str(e))
                if groups is not None and stored_out is not None:
                    stored_out[name] = _rows(groups, start, end)
                yield name, dense[start:end]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """GGUFFile(path), parsed once and shared: config, tokenizer and weights all read the same file."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _open_cached(resolved, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:  # mtime/size: reparse if replaced
    return GGUFFile(path)


def _check_no_overlap(tensors: list[TensorInfo]) -> None:
    """Refuse two tensors whose data overlap (llama.cpp's writer lays them out one after another)."""
    by_offset = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if after.offset < before.offset + before.nbytes:
            raise _Malformed(f"tensors {before.name!r} and {after.name!r} overlap (bytes {after.offset} to "
                             f"{before.offset + before.nbytes})")  # fmt: skip


def unpermute_qk_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleaving (GGML's RoPE pairs adjacent rows).

    The converter stores each head's rows as (r0, r_{d/2}, r1, r_{d/2+1}, ...), i.e. row
    2i + p of a head is Hugging Face row p * d/2 + i. Reading the head as (d/2, 2) and
    transposing to (2, d/2) restores the rotate_half layout. Works for weights and biases.
    """
    rows = tensor.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):
        raise UnsupportedModelError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    grouped = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return grouped.transpose(1, 2).reshape(tensor.shape)


def _rows(groups: StoredGroups, start: int, end: int) -> StoredGroups:
    """Rows [start, end) of stored groups (groups run along a row: a row slice is exact)."""
    if start == 0 and end == groups.shape[0]:
        return groups
    return groups.select_rows(slice(start, end))


# a hybrid's tensors whose values (not only their order) the converter changed, all small: norms, A, the
# conv, the shared expert's gate (HybridLayout's table)
_HYBRID_VALUES = ("norm.weight", ".linear_attn.A_log", ".linear_attn.dt_bias", ".linear_attn.conv1d.weight",
                  ".mlp.shared_expert_gate.weight")  # fmt: skip


def _undo_hybrid(
    hybrid: HybridLayout, hf_name: str, tensor: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """One of a hybrid's _HYBRID_VALUES tensors (float32, as the file holds it) as the checkpoint holds it:
    value heads in grouped order; a (1 + w) norm as w in float64 (as Gemma's: the loader adds the 1 back
    there, exactly); A_log = log(-ssm_a); the conv (channels, 1, kernel); the shared expert's gate
    (1, hidden) where a file has it 1-D."""
    if (rows := hybrid.value_rows(hf_name)) is not None:
        tensor = tensor[rows]
    if hf_name.endswith("norm.weight") and not hf_name.endswith(".linear_attn.norm.weight"):
        return tensor.double() - 1.0
    if hf_name.endswith(".linear_attn.A_log"):
        if not bool((tensor < 0).all()):
            raise UnsupportedModelError(f"GGUF tensor {hf_name!r} (ssm_a = -exp(A_log)) must be negative")
        return torch.log(-tensor.double()).to(dtype)
    if hf_name.endswith(".linear_attn.conv1d.weight") and tensor.dim() == 2:
        tensor = tensor.unsqueeze(1)
    elif hf_name.endswith(".mlp.shared_expert_gate.weight") and tensor.dim() == 1:
        tensor = tensor.unsqueeze(0)
    return tensor.to(dtype)


def _select_kquant_columns(groups: KQuantGroups, columns: torch.Tensor) -> KQuantGroups | None:
    """_select_columns for K-quant codes: the columns must be whole super-blocks of 256 (their d, dmin)."""
    if columns.numel() % 256:
        return None
    blocks = columns.reshape(-1, 256)
    starts = blocks[:, 0]
    if bool((starts % 256).any()) or not torch.equal(blocks, starts[:, None] + torch.arange(256)):
        return None
    supers = starts // 256
    subs = (supers[:, None] * 16 + torch.arange(16)).reshape(-1)  # their sub-blocks of 16
    mins = (groups.sub_min, groups.dmin)
    return KQuantGroups(
        groups.bits, groups.q[:, columns], groups.sub_scale[:, subs], groups.d[:, supers],
        None if mins[0] is None else mins[0][:, subs], None if mins[1] is None else mins[1][:, supers],
    )  # fmt: skip


def _select_columns(groups: StoredGroups, columns: torch.Tensor) -> StoredGroups | None:
    """The given columns of a stored weight, where they move whole groups (a hybrid's ssm_out whose value
    heads are a multiple of the group size, as every released Qwen3.5's 128 are); None where they do not
    (the weight is then expanded, its columns picked from the float copy)."""
    if isinstance(groups, HalfWeights):
        return HalfWeights(groups.values[:, columns])
    if isinstance(groups, KQuantGroups):  # a d per 256 columns: whole super-blocks move
        return _select_kquant_columns(groups, columns)
    size = groups.group_size
    blocks = columns.reshape(-1, size)
    starts = blocks[:, 0]
    if bool((starts % size).any()) or not torch.equal(blocks, starts[:, None] + torch.arange(size)):
        return None
    picked = starts // size
    if isinstance(groups, (Int8Groups, Int4CodeGroups)):  # one scale per group, no offset
        return type(groups)(groups.q[:, columns], groups.scale[:, picked], size)
    return type(groups)(groups.q[:, columns], groups.scale[:, picked], groups.offset[:, picked], size)
