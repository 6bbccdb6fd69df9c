"""Building and loading the native CPU kernels (csrc/*.c): one shared library, built with the
system C compiler at first use, cached on disk, bound from its header; kernels/cpu/native.py calls
them on tensors.

- `cc -O3 -mavx2 -mfma -mf16c -fopenmp -ffp-contract=off -c` on every source at once (gemm_avx512.c's
  tiles carry their own target("avx512f,avx512bw,avx512vl,avx512vnni") attribute and run only where the
  CPU has those: the library itself needs AVX2 alone) (a compiler
  process each, so the cores share the build: ~1.9 s here, ~3.2 s one after another), then one
  `-shared` link into one library, into a cache folder keyed by a hash of the sources, the headers, the flags and
  the compiler's version: the next start loads the cached library. The folder is
  $ONECALL_CACHE_DIR/kernels, else $XDG_CACHE_HOME/onecall/kernels, else ~/.cache/onecall/kernels
  (read in onecall/envs.py). The build passes -Werror=missing-prototypes: every function the
  library exports is declared in kernels.h.
- loaded with ctypes after torch, so the library's libgomp is the one torch already loaded (the
  same soname): one OpenMP thread pool, not two competing for the cores.
- bound from csrc/kernels.h, the interface's one declaration (native_abi.py): the functions'
  ctypes signatures are derived from its prototypes and the ctypes mirrors of its structs are
  checked against it and against the compiled layout. A header or mirror that disagrees is a
  RuntimeError from `load()`: a bug to fix, not a reason to fall back.
- not available (no AVX2/FMA/F16C, no compiler, a failed build, ONECALL_NATIVE_KERNELS=0): `load()`
  returns None, says why in `unavailable_reason()`, and the fast path falls back to torch's own
  kernels; none of these raises. `load()` decides once per process (thread-safe).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from onecall import envs
from onecall.kernels.cpu import native_abi

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (  # one library, one cache key
    _CSRC / "gemm.c",  # the quantized GEMMs (q4, q4a8, q8b)
    _CSRC / "gemm_q5.c",  # the 5-bit GEMM (q5) and rows of a 5-bit table
    _CSRC / "gemm_kq.c",  # the K-quants' 6-, 3- and 2-bit codes (Q6_K, Q3_K, Q2_K: kq) and their rows
    _CSRC / "gemm_avx512.c",  # AVX-512 VNNI tiles of the q4/q8b/iq4/q5 GEMMs, chosen at run time
    _CSRC / "gemm_kq_avx512.c",  # the AVX-512 VNNI tile of the kq GEMM, chosen at run time
    _CSRC / "gemm_half.c",  # the F16 / BF16 GEMM
    _CSRC / "decode_attention.c",  # paged decode attention
    _CSRC / "decode_step.c",  # the small fused ops and the whole decode step (onecall_decode_layers)
    _CSRC / "prefill_attention.c",  # causal prefill attention
    _CSRC / "embedding.c",  # rows of a quantized table (a token embedding kept as stored)
    _CSRC / "argmax.c",  # the greedy pick over a step's logits
    _CSRC / "delta_rule.c",  # a Gated DeltaNet layer's decode rows, its states read and written in place
    _CSRC / "layout.c",  # the structs' sizes and offsets, for the load-time check of their mirrors
)
_HEADER = _CSRC / "kernels.h"  # everything the library exports, and the structs Python fills
# included by the sources: part of the cache key, not compiled alone
_HEADERS = (_HEADER, _CSRC / "simd.h", _CSRC / "act_quant.h", _CSRC / "gemm_avx512.h", _CSRC / "codebooks.h")
# -ffp-contract=off: float arithmetic runs as written (FMAs only where the code asks for one), so two
# paths that should give the same bits (float16 vs float32 scales, a row alone vs in a batch) do.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-std=c11", "-ffp-contract=off")
_LINK_FLAGS = ("-shared", "-fopenmp")
# this tree's sources only (not load_from's: an older revision's header declared less): a non-static
# function without a prototype in kernels.h is an error, not a silent export Python cannot see
_CHECKS = ("-Werror=missing-prototypes",)
_GEMMS = ("onecall_q4_gemm", "onecall_q4a8_gemm", "onecall_q8b_gemm")  # what load_from's caller A/Bs
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_lock = threading.Lock()
_lib: native_abi.KernelLibrary | None = None
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


def load() -> native_abi.KernelLibrary | None:
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


def load_from(csrc: Path, out_dir: Path) -> native_abi.KernelLibrary:
    """Another copy of the kernel sources (every .c file in `csrc`, e.g. an older revision's) built
    with the same compiler and flags into `out_dir` and loaded beside this one, for an A/B of the
    GEMMs in one process (benchmarks/bench_kernels.py --against). Bound from its own kernels.h, whose
    three GEMM prototypes must take what this version's do (this version's native.py calls them).
    Not cached; raises RuntimeError if its header is missing, unreadable or declares other GEMMs, or
    if it cannot be built."""
    if not (csrc / "kernels.h").is_file():
        raise RuntimeError(f"{csrc} has no kernels.h: nothing declares what its functions take")
    theirs, ours = native_abi.read_header(csrc / "kernels.h"), native_abi.read_header(_HEADER)
    for name in _GEMMS:
        if name not in theirs.functions:
            raise RuntimeError(f"{csrc} lacks a GEMM this version calls: {name}")
        there, here = theirs.functions[name], ours.functions[name]
        if there.abi() != here.abi():
            raise RuntimeError(f"{csrc} declares {there}, this version {here}: not comparable")
    compiler = _compiler()
    sources = sorted(csrc.glob("*.c"))
    # a name of its own per build: dlopen hands back an already-loaded path's old handle
    out = out_dir / f"onecall-kernels-other-{_key(sorted(f for f in csrc.iterdir() if f.is_file()))}.so"
    try:
        _compile(compiler, sources, out, checks=())
    except _Unavailable as e:
        raise RuntimeError(str(e)) from e
    torch.ones(1).add_(1)  # torch's libgomp first, as load() does
    return native_abi.KernelLibrary(out, theirs)


def unavailable_reason() -> str | None:
    """Why load() returned None (after it was called), else None."""
    return _reason


class _Unavailable(Exception):
    pass


def _build_and_load() -> native_abi.KernelLibrary:
    if envs.disable_native_kernels():
        raise _Unavailable("disabled by ONECALL_NATIVE_KERNELS=0")
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        raise _Unavailable(f"this CPU lacks {', '.join(missing)}")
    compiler = _compiler()
    header = native_abi.read_header(_HEADER)  # a HeaderError (a RuntimeError) before any build
    path = _cached_library(compiler)
    torch.ones(1).add_(1)  # torch's libgomp is loaded (it is, once torch is imported); reuse it
    try:
        lib = native_abi.KernelLibrary(path, header)
    except OSError as e:
        raise _Unavailable(f"could not load {path}: {e}") from e
    native_abi.check_structs(lib, header, native_abi.MIRRORS)
    return lib


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise _Unavailable("no C compiler (cc or gcc) on PATH")
    return compiler


def _compile(compiler: str, sources: list[Path], out: Path, checks: tuple[str, ...] = _CHECKS) -> None:
    """Each source to an object file, all at once (one compiler process each: the build is the part
    of a first start that the cores can share), then one link into `out`. `checks`: warnings made
    errors (they change no code, so they are not part of the cache key)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{i}-{s.stem}.o" for i, s in enumerate(sources)]
        try:
            jobs = [
                subprocess.Popen(
                    [compiler, *_FLAGS, *checks, "-c", "-o", str(o), str(s)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
                for s, o in zip(sources, objects, strict=True)
            ]
            errors = [err for job in jobs if (err := _finish(job))]
            if not errors:
                link = subprocess.run([compiler, *_LINK_FLAGS, "-o", str(out), *map(str, objects), "-lm"],
                                      capture_output=True, text=True, timeout=300)  # fmt: skip
                errors = [link.stderr.strip()] if link.returncode != 0 else []
        except (OSError, subprocess.SubprocessError) as e:
            raise _Unavailable(f"building the kernels failed: {e}") from e
    if errors:
        raise _Unavailable(f"building the kernels failed: {' '.join(errors)[-500:]}")


def _finish(job: subprocess.Popen[str]) -> str:
    """Wait for one compiler process: '' if it succeeded, else its error output."""
    try:
        _, err = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        return "the compiler ran for over 300 s"
    return err.strip() if job.returncode != 0 else ""


def _key(files: list[Path], *extra: str) -> str:
    """A build's name: a hash of its files (names and bytes), the flags and `extra` (the compiler's
    version)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join([*_FLAGS, *_LINK_FLAGS, *extra]).encode())
    return h.hexdigest()[:16]


def _cached_library(compiler: str) -> Path:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise _Unavailable(f"{compiler} --version failed: {e}") from e
    folder = envs.cache_dir() / "kernels"
    path = folder / f"onecall-kernels-{_key([*_SOURCES, *_HEADERS], version)}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / path.name
            _compile(compiler, list(_SOURCES), out)
            os.replace(out, path)  # atomic: a concurrent start sees no half-written library
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building the kernels failed: {e}") from e
    return path
