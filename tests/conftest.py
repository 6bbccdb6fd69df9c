"""Session-wide test setup.

Triton's interpreter (TRITON_INTERPRET=1) must be chosen before triton is first imported, by any
module: transformers and torch can import it on their own. Without a CUDA device it is the only
way Triton kernels run, so the whole session uses it (tests/test_triton_attention.py,
tests/test_gpu_check.py); with one, kernels run compiled on the device.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
