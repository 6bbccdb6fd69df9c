"""Tensor-parallel ranks 1 .. N-1: a worker's main, its loop, and the set-up every rank shares.

    worker_main(argv)                         (a fresh interpreter rank 0 started: WORKER_COMMAND)
      watch rank 0 (a thread reading stdin), check in at the TCP store (READY_KEY), join the group
    serve_steps()                             (also what torchrun's ranks 1 .. N-1 run)
      load 1/N of the weights; agree on the KV pool (all-reduce MIN, rank 0's agree_num_blocks)
      loop: receive_step() -> ModelRunner.run, the same collectives in the same order as rank 0
      SHUTDOWN: leave the group, return (a started worker then exits 0)

A worker never outlives rank 0: rank 0 holds each worker's stdin open and never writes to it; a
thread here reads it, and when the read ends (rank 0 gone, however it died, SIGKILL included) the
worker exits at once. A collective that fails (rank 0 or another rank gone) ends a started worker
with exit code 1 and the error on stderr.

Every rank, rank 0 included, sets itself up the same way: rank_device() (cuda:r on CUDA, the CPU
otherwise) and set_cpu_threads() (CPU ranks share the cores). engine/tp/workers.py starts the
workers and is rank 0's side; engine/tp/messages.py is what the two sides send each other.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from onecall.config import EngineConfig
from onecall.engine.engine_parts import kv_blocks_in_budget, load_model
from onecall.engine.model_runner import ModelRunner
from onecall.engine.tp.messages import GROUP_TIMEOUT, backend_for, control_group, receive_step
from onecall.formats.checkpoint import load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.model.attention_metadata import default_backend
from onecall.model.kv_cache import PagedKVCache
from onecall.model.parallel import TensorParallel

STARTUP_TIMEOUT_S = 600.0  # for every worker to import torch and check in at the store
READY_KEY = "onecall_tp_ready"
# argv after it: config JSON, rank, world size, the store's port on 127.0.0.1 (see worker_main)
WORKER_COMMAND = (
    "import sys; from onecall.engine.tp.worker_loop import worker_main; worker_main(sys.argv[1:])"
)


def set_cpu_threads(config: EngineConfig) -> None:
    """CPU ranks share the cores: each gets its share unless num_threads says otherwise."""
    if config.torch_device.type == "cpu":
        torch.set_num_threads(
            config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
        )


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Rank r's device on its machine: cuda:r on CUDA, the CPU otherwise."""
    return torch.device("cuda", local_rank) if config.torch_device.type == "cuda" else torch.device("cpu")


def worker_main(argv: list[str]) -> None:
    """A started worker's main (argv: config JSON, rank, world size, the store's port on 127.0.0.1):
    watch rank 0, join the group, then serve steps until SHUTDOWN."""
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(**json.loads(argv[0]))
    rank, world_size, port = int(argv[1]), int(argv[2]), int(argv[3])
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.add(READY_KEY, 1)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    try:
        serve_steps(config, device, rank, world_size, control_group(device))
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        print(f"onecall: tensor-parallel rank {rank} stops: {e}", file=sys.stderr)
        os._exit(1)


def _exit_with_parent() -> None:
    """Block reading stdin, which rank 0 holds open and never writes: its end means rank 0 is gone."""
    with contextlib.suppress(OSError):
        while os.read(0, 4096):  # the raw descriptor: sys.stdin's lock would block the interpreter's exit
            pass
    os._exit(0)


def serve_steps(
    config: EngineConfig, device: torch.device, rank: int, world_size: int, control: dist.ProcessGroup | None
) -> None:
    """Load this rank's slice, agree on the KV pool, then run every step rank 0 sends until SHUTDOWN."""
    dtype = config.torch_dtype
    set_cpu_threads(config)
    files = resolve_model(config.model)
    model = load_model(
        config, files, model_config_from_hf(load_hf_config_dict(files)), dtype, device,
        TensorParallel(rank, world_size),
    )  # fmt: skip
    local = model.config
    kv_dtype = config.torch_kv_cache_dtype
    blocks = torch.tensor([kv_blocks_in_budget(config, local, kv_dtype, device)], dtype=torch.int64)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=control)  # rank 0's agree_num_blocks
    kv_cache = PagedKVCache(
        local.num_kv_layers, int(blocks.item()), config.block_size, local.num_key_value_heads,
        local.head_dim, kv_dtype, device,
    )  # fmt: skip
    backend = default_backend(device, config.kernels, latent_attention=local.deepseek is not None)
    runner = ModelRunner(model, kv_cache, None, device, backend, block_size=config.block_size)
    while (step := receive_step(control)) is not None:
        runner.run(step)
    dist.destroy_process_group()
