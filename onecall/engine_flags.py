"""The command-line flags that choose and configure the engine, shared by every `onecall` command
(onecall/cli/) and by the lab (lab/cli.py), which import this module and not each other.

    add_engine_args(parser)   --model, --dtype, --device, --max-model-len, --kv-cache-gib,
                              --kv-cache-dtype, --num-threads, --kernels,
                              --tensor-parallel-size
    engine_kwargs(args)       -> the EngineConfig / LLM keyword arguments those flags give

Only argparse here: the parsers are built before anything heavy loads.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="K/V cache dtype (auto: the model's); float16 halves what long-context decode reads",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument(
        "--kernels",
        default="fast",
        choices=["fast", "reference"],
        help="fast: oneDNN and the GGUF's own int4 weights on CPU (default); reference: plain torch ops",
    )
    p.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="fast CPU kernels: quantize activations to int8 for the 4-bit weights, as llama.cpp does "
        "(faster prompts and batches; each projection moves by up to ~1%%, greedy text can differ)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="split the model over N processes started by onecall (N GPUs with NCCL, or CPU with gloo); "
        "the heads and intermediate size must divide by N",
    )


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields every subcommand takes from add_engine_args' flags."""
    return {
        "model": a.model,
        "dtype": a.dtype,
        "device": a.device,
        "max_model_len": a.max_model_len,
        "kv_cache_gib": a.kv_cache_gib,
        "num_threads": a.num_threads,
        "kernels": a.kernels,
        "int8_activations": a.int8_activations,
        "kv_cache_dtype": a.kv_cache_dtype,
        "tensor_parallel_size": a.tensor_parallel_size,
    }
