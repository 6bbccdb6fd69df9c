"""A second start pays nothing: a GGUF's packed projections cached on disk, memory-mapped back.

On the fast CPU path a GGUF's projections, its logits head and its token embedding are decoded from
the file's blocks (formats/quants.py stored_groups) and repacked into the native kernels' layouts
(kernels/cpu/native.py pack_*): most of a cold start. After a load, `PackCache.save` writes those
layouts to one file under envs.pack_cache_dir() (<cache dir>/packed); on the next start with the
same file and the same code, `PackCache.lookup` maps it back and nothing is decoded or packed: the
projections, the head and the embedding are tensors viewing the map (zero-copy: every tensor starts
on a 64-byte boundary; the map is shared and read-only, so its pages are the page cache's own and
resident memory counts them once; MAP_POPULATE maps them all in one call rather than a fault per
page during the first forward), and the GGUF iteration skips those tensors (`iter_weights`): only
norms, biases and MoE experts are still read from the file. The first start pays the write (the
packed size, about the file's, through the page cache).

All or nothing: a file is written only when every projection runs every row on the native kernels
from the file's own groups (FastLinear.packed_weights), the head is the file's own table
(FastLMHead.from_stored) and the embedding a StoredEmbedding; a model with a oneDNN-packed
projection (opaque: it cannot be saved) re-packs at every start, as before.

The file: 8 magic bytes, a little-endian u64 length, a JSON index (the key, the key's material, per
tensor its dtype, shape, offset and size, and which tensors make each packed weight), then the data,
each tensor at a multiple of 64 bytes. Never pickle: nothing in it is executed.

The key (what a hit promises: these bytes are what packing this file with this code would give):
| part                                        | why                                                    |
|---------------------------------------------|--------------------------------------------------------|
| the file's size and mtime_ns                | a replaced or rewritten file (the usual way one        |
|                                             | changes) misses; a copy without -p misses too (safe)   |
| sha256 of the header and tensor directory   | metadata, names, shapes, types and offsets             |
| sha256 of the first and last 4 KiB of every | an edit in place that kept size and mtime, in any      |
| tensor's data                               | tensor's ends                                          |
| sha256 of the code that decides the layout  | formats/, kernels/cpu/ (its C too), loading/, the      |
| (its source files) and torch's version      | model's decoder: any edit there is a miss              |
| int8_activations                            | 4-bit groups pack differently for the int8 kernel      |
A full sha256 of the file would cost seconds for a 5 GB file, the very thing the cache saves. What
the key misses: a file whose tensor bytes changed away from every tensor's first and last 4 KiB
while its size and mtime_ns were kept (`touch -r`) and its header did not change. Then the old
weights would run: delete the cache (`rm -r <cache>/packed`) or set ONECALL_PACK_CACHE=0.

On reading, a file whose key, magic, size, index, dtypes or shapes disagree with what this model's
packing would make (each packed weight's shape is checked against its projection's rows and
columns, in the layout's own formula), or whose sampled bytes' digest differs, is ignored with a
PackCacheWarning and the load packs as usual. Writes go to a temporary file renamed into place
(atomic; no fsync: a crash mid-write leaves a short or zeroed file that those checks refuse). The
folder is bounded: after a write the least recently used files go until the rest fit
ONECALL_PACK_CACHE_GIB (envs.py), and nothing is written that would leave the disk less free than
_HEADROOM says (10% of it, but never more than 10 GiB nor less than 2 GiB: a 250 GB disk keeps 10 GiB,
a 20 GB one 2 GiB); ONECALL_PACK_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onecall import envs
from onecall.errors import OnecallError
from onecall.formats.gguf import GGUFFile
from onecall.formats.gguf_layout import hf_tensor_name
from onecall.formats.quants import CODEBOOKS, StoredGroups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import FastLinear, FastLMHead
from onecall.loading.packing import EMBEDDING, LM_HEAD, pack_slots
from onecall.model.decoder import DecoderLM

logger = logging.getLogger("onecall.pack_cache")

MAGIC = b"OCPACK\x00\x02"  # the last byte: the file format's version (2: IQ4Packed records its codebook)
_ALIGN = 64  # every tensor's offset: cache lines, and any element size
_SAMPLE = 4096  # bytes hashed at each end of a GGUF tensor (the key) and of a cached tensor (the digest)
_LAYOUT_SOURCES = ("formats", "kernels/cpu", "loading", "model")  # model/: which projections each family packs
_PACKED = {cls.__name__: cls for cls in (native.Q4Packed, native.Q5Packed, native.Q8Blocked,
                                          native.IQ4Packed, native.KQPacked, native.HalfPacked)}  # fmt: skip
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int8, torch.float16, torch.bfloat16,
                                                     torch.float32)}  # fmt: skip

ProjectionPacks = native.Q4Packed | list[tuple[int, int, native.Packed]]  # FastLinear.packed_weights


class PackCacheWarning(RuntimeWarning):
    """A cache file was ignored (corrupt, truncated, another key or layout) or could not be written."""


class _Invalid(OnecallError):
    """Why a cache file cannot be used (turned into a PackCacheWarning)."""


@dataclass
class CachedPacks:
    """A hit (a packing.Prepacked): every projection (by PackSlot.key), the logits head's table and the
    embedding's (the head's own when tied), viewing the cache file's map."""

    path: Path
    projections: dict[str, ProjectionPacks]
    head: native.Packed
    embedding_table: native.Packed
    act8: bool

    def linear(self, key: str, bias: torch.Tensor | None) -> FastLinear:
        return FastLinear.from_packed(self.projections[key], bias, self.act8)

    def embedding(self) -> StoredEmbedding:
        """The embedding on its table (tied: the head's, the very tensors FastLMHead.from_table reads)."""
        return StoredEmbedding(self.embedding_table)


