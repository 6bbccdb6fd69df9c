"""Every environment variable onecall reads, in one place, all with the ONECALL_ prefix.

ONECALL_CACHE_DIR        where built kernels and packed weights are cached (default $XDG_CACHE_HOME/onecall,
                         else ~/.cache/onecall)
ONECALL_NATIVE_KERNELS   "0" turns the native CPU kernels off (torch's own kernels run instead)
ONECALL_PACK_CACHE       "0" turns the packed-weights cache off (loading/pack_cache.py: a GGUF's
                         projections packed for the native kernels, kept in <cache dir>/packed so a
                         second start maps them instead of decoding and packing the file again;
                         `rm -r <cache dir>/packed` empties it)
ONECALL_PACK_CACHE_DIR   that folder, elsewhere (tests point it at a temporary folder)
ONECALL_PACK_CACHE_GIB   the most that folder keeps, in GiB (default 20): after a write, the least
                         recently used files go until the rest fit
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The folder onecall caches build artifacts in (not created here)."""
    explicit = os.environ.get("ONECALL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "onecall"


def disable_native_kernels() -> bool:
    return os.environ.get("ONECALL_NATIVE_KERNELS", "1").strip() == "0"


def pack_cache_dir() -> Path:
    """Where loading/pack_cache.py keeps packed weights (not created here)."""
    explicit = os.environ.get("ONECALL_PACK_CACHE_DIR")
    return Path(explicit) if explicit else cache_dir() / "packed"


def pack_cache_enabled() -> bool:
    return os.environ.get("ONECALL_PACK_CACHE", "1").strip() != "0"


def pack_cache_max_bytes() -> int:
    """ONECALL_PACK_CACHE_GIB in bytes; an unreadable or negative value is the default, 20 GiB."""
    try:
        gib = float(os.environ.get("ONECALL_PACK_CACHE_GIB", "20"))
    except ValueError:
        gib = 20.0
    return int((gib if gib >= 0 else 20.0) * 2**30)
