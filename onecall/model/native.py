"""The native CPU kernels (csrc/*.c, one library): built with the system C compiler at first use, cached.

Why native code at all: on an AVX2 CPU, torch's own int4 kernel expands 4-bit weights to floats
and runs float FMAs; it is compute-bound well below the memory bandwidth (measured in the README's
kernel table). The kernels in csrc/ multiply the GGUF's own 4-bit groups by int16-quantized
activations with exact integer dot products (llama.cpp's idea, at a finer activation step), keep
the Q8_0 logits matrix as int8, and read the paged KV cache in place for decode attention and for
causal prefill attention (a flash-style tiled kernel, prefill_attention.c).

How they are built and loaded:
- `cc -O3 -mavx2 -mfma -mf16c -fopenmp -shared -ffp-contract=off` on the sources into one library
  (about a second), into a cache folder keyed by a hash of the sources, the flags and the compiler's version: the next start loads the cached library.
  The folder is $ONECALL_CACHE_DIR/kernels, else $XDG_CACHE_HOME/onecall/kernels, else
  ~/.cache/onecall/kernels (read in onecall/envs.py).
- loaded with ctypes after torch, so the library's libgomp is the one torch already loaded (the
  same soname): one OpenMP thread pool, not two competing for the cores.
- not available (no AVX2/FMA/F16C, no compiler, a failed build): `load()` returns None, says why in
  `unavailable_reason()`, and the fast path falls back to torch's own kernels. Nothing raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onecall import envs

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (  # one library, one cache key
    _CSRC / "gemm.c",  # the quantized GEMMs (q4, q4a8, q8b) and their activation quantization
    _CSRC / "decode_attention.c",  # paged decode attention
    _CSRC / "decode_step.c",  # the small fused ops and the whole decode step (onecall_decode_layers)
    _CSRC / "prefill_attention.c",  # causal prefill attention
)
# included by the sources: part of the cache key, not compiled alone
_HEADERS = (_CSRC / "kernels.h", _CSRC / "simd.h")
# -ffp-contract=off: float arithmetic runs as written (FMAs only where the code asks for one), so two
# paths that should give the same bits (float16 vs float32 scales, a row alone vs in a batch) do.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off")
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# K/V cache dtypes the native decode attention and cache writes read and write directly.
KV_DTYPES = (torch.float32, torch.float16)
ATTENTION_MAX_HEADS = 128  # query heads decode attention takes (csrc/decode_attention.c: ATTN_MAX_HEADS)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernels are unavailable; None until load() decided
_loaded = False


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where that cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load() -> ctypes.CDLL | None:
    """The kernel library, building it on first use; None where it cannot run here (see the docstring)."""
    global _lib, _reason, _loaded
    if _loaded:  # decided already (the hot path: no lock)
        return _lib
    with _lock:
        if not _loaded:
            try:
                _lib = _build_and_load()
            except _Unavailable as e:
                _reason = str(e)
            _loaded = True  # only now: a thread that saw _loaded outside the lock must see _lib set
        return _lib


def unavailable_reason() -> str | None:
    """Why load() returned None (after it was called), else None."""
    return _reason


class _Unavailable(Exception):
    pass


def _build_and_load() -> ctypes.CDLL:
    if envs.disable_native_kernels():
        raise _Unavailable("disabled by ONECALL_NATIVE_KERNELS=0")
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        raise _Unavailable(f"this CPU lacks {', '.join(missing)}")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise _Unavailable("no C compiler (cc or gcc) on PATH")
    path = _cached_library(compiler)
    torch.ones(1).add_(1)  # torch's libgomp is loaded (it is, once torch is imported); reuse it
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise _Unavailable(f"could not load {path}: {e}") from e
    _declare(lib)
    return lib


def _cached_library(compiler: str) -> Path:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise _Unavailable(f"{compiler} --version failed: {e}") from e
    sources = b"".join(s.name.encode() + b"\0" + s.read_bytes() for s in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(sources + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    folder = envs.cache_dir() / "kernels"
    path = folder / f"onecall-kernels-{key}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / path.name
            result = subprocess.run(
                [compiler, *_FLAGS, "-o", str(out), *map(str, _SOURCES), "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode != 0:
                raise _Unavailable(f"building the kernels failed: {result.stderr.strip()[-500:]}")
            os.replace(out, path)  # atomic: a concurrent start sees no half-written library
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building the kernels failed: {e}") from e
    return path


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.onecall_q4_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, p, c_int, c_int]
    lib.onecall_q4_gemm.restype = c_int
    lib.onecall_q4a8_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, p, c_int, c_int]
    lib.onecall_q4a8_gemm.restype = c_int
    lib.onecall_q8b_gemm.argtypes = [p, i64, i64, p, p, i64, p, p, c_int, c_int]
    lib.onecall_q8b_gemm.restype = c_int
    # q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, S, H, KVH, D, block_size,
    # scale, window, softcap, out, num_threads, kv_f16
    f32 = ctypes.c_float
    attention_args: list[Any] = [p, i64, p, p, p, i64, p, i64, i64, i64, i64, i64, f32, i64, f32, p, c_int, c_int]  # fmt: skip
    lib.onecall_paged_decode_attention.argtypes = attention_args
    lib.onecall_paged_decode_attention.restype = c_int
    # q, q_stride, k_cache, v_cache, blocks, kv_start, block_size, query_len, seq_len, H, KVH, D, scale,
    # window, softcap, out, num_threads, kv_f16
    prefill_args: list[Any] = [p, i64, p, p, p, i64, i64, i64, i64, i64, i64, i64, f32, i64, f32, p, c_int, c_int]  # fmt: skip
    lib.onecall_prefill_attention.argtypes = prefill_args
    lib.onecall_prefill_attention.restype = c_int
    lib.onecall_add_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float, p]
    lib.onecall_add_rms_norm.restype = None
    lib.onecall_silu_mul.argtypes = [p, i64, i64, p]
    lib.onecall_silu_mul.restype = None
    lib.onecall_rope_store.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_float, p, p, p, p, p, c_int]
    lib.onecall_rope_store.restype = None
    # layers, num_layers, h, M, hidden, H, KVH, D, I, eps, attn_scale, cos, sin, slot_mapping, k_cache,
    # v_cache, layer_stride, kv_f16, block_tables, max_blocks, seq_lens, block_size, final_norm, out,
    # num_threads (model/native_step.py)
    step_args: list[Any] = [p, i64, p, i64, i64, i64, i64, i64, i64, f32, f32, p, p, p, p, p, i64, c_int]
    lib.onecall_decode_layers.argtypes = [*step_args, p, i64, p, i64, p, p, c_int]
    lib.onecall_decode_layers.restype = c_int


# ---- the kernels, on tensors ------------------------------------------------------------------
@dataclass(frozen=True)
class Q4Packed:
    """A 4-bit weight (N, K) in the q4 kernel's layout (csrc: rows in units of 16, two blocks of 8, N
    padded to whole units): qs (N16 / 16, K / 32, 2, 8, 8, 2) uint8, scale and offset (N16 / 16, K / 32,
    2, 8) float32 or float16. With act8, qs is in the q4a8 layout, (N16 / 16, K / 32, 2, 4, 8, 4), and
    runs with int8 activations."""

    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    out_features: int  # N: rows of the weight (the padding rows are never written out)
    in_features: int  # K
    act8: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.offset))


def pack_q4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, act8: bool = False) -> Q4Packed:
    """(N, K) uint8 values 0..15 with (N, K / 32) scales and offsets (float32, or float16 where they are
    exact so: fewer bytes to read) -> the q4 kernel's layout. w = q * scale + offset per group of 32.
    act8: the q4a8 layout instead, for the kernel that quantizes activations to int8 (csrc)."""
    n, k = q.shape
    assert k % 32 == 0 and tuple(scale.shape) == tuple(offset.shape) == (n, k // 32)
    assert scale.dtype == offset.dtype and scale.dtype in (torch.float32, torch.float16)
    n16, g = -(-n // 16) * 16, k // 32
    pad = n16 - n
    q = q.to(torch.uint8)
    if pad:
        q = torch.cat((q, q.new_zeros(pad, k)))
        scale = torch.cat((scale, scale.new_zeros(pad, g)))
        offset = torch.cat((offset, offset.new_zeros(pad, g)))
    # byte j of a row's group: column j low, column 16 + j high (both <= 15), in one pass
    halves = q.view(n16, g, 2, 16)
    pairs = torch.empty(n16, g, 16, dtype=torch.uint8)
    torch.add(halves[:, :, 0], halves[:, :, 1], alpha=16, out=pairs)
    if act8:  # four bytes (columns 4j..4j+3) move together as one int32:
        # (unit, block, row, G, quarter) -> (unit, G, block, quarter, row)
        quads = pairs.view(torch.int32).view(n16 // 16, 2, 8, g, 4).permute(0, 3, 1, 4, 2).contiguous()
        qs = quads.view(torch.uint8).view(n16 // 16, g, 2, 4, 8, 4)
        return Q4Packed(qs, _blocked(scale, n16, g), _blocked(offset, n16, g), n, k, act8=True)
    # the two bytes of a column pair move together as one int16:
    # (unit, block, row, G, pair) -> (unit, G, block, pair, row)
    qs = pairs.view(torch.int16).view(n16 // 16, 2, 8, g, 8).permute(0, 3, 1, 4, 2).contiguous()
    qs = qs.view(torch.uint8).view(n16 // 16, g, 2, 8, 8, 2)
    return Q4Packed(qs, _blocked(scale, n16, g), _blocked(offset, n16, g), n, k)


def _blocked(t: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """(N16, G) per-row group values -> (N16 / 16, G, 2, 8): a unit's two blocks' rows of one group side
    by side."""
    return t.view(n16 // 16, 2, 8, g).permute(0, 3, 1, 2).contiguous()


def q4_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: Q4Packed, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_q4."""
    m, k = x.shape
    assert k == w.in_features and x.dtype == torch.float32 and x.is_contiguous()
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    kernel = lib.onecall_q4a8_gemm if w.act8 else lib.onecall_q4_gemm
    rc = kernel(
        x.data_ptr(), m, k, w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), w.out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), num_threads, int(w.scale.dtype == torch.float16),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{kernel.__name__}: out of memory for the activation buffer")
    return y