class PackCache:
    """The cache entry of one GGUF for one model: `lookup` before loading, `save` after a miss."""

    def __init__(self, model: DecoderLM, gguf: GGUFFile) -> None:
        self.model, self.gguf = model, gguf
        self.material = _key_material(gguf, model.int8_activations)
        self.key = hashlib.sha256(json.dumps(self.material, sort_keys=True).encode()).hexdigest()[:40]
        self.path = envs.pack_cache_dir() / f"{self.key}.ocpack"
        self.status = "miss"  # then "hit", "written", or why not written: LoadedEngineParts.pack_cache

    @classmethod
    def applies(cls, model: DecoderLM, gguf: GGUFFile | None) -> PackCache | None:
        """The entry for this load, or None where the cache does not apply (turned off, not a GGUF, not
        the packing fast path, no native kernels)."""
        if gguf is None or not envs.pack_cache_enabled() or not model.pack_on_load or native.load() is None:
            return None
        return cls(model, gguf)

    def lookup(self) -> CachedPacks | None:
        """The cached packs, or None (no file; or one that is unusable: a PackCacheWarning says why)."""
        if not self.path.exists():
            return None
        try:
            hit = _read(self.path, self.key, self.material, _expected(self.model))
        except Exception as e:  # whatever is wrong with it, the load packs as if it were not there
            why = str(e) if isinstance(e, _Invalid) else f"{type(e).__name__}: {e}"
            warnings.warn(f"ignoring the pack cache file {self.path}: {why}", PackCacheWarning, stacklevel=2)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)  # recently used: the size bound evicts the oldest
        self.status = "hit"
        return hit

    def iter_weights(
        self, dtype: torch.dtype, stored: dict[str, StoredGroups] | None, expand_stored: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The GGUF's tensors a hit still needs (GGUFFile.iter_tensors over the rest of the directory):
        not those whose Hugging Face name is a projection's part, the embedding or the head (the hit
        holds every one; a fused file tensor, Phi-3's qkv, still comes and the packer drops its parts)."""
        skip = {name for slot in pack_slots(self.model) for name in slot.parts} | {EMBEDDING, LM_HEAD}
        arch = self.gguf.architecture
        has_experts = bool(self.gguf.metadata.get(f"{arch}.expert_count"))

        def needed(name: str) -> bool:
            try:
                return hf_tensor_name(name, arch, has_experts) not in skip
            except OnecallError:
                return True  # iter_tensors skips or refuses it itself

        # the same parsed file with a shorter directory (formats/ has no filter of its own to call)
        view = object.__new__(GGUFFile)
        view.__dict__.update(self.gguf.__dict__)
        view.tensors = [t for t in self.gguf.tensors if needed(t.name)]
        return view.iter_tensors(dtype, stored, expand_stored)

    def save(self) -> None:
        """Write the loaded model's packs (after a miss), when every one is cacheable; never raises for
        the disk (a PackCacheWarning says what failed)."""
        packs = _collect(self.model)
        if not isinstance(packs, str):
            try:
                _check_all(*packs, _expected(self.model))
            except _Invalid as e:  # this code's own packs: a layout the reader's checks do not know
                packs = f"the packs fail the reader's checks ({e})"
        if isinstance(packs, str):
            self.status = f"not cached: {packs}"
            logger.info("pack cache: %s", self.status)
            return
        try:
            if not _room_for(self.path.parent, packs):
                self.status = f"not written: the disk would keep less than {_headroom_text(self.path.parent)} free"
                logger.info("pack cache: %s", self.status)
                return
            _write(self.path, self.key, self.material, *packs)
        except Exception as e:  # a full disk, a folder we may not write: the model is loaded all the same
            self.status = f"not written: {type(e).__name__}: {e}"
            warnings.warn(
                f"could not write the pack cache file {self.path}: {e}", PackCacheWarning, stacklevel=2
            )
            return
        self.status = "written"
        with contextlib.suppress(OSError):
            _evict(self.path.parent, envs.pack_cache_max_bytes(), keep=self.path)


# ---- the key -----------------------------------------------------------------------------------------
def _key_material(gguf: GGUFFile, act8: bool) -> dict[str, Any]:
    """What the key hashes (the module docstring's table)."""
    st = gguf.path.stat()
    data_start = min((t.offset for t in gguf.tensors), default=st.st_size)
    ends = hashlib.sha256()
    with open(gguf.path, "rb") as f:
        head = hashlib.sha256(f.read(data_start)).hexdigest()
        for t in sorted(gguf.tensors, key=lambda t: t.offset):
            ends.update(os.pread(f.fileno(), min(_SAMPLE, t.nbytes), t.offset))
            ends.update(os.pread(f.fileno(), min(_SAMPLE, t.nbytes), t.offset + max(0, t.nbytes - _SAMPLE)))
    return {
        "format": MAGIC.hex(),
        "file": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header": head, "ends": ends.hexdigest()},
        "code": _code_digest(),
        "torch": torch.__version__,
        "int8_activations": act8,
    }


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """sha256 of the source files that decide what packing makes (see _LAYOUT_SOURCES)."""
    root = Path(__file__).resolve().parent.parent
    files: list[Path] = []
    for rel in _LAYOUT_SOURCES:
        p = root / rel
        files += [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in (".py", ".c", ".h")]
    digest = hashlib.sha256()
    for f in sorted(files):
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


# ---- what the model needs, and checking a packed weight against it --------------------------------
@dataclass(frozen=True)
class _Expected:
    projections: dict[str, tuple[int, int]]  # PackSlot.key -> (out_features, in_features)
    table: tuple[int, int]  # (vocab_size, hidden_size): the head and the embedding
    tied: bool
    act8: bool


def _expected(model: DecoderLM) -> _Expected:
    table = (model.config.vocab_size, model.config.hidden_size)  # the embedding's and the head's
    slots = {slot.key: slot.shape for slot in pack_slots(model)}
    return _Expected(slots, table, model.lm_head is None, model.int8_activations)


def _check_packed(p: native.Packed, n: int, k: int, act8: bool, what: str) -> None:
    """`p` is what pack_* makes for an (n, k) weight (native.py's layouts), else _Invalid."""
    if (p.out_features, p.in_features) != (n, k) or (k % 32 and not isinstance(p, native.HalfPacked)):
        raise _Invalid(f"{what} is ({p.out_features}, {p.in_features}), expected ({n}, {k})")
    units, g = -(-n // 16), k // 32
    blocked = (units, g, 2, 8)
    want: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]
    if isinstance(p, native.Q4Packed):
        if p.act8 != act8:
            raise _Invalid(f"{what} is packed for act8={p.act8}, the model runs act8={act8}")
        qs = (units, g, 2, 4, 8, 4) if p.act8 else (units, g, 2, 8, 8, 2)
        want = {"qs": (qs, (torch.uint8,)), "scale": (blocked, _SCALES), "offset": (blocked, _SCALES)}
        if p.scale.dtype == torch.uint8 and not p.act8 and g % native.Q4_SUPER_GROUPS == 0:  # pack_q4_super's
            factors = (units, g // native.Q4_SUPER_GROUPS, native.Q4_SUPER_BYTES)
            want.update(scale=(factors, (torch.uint8,)), offset=((0,), (torch.uint8,)))
    elif isinstance(p, native.Q5Packed):
        want = {
            "qs": ((units, g, 320), (torch.uint8,)),
            "scale": (blocked, _SCALES),
            "offset": (blocked, _SCALES),
        }
    elif isinstance(p, native.Q8Blocked):
        if p.group_size not in (16, 32):
            raise _Invalid(f"{what} has int8 groups of {p.group_size}")
        want = {"qs": ((units, g, 2, 16, 8, 2), (torch.int8,)),
                "scale": ((units, k // p.group_size, 2, 8), (torch.float32,))}  # fmt: skip
    elif isinstance(p, native.IQ4Packed):
        if p.codebook not in CODEBOOKS:
            raise _Invalid(f"{what} indexes an unknown codebook {p.codebook!r}")
        want = {"qs": ((units, g, 2, 8, 8, 2), (torch.uint8,)), "scale": (blocked, _SCALES)}
    elif isinstance(p, native.KQPacked):
        if p.bits not in (6, 3, 2) or k % 256:
            raise _Invalid(f"{what} holds {p.bits}-bit K-quant codes along {k} columns")
        planes, group_bytes = (2, 128) if p.bits == 2 else (1, 384 if p.bits == 6 else 192)
        want = {"qs": ((units, g, group_bytes), (torch.uint8,)),
                "scales": ((planes, units, g, 2, 2, 8), (torch.int8,)),
                "supers": ((planes, units, k // 256, 2, 8), (torch.float16,))}  # fmt: skip
    else:
        want = {"values": ((units, k, 16), (torch.float16, torch.bfloat16))}
    for field, (shape, dtypes) in want.items():
        t = getattr(p, field)
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise _Invalid(f"{what}.{field} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtypes[0]}")
    scales = [getattr(p, f) for f in ("scale", "offset") if hasattr(p, f)]
    affine = isinstance(p, (native.Q4Packed, native.Q5Packed))  # uint8 scales: super-block factors, no offset
    if affine and scales[0].dtype not in (scales[1].dtype, torch.uint8):
        raise _Invalid(f"{what} has scales and offsets of two dtypes")


_SCALES = (torch.float32, torch.float16)


# ---- writing -------------------------------------------------------------------------------------------
def _collect(model: DecoderLM) -> tuple[dict[str, ProjectionPacks], native.Packed, native.Packed] | str:
    """The installed model's packs, or why they cannot be cached (all or nothing: module docstring)."""
    projections: dict[str, ProjectionPacks] = {}
    for slot in pack_slots(model):
        module = getattr(slot.owner, slot.attr)
        packed = module.packed_weights if isinstance(module, FastLinear) else None
        if packed is None:
            return f"{slot.key} does not run every row on the native kernels"
        projections[slot.key] = packed
    head, embed = model.fast_lm_head, model.model.embed_tokens
    if not isinstance(head, FastLMHead) or not head.from_stored or head.table is None:
        return "the logits head is not the file's own groups"
    if not isinstance(embed, StoredEmbedding):
        return "the embedding is not kept as the file's groups"
    return projections, head.table, embed.table


def _write(
    path: Path,
    key: str,
    material: dict[str, Any],
    projections: dict[str, ProjectionPacks],
    head: native.Packed,
    embedding: native.Packed,
) -> None:
    """The cache file, written to a temporary name and renamed into place."""
    tensors: list[torch.Tensor] = []

    def record(p: native.Packed) -> dict[str, Any]:
        out: dict[str, Any] = {"type": type(p).__name__, "tensors": {}, "values": {}}
        for field in dataclasses.fields(p):
            value = getattr(p, field.name)
            if isinstance(value, torch.Tensor):
                out["tensors"][field.name] = len(tensors)
                tensors.append(value.contiguous())
            else:
                out["values"][field.name] = value
        return out

    index: dict[str, Any] = {"key": key, "material": material, "projections": {}}
    for name, packed in projections.items():
        if isinstance(packed, native.Q4Packed):
            index["projections"][name] = {"q4": record(packed)}
        else:
            index["projections"][name] = {"parts": [[s, e, record(p)] for s, e, p in packed]}
    index["head"] = record(head)
    index["embedding"] = "head" if embedding is head else record(embedding)
    # offsets once the index's length is known (it holds them: fixed-width placeholders first)
    index["tensors"] = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": 0,
                         "nbytes": t.numel() * t.element_size()} for t in tensors]  # fmt: skip
    index["digest"], index["size"] = "0" * 64, 0
    start = _ALIGN * -(-(16 + len(json.dumps(index)) + 64 * len(tensors) + 64) // _ALIGN)  # room for offsets
    offset = start
    for entry in index["tensors"]:
        entry["offset"], offset = offset, _ALIGN * -(-(offset + entry["nbytes"]) // _ALIGN)
    index["size"], index["digest"] = offset, _digest(tensors)
    blob = json.dumps(index).encode()
    assert 16 + len(blob) <= start, "the index outgrew the room left for it"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
            for t, entry in zip(tensors, index["tensors"], strict=True):
                f.write(b"\0" * (entry["offset"] - f.tell()))
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            f.truncate(offset)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    logger.info("pack cache: wrote %s (%.1f MB)", path, offset / 1e6)


def _headroom(total: int) -> int:
    """Bytes a write must leave free on a disk of `total` bytes: 10% of it, within [2 GiB, 10 GiB] (a shared
    machine's other work comes before a faster second start; a large disk's last 10 GiB are headroom enough)."""
    return min(max(total // 10, 2 * 2**30), 10 * 2**30)


def _headroom_text(folder: Path) -> str:
    return f"{_headroom(shutil.disk_usage(folder).total) / 2**30:.1f} GiB"


def _room_for(folder: Path, packs: tuple[dict[str, ProjectionPacks], native.Packed, native.Packed]) -> bool:
    """Whether writing `packs` leaves the disk at least _headroom free."""
    projections, head, embedding = packs
    tables = [p for packed in projections.values() for p in ([packed] if isinstance(packed, native.Q4Packed)
              else [p for _, _, p in packed])] + [head] + ([] if embedding is head else [embedding])  # fmt: skip
    size = sum(t.nbytes for t in tables)
    folder.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(folder)
    return usage.free - size >= _headroom(usage.total)


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of every tensor's first and last _SAMPLE bytes: catches a short or zeroed file cheaply."""
    digest = hashlib.sha256()
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        digest.update(flat[:_SAMPLE].numpy().tobytes() + flat[-_SAMPLE:].numpy().tobytes())
    return digest.hexdigest()


def _evict(folder: Path, max_bytes: int, keep: Path) -> None:
    """Remove the least recently used cache files until the rest fit `max_bytes` (`keep` stays), and
    temporary files an interrupted write left more than an hour ago."""
    now, files = time.time(), []
    for f in folder.iterdir():
        with contextlib.suppress(OSError):
            st = f.stat()
            if f.suffix == ".tmp" and now - st.st_mtime > 3600:
                f.unlink()
            elif f.suffix == ".ocpack":
                files.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= max_bytes:
            break
        if f != keep:
            with contextlib.suppress(OSError):
                f.unlink()
                total -= size


# ---- reading -------------------------------------------------------------------------------------------
def _read(path: Path, key: str, material: dict[str, Any], expected: _Expected) -> CachedPacks:
    """Map the file and check it against the key and the model's shapes (_Invalid says what is wrong)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = f.read(16)
        if len(start) < 16 or start[:8] != MAGIC:
            raise _Invalid("not a pack cache file of this version")
        (length,) = struct.unpack("<Q", start[8:])
        if 16 + length > size:
            raise _Invalid("truncated index")
        index = json.loads(f.read(length))
        if index.get("key") != key or index.get("material") != material:
            raise _Invalid("its key is not this file's and code's")
        if index["size"] != size:
            raise _Invalid(f"{size} bytes, the index says {index['size']}")
        # read-only and shared: the page cache's pages themselves (a private writable map would copy
        # each page MAP_POPULATE faults in); populated now, in one call, not a fault per page later
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    tensors = []
    for entry in index["tensors"]:
        dtype, offset, nbytes = _DTYPES[entry["dtype"]], int(entry["offset"]), int(entry["nbytes"])
        shape = [int(d) for d in entry["shape"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % _ALIGN or offset + nbytes > size or nbytes != itemsize * _numel(shape):
            raise _Invalid(f"tensor at {offset} ({nbytes} bytes) does not fit its shape or the file")
        with warnings.catch_warnings():  # "not writable": nothing writes a packed weight
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.empty(0, dtype=dtype)  # an empty tensor (a Q4Packed's unused offset): no bytes
            if nbytes:
                flat = torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)
        tensors.append(flat.view(shape))
    if _digest(tensors) != index["digest"]:
        raise _Invalid("its data's digest differs (a damaged file)")

    def packed(rec: dict[str, Any]) -> native.Packed:
        fields = {name: tensors[int(i)] for name, i in rec["tensors"].items()} | rec["values"]
        return _PACKED[rec["type"]](**fields)

    projections: dict[str, ProjectionPacks] = {}
    for name, entry in index["projections"].items():
        if "q4" in entry:
            q4 = packed(entry["q4"])
            if not isinstance(q4, native.Q4Packed):
                raise _Invalid(f"{name} is stored whole but not as 4-bit groups")
            projections[name] = q4
        else:
            projections[name] = [(int(s), int(e), packed(rec)) for s, e, rec in entry["parts"]]
    head = packed(index["head"])
    embedding = head if index["embedding"] == "head" else packed(index["embedding"])
    _check_all(projections, head, embedding, expected)
    return CachedPacks(path, projections, head, embedding, expected.act8)


def _check_all(
    projections: dict[str, ProjectionPacks],
    head: native.Packed,
    embedding: native.Packed,
    expected: _Expected,
) -> None:
    """Every packed weight is what this model's packing makes (_check_packed), the parts of each
    projection cover its rows, and tied is tied: else _Invalid. Run on a file's contents before they
    are used, and on the packs before they are written (a model whose packs would never pass is not
    written at all, rather than rewritten at every start)."""
    if set(projections) != set(expected.projections):
        raise _Invalid("it holds other projections than this model's")
    for name, (n, k) in expected.projections.items():
        packed = projections[name]
        if isinstance(packed, native.Q4Packed):
            _check_packed(packed, n, k, expected.act8, name)
            continue
        if (
            not packed
            or packed[0][0] != 0
            or packed[-1][1] != n
            or any(a[1] != b[0] for a, b in zip(packed, packed[1:]))
        ):
            raise _Invalid(f"{name}'s parts do not cover its {n} rows")
        for start, end, p in packed:
            _check_packed(p, end - start, k, expected.act8, f"{name}[{start}:{end}]")
    vocab, hidden = expected.table
    _check_packed(head, vocab, hidden, False, "the head")  # act8 is for projections: the head's never is
    if (embedding is head) != expected.tied:
        raise _Invalid("tied and untied embeddings differ")
    if embedding is not head:
        _check_packed(embedding, vocab, hidden, False, "the embedding")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
