"""Session-wide test setup.

Triton's interpreter (TRITON_INTERPRET=1) must be chosen before triton is first imported, by any
module: transformers and torch can import it on their own. Without a CUDA device it is the only
way Triton kernels run, so the whole session uses it (tests/test_triton_attention.py,
tests/test_gpu_check.py); with one, kernels run compiled on the device.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _silence_stderr() -> None:
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def pytest_unconfigure(config: object) -> None:
    """Triton's interpreter can leave IR objects alive until interpreter shutdown, where nanobind
    reports them ("nanobind: leaked N instances") on stderr, after pytest's summary line. The summary
    is the run's last word: once pytest is done (atexit runs after it restored its captured file
    descriptors, before the shutdown report), stderr is closed, only when triton was loaded."""
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)
