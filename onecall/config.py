"""EngineConfig: the one frozen configuration of an engine, validated when built.

What the engine only learns at load time (the model's shape, EOS ids, how many KV
blocks fit the budget) is kept in `LoadedEngineParts` (engine/engine_parts.py), never
written back here. `device` and `dtype` are resolved once, by properties, so every layer
below receives concrete values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onecall.errors import InvalidParameterError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Default KV budget on CPU. SmolLM2-135M needs 45 KiB per token in float32, so 1 GiB holds about
# 23k tokens: a few full 8k contexts. On CUDA the default is a fraction of the memory left after
# the weights are loaded (see Engine).
DEFAULT_CPU_KV_CACHE_GIB = 1.0
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine. None means "pick the default for this model/device"."""

    model: str | None = None  # GGUF file, HF folder, or None for the embedded SmolLM2-135M-Instruct
    device: str | None = None  # "cpu", "cuda", "cuda:1"...; None: cuda if available else cpu
    dtype: str | None = None  # float32 | bfloat16 | float16; None: see default_dtype()
    max_model_len: int | None = None  # context window; None: the model's, capped by the KV budget
    block_size: int = 16  # tokens per KV block
    kv_cache_gib: float | None = None  # KV budget; None: DEFAULT_CPU_KV_CACHE_GIB / a GPU fraction
    max_num_seqs: int = 64  # most sequences running at once
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    enable_prefix_caching: bool = True
    # A hybrid model (linear-attention layers with a per-sequence state): how many prefix snapshots of
    # that state to keep (engine/state_slots.py); each costs one sequence's state from the KV budget
    # (kv_cache_gib, or a GPU's share; the CPU's default budget is KV only, the states on top).
    # None: as many as max_num_seqs with prefix caching, none without
    state_snapshots: int | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    # "fast": the fastest kernels this device has (CPU float32: oneDNN prepacked weights, plus the
    # checkpoint's own int4 groups for small batches; see kernels/cpu/fast_linear.py). "reference": plain
    # torch ops only, the oracle the tests compare the fast path against.
    kernels: str = "fast"
    # With the fast kernels on CPU: 4-bit projections quantize their activations to int8 per group of
    # 32 (llama.cpp's arithmetic) instead of int16: faster prompts and batches. Each projection's
    # outputs move by up to ~1% of their largest (tests/kernels/test_native_kernels.py), more through many
    # layers, so greedy text can differ from the float32 reference's. No effect where the native 4-bit
    # kernel does not run (CUDA, tensor parallel, other weight types): LLM.info.kernels says what ran.
    int8_activations: bool = False
    # dtype of the K/V cache: "auto" is the model's dtype. "float16" halves the bytes a decode step
    # reads from a long context (llama.cpp's default; the native CPU kernels read it directly).
    kv_cache_dtype: str = "auto"
    # On CUDA with the fast kernels: decode steps padded to bucket sizes and replayed as CUDA graphs
    # (engine/decode_graphs.py). False runs every step eagerly.
    cuda_graphs: bool = True
    # Tensor parallel: the model split over this many processes (engine/tp/workers.py), one per
    # device on CUDA (cuda:0 .. cuda:N-1, NCCL), N processes on CPU (gloo). 1: this process alone.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise InvalidParameterError(
                "dtype", f"must be one of float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise InvalidParameterError("device", f"not a torch device: {self.device!r} ({e})") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise InvalidParameterError(
                    "device", f"{self.device!r} asked for, but CUDA is not available here"
                )
        for name, lo in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise InvalidParameterError(name, f"must be an integer >= {lo}, got {value!r}")
        if self.state_snapshots is not None and (
            isinstance(self.state_snapshots, bool) or not isinstance(self.state_snapshots, int) or self.state_snapshots < 0
        ):
            raise InvalidParameterError(
                "state_snapshots", f"must be an integer >= 0, got {self.state_snapshots!r}"
            )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise InvalidParameterError(
                "max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}"
            )
        if self.kv_cache_gib is not None and not (self.kv_cache_gib > 0):
            raise InvalidParameterError("kv_cache_gib", f"must be > 0, got {self.kv_cache_gib!r}")
        if self.kernels not in ("fast", "reference"):
            raise InvalidParameterError("kernels", f"must be 'fast' or 'reference', got {self.kernels!r}")
        if self.int8_activations is True and self.kernels == "reference":
            raise InvalidParameterError(
                "int8_activations", "rounds the fast kernels' activations: it needs kernels='fast'"
            )
        for name in ("enable_prefix_caching", "cuda_graphs", "int8_activations"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise InvalidParameterError(
                "kv_cache_dtype", f"must be auto, float32, bfloat16 or float16; got {self.kv_cache_dtype!r}"
            )
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise InvalidParameterError("num_threads", f"must be an integer >= 1, got {self.num_threads!r}")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidParameterError("tensor_parallel_size", f"must be an integer >= 1, got {n!r}")
        if n == 1:
            return
        dev = self.torch_device
        if dev.type not in ("cpu", "cuda") or dev.index not in (None, 0):
            raise InvalidParameterError(
                "device",
                f"with tensor_parallel_size {n} rank r runs on cuda:r (or the CPU); give 'cuda' or 'cpu', "
                f"not {self.device!r}",
            )
        if dev.type == "cuda" and torch.cuda.device_count() < n:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"{n} ranks need {n} CUDA devices, {torch.cuda.device_count()} are visible",
            )

    @property
    def num_state_slots(self) -> int:
        """A hybrid model's state slots: one per running sequence, then the prefix snapshots."""
        return self.max_num_seqs + self.num_state_snapshots

    @property
    def num_state_snapshots(self) -> int:
        """Prefix snapshots of a hybrid's state: state_snapshots, by default one per running sequence,
        none without prefix caching (nothing would resume from them)."""
        if self.state_snapshots is not None:
            return self.state_snapshots
        return self.max_num_seqs if self.enable_prefix_caching else 0

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return default_dtype(self.torch_device)

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a CUDA GPU of compute capability 8.0 or more (Ampere on), float16 below it (bfloat16
    has no tensor-core path there, and Triton's bfloat16 dot refuses it); float32 on CPU: see
    docs/design.md's "dtype on CPU" note (measured there)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if cuda_supports_bfloat16(device) else torch.float16


def cuda_supports_bfloat16(device: torch.device) -> bool:
    """Whether the GPU's Triton kernels take bfloat16 (compute capability 8.0+)."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def check_device_dtype(device: torch.device, dtype: torch.dtype, kernels: str) -> None:
    """Refuse, naming the field, bfloat16 with the fast (Triton) kernels on a GPU below compute
    capability 8.0, where Triton's bfloat16 dot does not compile: float16 is the default there."""
    if device.type == "cuda" and dtype == torch.bfloat16 and kernels == "fast" and not cuda_supports_bfloat16(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise InvalidParameterError(
            "dtype",
            f"bfloat16 needs a GPU of compute capability 8.0 or more for the fast kernels; {device} is "
            f"{major}.{minor}: use float16 (the default there) or kernels='reference'",
        )