@dataclass(frozen=True)
class Q8Blocked:
    """An int8 weight (N, K) in the q8b layout (csrc: rows in units of 16, N padded to whole units):
    qs (N16 / 16, K / 32, 2, 16, 8, 2) int8, scale (N16 / 16, K / group_size, 2, 8) float32."""

    qs: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int
    group_size: int  # 32 (Q8_0) or 16 (Q6_K)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.scale.numel() * 4


def pack_q8_blocked(q: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> Q8Blocked:
    """(N, K) int8 with (N, K / group_size) scales -> the q8b layout. w = q * scale per group."""
    n, k = q.shape
    assert k % 32 == 0 and group_size in (16, 32) and tuple(scale.shape) == (n, k // group_size)
    n16, g, gs = -(-n // 16) * 16, k // 32, k // group_size
    q, scale = q.to(torch.int8), scale.float()
    if n16 > n:
        q = torch.cat((q, q.new_zeros(n16 - n, k)))
        scale = torch.cat((scale, scale.new_zeros(n16 - n, gs)))
    # a column pair's two bytes move together as one int16: (unit, block, row, G, pair) ->
    # (unit, G, block, pair, row)
    pairs = q.contiguous().view(torch.int16).view(n16 // 16, 2, 8, g, 16).permute(0, 3, 1, 4, 2).contiguous()
    qs = pairs.view(torch.int8).view(n16 // 16, g, 2, 16, 8, 2)
    return Q8Blocked(qs, _blocked(scale, n16, gs), n, k, group_size)


def q8_blocked_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: Q8Blocked, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_q8_blocked;
    activations rounded to int16 steps per group of 32, as the q4 kernel does."""
    m, k = x.shape
    assert k == w.in_features and x.dtype == torch.float32 and x.is_contiguous()
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    rc = lib.onecall_q8b_gemm(
        x.data_ptr(), m, k, w.qs.data_ptr(), w.scale.data_ptr(), w.out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), num_threads, w.group_size,
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_q8b_gemm: out of memory for the activation buffer")
    assert rc == 0, f"onecall_q8b_gemm refused group size {w.group_size} or K {k} (rc {rc})"
    return y


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    num_threads: int,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged KV, read in place (see csrc).

    q (S, H, D) float32 with contiguous heads (rows may be strided: a slice of the fused qkv output);
    k_cache, v_cache (num_slots, KVH, D) float32 or float16, contiguous; block_tables (S, max_blocks) int32;
    seq_lens (S,) int32. Returns (S, H, D) float32. sliding_window: each query sees only its last
    that many positions; logit_softcap: scores -> softcap * tanh(scores / softcap) (model/attention.py).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    rc = lib.onecall_paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, scale, sliding_window or 0, logit_softcap or 0.0, out.data_ptr(), num_threads,
        int(k_cache.dtype == torch.float16),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_paged_decode_attention: out of memory for partial results")
    assert rc == 0, f"onecall_paged_decode_attention refused the shapes (rc {rc})"
    return out


def decode_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes paged_decode_attention takes: float32 queries, a float32 or float16 cache,
    head_dim a multiple of 8, at most 128 query heads, whole query heads per KV head."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[1]
    return (
        q.dtype == torch.float32
        and k_cache.dtype in KV_DTYPES
        and head_dim % 8 == 0
        and num_heads <= ATTENTION_MAX_HEADS
        and num_heads % num_kv_heads == 0
    )


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: int,
    kv_start: int,
    blocks: torch.Tensor | None,
    block_size: int,
    scale: float,
    num_threads: int,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One sequence's causal attention for its query_len new rows over its seq_len positions, the KV
    read in place (csrc/prefill_attention.c). Row i is at position seq_len - query_len + i and sees
    keys 0 .. its position (its last `sliding_window` of them with a window).

    q (query_len, H, D) float32 with contiguous heads (rows may be strided); k_cache, v_cache
    (num_slots, KVH, D) float32 or float16, contiguous; the KV at slots kv_start + p (kv_start >= 0),
    else through `blocks` (num_blocks,) int64. Returns (query_len, H, D) float32. Shapes must pass
    prefill_attention_fits."""
    query_len, num_heads, head_dim = q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert (kv_start >= 0) != (blocks is not None), "the KV is one run (kv_start) or blocks, not both"
    assert blocks is None or (blocks.dtype == torch.int64 and blocks.is_contiguous())
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(query_len, num_heads, head_dim, dtype=torch.float32)
    rc = lib.onecall_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        None if blocks is None else blocks.data_ptr(), kv_start, block_size, query_len, seq_len,
        num_heads, k_cache.shape[1], head_dim, scale, sliding_window or 0, logit_softcap or 0.0,
        out.data_ptr(), num_threads, int(k_cache.dtype == torch.float16),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_prefill_attention: out of memory for its tile buffers")
    assert rc == 0, f"onecall_prefill_attention refused the shapes (rc {rc})"
    return out


def prefill_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes prefill_attention takes: float32 queries, a float32 or float16 cache, head_dim
    a multiple of 16 up to 512, whole query heads per KV head."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[1]
    return (
        q.dtype == torch.float32
        and k_cache.dtype in KV_DTYPES
        and head_dim % 16 == 0
        and head_dim <= 512
        and num_heads % num_kv_heads == 0
    )


def add_rms_norm(
    lib: ctypes.CDLL, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += residual (in place, when given), then returns RMSNorm(h) * weight. h, residual (M, K)
    float32 contiguous, weight (K,) float32."""
    m, k = h.shape
    assert h.is_contiguous() and (residual is None or residual.is_contiguous())
    y = torch.empty_like(h)
    lib.onecall_add_rms_norm(
        h.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        m,
        k,
        eps,
        y.data_ptr(),
    )
    return y


def silu_mul(lib: ctypes.CDLL, y: torch.Tensor) -> torch.Tensor:
    """y (M, 2I) float32 contiguous -> silu(y[:, :I]) * y[:, I:], (M, I)."""
    m, two_i = y.shape
    assert y.is_contiguous() and two_i % 2 == 0
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    lib.onecall_silu_mul(y.data_ptr(), m, two_i // 2, out.data_ptr())
    return out


def rope_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on qkv's q and k heads in place, then its k and v heads stored at their cache slots.

    qkv (M, (H + 2 KVH) * D) float32 contiguous; cos, sin (M, D / 2) float32 contiguous; slot_mapping
    (M,) int64; k_cache, v_cache (num_slots, KVH, D) float32 contiguous. qk_norm: (q weight (D,),
    k weight (D,), eps), Qwen3's per-head RMSNorm, applied to every q / k head before it is rotated.
    """
    m = qkv.shape[0]
    head_dim = k_cache.shape[2]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
    assert k_cache.dtype in KV_DTYPES and (k_cache.dtype == torch.float32 or num_kv_heads * head_dim % 8 == 0)
    q_norm = k_norm = None
    eps = 0.0
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        assert q_w.dtype == k_w.dtype == torch.float32 and q_w.is_contiguous() and k_w.is_contiguous()
        assert q_w.numel() == k_w.numel() == head_dim
        q_norm, k_norm = q_w.data_ptr(), k_w.data_ptr()
    lib.onecall_rope_store(
        qkv.data_ptr(), m, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.float16),
    )  # fmt: skip


def quantize_q8_groups(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) int8 in [-127, 127], scale (N, K / group_size) float32), per group
    absmax / 127. For a weight that was stored as Q8_0 this recovers the stored values (to float32
    rounding of the scale); for any other weight it is a lossy approximation."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 127.0  # (N, G)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q.contiguous(), scale.contiguous()
