"""Every environment variable onecall reads, in one place, all with the ONECALL_ prefix.

ONECALL_CACHE_DIR        where built kernels are cached (default $XDG_CACHE_HOME/onecall,
                         else ~/.cache/onecall)
ONECALL_NATIVE_KERNELS   "0" turns the native CPU kernels off (torch's own kernels run instead)
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
