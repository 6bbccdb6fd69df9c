"""Files -> a ready engine: model weights, tokenizer, and a KV pool sized from a memory budget.

1. resolve the model (GGUF file, HF folder, or the embedded default)
2. config -> ModelConfig (refuses unsupported architectures / rope scaling)
3. tokenizer + chat template (from GGUF metadata or tokenizer.json)
4. build DecoderLM on the device, stream the weights in
5. size the KV pool: budget // bytes per block; the context window is capped by it
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from onecall.config import DEFAULT_CPU_KV_CACHE_GIB, DEFAULT_GPU_KV_CACHE_FRACTION, EngineConfig
from onecall.errors import InvalidParameterError
from onecall.model.checkpoint import ModelFiles, iter_weights, load_hf_config_dict, resolve_model
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.gguf import open_gguf
from onecall.model.kv_cache import PagedKVCache
from onecall.model.quants import StoredGroups
from onecall.model.weights import load_weights
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

    @property
    def model_name(self) -> str:
        return self.files.name


def load_engine_parts(config: EngineConfig) -> LoadedEngineParts:
    t0 = time.perf_counter()
    device, dtype = config.torch_device, config.torch_dtype
    if config.num_threads is not None and device.type == "cpu":
        torch.set_num_threads(config.num_threads)

    # 1.-3. files, config, tokenizer. The tokenizer builds on a thread while the weights load (the
    # weight work is torch ops that release the GIL): about 0.2 s of cold start off the critical path.
    files = resolve_model(config.model)
    model_config = ModelConfig.from_hf_config(load_hf_config_dict(files))
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_job = pool.submit(_load_tokenizer, files)
        model = _load_model(config, files, model_config, dtype, device)
        tokenizer = tokenizer_job.result()

    # 5. KV pool
    kv_dtype = config.torch_kv_cache_dtype
    num_blocks, max_model_len = _size_kv(config, model_config, kv_dtype, device)
    kv_cache = PagedKVCache(
        model_config.num_hidden_layers,
        num_blocks,
        config.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        kv_dtype,
        device,
    )
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
    )


def _load_tokenizer(files: ModelFiles) -> Tokenizer:
    if files.kind == "gguf":
        return Tokenizer.from_gguf_metadata(open_gguf(files.path).metadata)
    return Tokenizer.from_hf_folder(files.path)


def _load_model(
    config: EngineConfig,
    files: ModelFiles,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> DecoderLM:
    """4. Build the module tree and stream the weights in. The fast kernels pack each projection as
    it arrives, keeping a GGUF's own 4-bit groups (decoded once on the way in) and its Q8_0 logits
    weight as int8; no dense copy of the projections is ever kept.

    With --max-model-len below the model's context window, the model is built for that length: its
    RoPE tables stop there (Gemma 3's two tables at 131,072 positions are 268 MB) and a longrope model
    (Phi-3) picks its short factors when that length is within its original context, as vLLM does."""
    if config.max_model_len is not None and config.max_model_len < model_config.max_position_embeddings:
        model_config = dataclasses.replace(model_config, max_position_embeddings=config.max_model_len)
    model = DecoderLM(model_config, dtype=dtype, device=device, pack_on_load=config.kernels == "fast")
    stored: dict[str, StoredGroups] | None = {} if model.pack_on_load else None
    load_weights(model, iter_weights(files, dtype, stored), stored)
    return model.eval()


def _size_kv(
    config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    per_block = PagedKVCache.bytes_per_block(
        mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim, dtype
    )
    if config.kv_cache_gib is not None:
        budget = int(config.kv_cache_gib * 2**30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * DEFAULT_GPU_KV_CACHE_FRACTION)
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)
    num_blocks = budget // per_block
    capacity = num_blocks * config.block_size
    if num_blocks < 2:
        raise InvalidParameterError(
            "kv_cache_gib", f"the KV budget ({budget} bytes) holds fewer than 2 blocks of {per_block} bytes"
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
        return num_blocks, config.max_model_len
    return num_blocks, min(mc.max_position_embeddings, capacity)
