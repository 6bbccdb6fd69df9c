"""Files -> a ready engine: model weights, tokenizer, and a KV pool sized from a memory budget.

1. resolve the model (GGUF file, HF folder, or the embedded default)
2. config -> ModelConfig (refuses unsupported architectures / rope scaling)
3. tokenizer + chat template (from GGUF metadata or tokenizer.json)
4. build DecoderLM on the device, stream the weights in
5. size the KV pool: budget // bytes per block; the context window is capped by it

With tensor_parallel_size N > 1, the Engine first starts the group (engine/tp/workers.py
start_group, which refuses a model whose heads do not divide by N before any other process exists)
and passes it here; nothing in this module imports engine/tp/. Every rank builds and loads its own 1/N of the model (load_model) and counts the KV blocks its own budget
holds for its own KV heads (kv_blocks_in_budget); the ranks take the smallest count, so every
rank's pool has the same block ids. Rank 0 keeps the scheduler and the tokenizer.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors import safe_open

from onecall.config import (
    DEFAULT_CPU_KV_CACHE_GIB,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    EngineConfig,
    check_device_dtype,
)
from onecall.engine.decode_graphs import BUCKETS, DecodeGraphs
from onecall.engine.step_inputs import StepGroup
from onecall.errors import InvalidParameterError, UnsupportedModelError
from onecall.formats.checkpoint import (
    ModelFiles,
    is_multimodal,
    iter_weights,
    language_model_tensor,
    load_hf_config_dict,
    resolve_model,
    safetensors_shards,
)
from onecall.formats.fused import split_fused_weights
from onecall.formats.gguf import open_gguf
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import StoredGroups
from onecall.kernels.cpu import native
from onecall.loading.pack_cache import PackCache
from onecall.loading.weights import load_weights
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from onecall.model.parallel import TensorParallel, is_fused
from onecall.model.state_cache import LinearStateCache
from onecall.text.tokenizer import Tokenizer


@dataclass
class LoadedEngineParts:
    files: ModelFiles
    model_config: ModelConfig
    model: DecoderLM
    tokenizer: Tokenizer
    kv_cache: PagedKVCache
    num_blocks: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    kernels: str = "reference"  # what the projections run on (DecoderLM.kernels)
    tp_group: StepGroup | None = None  # the other ranks, with tensor_parallel_size > 1
    # loading/pack_cache.py: "hit" (the packed weights were mapped from the cache), "written", "off"
    # (not a GGUF on the packing fast path, or ONECALL_PACK_CACHE=0), or why nothing was written
    pack_cache: str = "off"

    @property
    def vocab_size(self) -> int:
        """Token ids below this run: the tokenizer's ids that the model's embedding has rows for (a
        loaded model has both the same or more rows: check_vocab; tests pair tiny models with the
        embedded tokenizer and feed ids below the model's size)."""
        return min(self.tokenizer.vocab_size, self.model_config.vocab_size)

    @property
    def model_name(self) -> str:
        return self.files.name


def load_engine_parts(config: EngineConfig, group: StepGroup | None = None) -> LoadedEngineParts:
    """The model, tokenizer and KV pool for `config`; under tensor parallel, rank 0's 1/N of them,
    `group` being the ranks already started (Engine starts them: engine/tp/workers.py start_group)."""
    t0 = time.perf_counter()
    device, dtype = config.torch_device, config.torch_dtype
    check_device_dtype(device, dtype, config.kernels)
    if config.num_threads is not None and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    if (group is None) != (config.tensor_parallel_size == 1):
        raise InvalidParameterError(
            "tensor_parallel_size", "a group of ranks is needed exactly when tensor_parallel_size > 1"
        )

    # 1.-2. files and config
    files = resolve_model(config.model)
    model_config = model_config_from_hf(load_hf_config_dict(files))
    state_shape = model_config.linear_state_shape
    if group is not None and state_shape is not None:
        raise UnsupportedModelError(
            f"{files.name}: a hybrid (linear-attention) model runs in one process; tensor parallel "
            "does not split its state yet"
        )
    if group is not None:
        device = group.device
    # 3.-4. tokenizer and weights. The tokenizer builds on a thread while the weights load (the
    # weight work is torch ops that release the GIL): about 0.2 s of cold start off the critical path.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_job = pool.submit(_load_tokenizer, files)
        model, pack_cache = load_model_cached(
            config, files, model_config, dtype, device, group.tp if group else None
        )
        tokenizer = tokenizer_job.result()

    # 5. KV pool: this rank's KV heads; every rank agrees on the smallest pool
    kv_dtype = config.torch_kv_cache_dtype
    num_blocks = kv_blocks_in_budget(config, model.config, kv_dtype, device)
    if group is not None:
        num_blocks = group.agree_num_blocks(num_blocks)
    max_model_len = _check_kv(config, model_config, num_blocks, kv_dtype)
    kv_cache = PagedKVCache(
        model_config.num_kv_layers,
        num_blocks,
        config.block_size,
        model.config.num_key_value_heads,
        model_config.head_dim,
        kv_dtype,
        device,
    )
    if state_shape is not None:  # a hybrid model's linear layers: one state per sequence or snapshot
        kv_cache.state = LinearStateCache(state_shape, config.num_state_slots, dtype, device)
    check_vocab(tokenizer, model_config, files.name)
    release_load_memory(files)
    return LoadedEngineParts(
        files,
        model_config,
        model,
        tokenizer,
        kv_cache,
        num_blocks,
        max_model_len,
        device,
        dtype,
        time.perf_counter() - t0,
        model.kernels,
        group,
        pack_cache,
    )


def release_load_memory(files: ModelFiles) -> None:
    """What loading leaves resident but never reads again goes back to the system: the GGUF's mapped
    pages (GGUFFile.release_pages: the weights now live in their packed copies), and the heap the
    loader freed (unpacked groups, float32 parts before packing: glibc keeps freed memory for reuse
    unless trimmed). On a Qwen2-0.5B Q4_K_M file this took resident memory after load from ~1.6 GB to
    ~0.7 GB (docs/benchmarks.md)."""
    if files.kind == "gguf":
        open_gguf(files.path).release_pages()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def check_vocab(tokenizer: Tokenizer, model_config: ModelConfig, name: str) -> None:
    """A token id past the embedding's rows would fault a step (on CUDA: a device assert that poisons
    the context for every request), so a tokenizer larger than the embedding is refused, as llama.cpp
    refuses it. (An embedding padded past the tokenizer is common and fine.)"""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise UnsupportedModelError(
            f"{name}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{model_config.vocab_size} rows; ids past them could not be run"
        )


def _load_tokenizer(files: ModelFiles) -> Tokenizer:
    if files.kind == "gguf":
        return Tokenizer.from_gguf_metadata(open_gguf(files.path).metadata)
    return Tokenizer.from_hf_folder(files.path)


def load_model(
    config: EngineConfig,
    files: ModelFiles,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> DecoderLM:
    """load_model_cached's model (what a tensor-parallel rank calls: engine/tp/worker_loop.py)."""
    return load_model_cached(config, files, model_config, dtype, device, tp)[0]


def load_model_cached(
    config: EngineConfig,
    files: ModelFiles,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> tuple[DecoderLM, str]:
    """4. Build the module tree and stream the weights in (with `tp`, this rank's slice of them, on
    the reference kernels: see DecoderLM). The fast kernels pack each projection as
    it arrives, keeping a GGUF's own 4-bit groups (decoded once on the way in) and its Q8_0 logits
    weight as int8; no dense copy of the projections is ever kept. A GGUF's packed weights are cached
    (loading/pack_cache.py): a second start maps them back and neither decodes nor packs them. Returns
    the model and what the cache did (LoadedEngineParts.pack_cache).

    With --max-model-len below the model's context window, the model is built for that length: its
    RoPE tables stop there (Gemma 3's two tables at 131,072 positions are 268 MB) and a longrope model
    (Phi-3) picks its short factors when that length is within its original context, as vLLM does."""
    if config.max_model_len is not None and config.max_model_len < model_config.max_position_embeddings:
        model_config = dataclasses.replace(model_config, max_position_embeddings=config.max_model_len)
    model = DecoderLM(
        model_config, dtype=dtype, device=device, kernels=config.kernels, tp=tp,
        int8_activations=config.int8_activations,
    )  # fmt: skip
    stored: dict[str, StoredGroups] | None = {} if model.pack_on_load else None
    cache = PackCache.applies(model, open_gguf(files.path) if files.kind == "gguf" else None)
    cached = cache.lookup() if cache is not None else None
    expand = stored is None or native.load() is None
    if cache is not None and cached is not None:  # only the tensors the cache does not hold
        weights = cache.iter_weights(dtype, stored, expand)
    elif model.tp is None:
        # the native kernels run every row of a projection in any stored form (4- and 5-bit groups, int8
        # groups, F16/BF16: formats/quants.py StoredGroups): such tensors need no float32 expansion (packing.StreamingPacker packs them from their groups; an embedding or
        # lm_head in such groups stays stored too, packing.stays_stored; the rest expands as it loads)
        weights = iter_weights(files, dtype, stored, expand_stored=expand)
    elif files.kind == "hf":
        weights = iter_rank_weights(files, dtype, model.tp, model_config)
    else:  # a GGUF's tensors are read (and dequantized) whole, then sliced
        weights = shard_weights(model.tp, iter_weights(files, dtype), model_config)
    load_weights(model, weights, stored, cached)
    if cache is not None and cached is None:
        cache.save()
    return model.eval(), "off" if cache is None else cache.status


def shard_weights(
    tp: TensorParallel, weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) -> (name, this rank's slice). `config` is the full model's.
    Fused checkpoint projections (Phi-3's qkv_proj, gate_up_proj) are split into their parts first,
    at the full model's sizes (load_weights would split them at this rank's)."""
    for name, tensor in split_fused_weights(weights, config):
        yield name, tp.shard(name, tensor, config)


def iter_rank_weights(
    files: ModelFiles, dtype: torch.dtype, tp: TensorParallel, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors checkpoint's tensors as `shard_weights` gives them, reading from disk only
    this rank's part of each split tensor (safetensors' get_slice); replicated tensors and fused
    projections (split first, at the full model's sizes) are read whole. `config`: the full model's."""
    multimodal = is_multimodal(files)
    for path in safetensors_shards(files.path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = f.keys()  # a safe_open handle is not iterable
            for stored_name in names:
                # a multimodal checkpoint: its language model's tensors under text-only names
                name = language_model_tensor(stored_name) if multimodal else stored_name
                if name is None:
                    continue
                if is_fused(name):
                    yield from shard_weights(
                        tp, iter([(name, _cast(f.get_tensor(stored_name), dtype))]), config
                    )
                    continue
                part = tp.shard_slice(name, config)
                if part is None:
                    yield name, _cast(f.get_tensor(stored_name), dtype)
                    continue
                view = f.get_slice(stored_name)
                rows = view[part.start : part.stop] if part.dim == 0 else view[:, part.start : part.stop]
                yield name, part.pad_rows(_cast(rows, dtype))


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def kv_blocks_in_budget(
    config: EngineConfig, local: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """How many KV blocks of `local` (this rank's model: its own KV heads) the budget holds, after a
    hybrid model's state slots (config.num_state_slots of them) are taken from it: from kv_cache_gib
    or a GPU's share of its free memory. The CPU's default budget is KV only (the states come on top):
    a fixed 1 GiB would otherwise be gone to the states of a small hybrid's 128 default slots."""
    per_block = PagedKVCache.bytes_per_block(
        local.num_kv_layers, config.block_size, local.num_key_value_heads, local.head_dim, dtype
    )
    if config.kv_cache_gib is not None:
        budget = int(config.kv_cache_gib * 2**30)
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # what the allocator holds cached but unused would count as taken
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * DEFAULT_GPU_KV_CACHE_FRACTION)
        if config.cuda_graphs and config.kernels == "fast":  # the static steps' logits buffer, made later
            budget -= DecodeGraphs.logits_bytes(min(config.max_num_seqs, BUCKETS[-1]), local.vocab_size)
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)
    shape = local.linear_state_shape
    if shape is not None and (config.kv_cache_gib is not None or device.type == "cuda"):
        budget -= config.num_state_slots * shape.bytes_per_slot(dtype)
    return max(budget, 0) // per_block


def _check_kv(config: EngineConfig, mc: ModelConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """The context window the pool allows; refuses a pool of fewer than 2 blocks or a max_model_len
    it cannot hold."""
    capacity = num_blocks * config.block_size
    if num_blocks < 2:
        per_block = PagedKVCache.bytes_per_block(
            mc.num_kv_layers, config.block_size, mc.num_key_value_heads, mc.head_dim, dtype
        )
        state = mc.linear_state_shape
        taken = (
            ""
            if state is None
            else f" after the linear layers' states take {config.num_state_slots * state.bytes_per_slot(dtype) / 2**30:.2f} GiB "
            f"({config.num_state_slots} slots of {state.bytes_per_slot(dtype) / 2**20:.1f} MiB: max_num_seqs "
            f"{config.max_num_seqs} + state_snapshots {config.num_state_snapshots}; lower them or raise kv_cache_gib)"
        )
        raise InvalidParameterError(
            "kv_cache_gib",
            f"the KV budget holds {num_blocks} blocks{taken}; at least 2 are needed "
            f"({per_block // config.tensor_parallel_size} bytes each per rank)",
        )
    if config.max_model_len is not None:
        if config.max_model_len > mc.max_position_embeddings:
            raise InvalidParameterError(
                "max_model_len",
                f"{config.max_model_len} exceeds the model's context window ({mc.max_position_embeddings})",
            )
        if config.max_model_len > capacity:
            raise InvalidParameterError(
                "max_model_len",
                f"{config.max_model_len} tokens need more KV cache than the budget holds ({capacity} tokens); "
                "raise kv_cache_gib",
            )
        return config.max_model_len
    return min(mc.max_position_embeddings, capacity)
