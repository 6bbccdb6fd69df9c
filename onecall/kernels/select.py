"""Which kernels a model or a step runs on: the implementations of kernels/ops.py's interface.

    layer_ops(device, dtype, kernels)    when a model is built: the native C ops on a float32 CPU model
                                         with the fast kernels (when they build), Triton's on CUDA
                                         with the fast kernels (when triton imports), else the reference
    attention_kernels(backend, device)   per step, with the attention backend: "triton" its one-call
                                         kernel; "paged" on CPU the native decode and prefill kernels
                                         (when they build); else torch

Implementations are imported here only when chosen: Triton loads only for a CUDA fast-path model.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from onecall.kernels.ops import REFERENCE_OPS, TORCH_ATTENTION, AttentionKernels, LayerOps


def fast_kernels_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the CPU fast path (FastLinear, FastLMHead, the native ops) serves this model: float32 on
    the CPU with oneDNN in torch; elsewhere the reference modules stay."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def layer_ops(device: torch.device | str, dtype: torch.dtype, kernels: str) -> LayerOps:
    """The fused ops for a model's layers: `kernels` is EngineConfig.kernels ("fast" or "reference")."""
    if kernels != "fast":
        return REFERENCE_OPS
    kind = torch.device(device).type
    if kind == "cpu" and fast_kernels_supported(device, dtype):
        from onecall.kernels.cpu import native

        lib = native.load()
        if lib is not None:
            from onecall.kernels.cpu.ops import NativeLayerOps

            return NativeLayerOps(lib)
    if kind == "cuda" and triton_available():
        from onecall.kernels.cuda.fused_ops import TritonLayerOps

        return TritonLayerOps()
    return REFERENCE_OPS


def attention_kernels(backend: str, device: torch.device | str) -> AttentionKernels:
    """The kernels a step's attention runs on, for its backend (model/attention_metadata.py); one
    object per backend and device kind, made at its first step."""
    return _attention_kernels(backend, torch.device(device).type)


@functools.cache
def _attention_kernels(backend: str, device_type: str) -> AttentionKernels:
    if backend == "triton":
        from onecall.kernels.cuda.fused_ops import TritonAttention

        return TritonAttention()
    if backend == "paged" and device_type == "cpu":
        from onecall.kernels.cpu import native

        lib = native.load()
        if lib is not None:
            from onecall.kernels.cpu.ops import NativeAttention

            return NativeAttention(lib)
    return TORCH_ATTENTION
