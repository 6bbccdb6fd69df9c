"""Tensor-parallel ranks for the engine: starting them, the step rank 0 sends them, their loop, and
what happens when one dies.

    rank 0 (this process: Engine, scheduler, API, trace)       ranks 1 .. N-1 (started here)
    ----------------------------------------------------       -----------------------------
    start_group(): (engine_parts checked the heads divide)     worker_main():
      start N-1 `python -c` processes, wait for each to          join the group, load 1/N of the
      check in at the TCP store, join the group                  weights, agree on the KV pool
    load 1/N of the weights; agree_num_blocks (all-reduce MIN)
    every step: ModelRunner.pack -> run_step():                loop: receive_step() ->
      broadcast header (+ payload) -> ModelRunner.run            ModelRunner.run (the same
                                                                 collectives, in the same order)
    close(): broadcast SHUTDOWN, wait (terminate if need be)   SHUTDOWN: leave the group, exit 0

Workers are fresh interpreters (`python -c "...worker_main()"`, the config as JSON in argv), not
multiprocessing's spawn: spawn re-runs the parent's main script in the child, so a script that
builds LLM(tensor_parallel_size=2) at top level, without an `if __name__ == "__main__"` guard, would
fail. The config is EngineConfig's plain fields; nothing from the model folder is sent.

The step on the wire (two broadcasts of int64 tensors, nothing pickled): a header of _HEADER_LEN
ints, [kind, num_copies, num_tokens, num_seqs, num_table_entries, num_sample_rows,
num_prompt_rows, num_decode], then, for a STEP, one payload tensor with the StepInputs lists laid
end to end in that order (copies as src, dst pairs; block tables as their lengths, then their ids;
prompt rows as row, count pairs).

Backends: the model's collectives run on gloo on CPU, NCCL on CUDA (rank r on cuda:r). The step
messages (and the KV agreement) always go through a gloo group of CPU tensors (the default group
on CPU; a second group, control_group(), on CUDA), as vLLM sends its metadata: an idle worker then
waits on a socket, not in a spinning NCCL kernel, and a dead peer closes that socket. The groups'
timeout is long on purpose: a worker waits in the header broadcast as long as the server is idle.

Faults (rank 0 must never hang on a dead rank, and no rank outlives rank 0):
- A worker that exits (crash, OOM kill, kill -9) closes its sockets: gloo raises in rank 0's next
  or current collective at once, and a worker found exited before a step stops the engine without
  one. run_step() turns any exception of a step into TensorParallelError (an EngineDeadError, so
  the server answers 503 and /health says why), naming the rank and its exit code when a worker is
  gone, and closes the group: the other workers are terminated. An exception on rank 0 in the
  middle of a step is fatal the same way, because the ranks would be out of step. A rank that hangs
  (not dies) hangs the step: the server's step watchdog (--step-timeout) declares the engine dead.
- Rank 0 holds each worker's stdin open and never writes to it; a thread in the worker reads it.
  Rank 0 gone, however it died (SIGKILL included), the read ends and the worker exits at once.
  A normal exit of rank 0 closes the group first (atexit).

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, WORLD_SIZE == N), nothing is started:
the group is joined through those variables, rank 0 returns, and every other rank runs the worker
loop inside start_group() and then leaves the process with SystemExit(0). torchrun watches the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from onecall.config import EngineConfig
from onecall.engine.engine_parts import kv_blocks_in_budget, load_model
from onecall.engine.model_runner import ModelRunner, StepInputs
from onecall.errors import EngineDeadError, InvalidParameterError
from onecall.model.attention import default_backend
from onecall.model.checkpoint import load_hf_config_dict, resolve_model
from onecall.model.config import ModelConfig
from onecall.model.kv_cache import PagedKVCache
from onecall.model.parallel import TensorParallel

if TYPE_CHECKING:
    from onecall.engine.model_runner import PromptLogitsFn

SHUTDOWN, STEP = 0, 1
_HEADER_LEN = 8
_GROUP_TIMEOUT = datetime.timedelta(days=365)  # idle servers: workers wait in a broadcast meanwhile
_STARTUP_TIMEOUT_S = 600.0  # for every worker to import torch and check in at the store
_CLOSE_TIMEOUT_S = 10.0  # for the workers to leave after SHUTDOWN, before they are terminated
_READY_KEY = "onecall_tp_ready"


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or a step failed across the ranks; the engine cannot go on."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def set_cpu_threads(config: EngineConfig) -> None:
    """CPU ranks share the cores: each gets its share unless num_threads says otherwise."""
    if config.torch_device.type == "cpu":
        torch.set_num_threads(
            config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
        )


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Rank r's device on its machine: cuda:r on CUDA, the CPU otherwise."""
    return torch.device("cuda", local_rank) if config.torch_device.type == "cuda" else torch.device("cpu")


def control_group(device: torch.device) -> dist.ProcessGroup | None:
    """The group the step messages go through: gloo (None: the default group, already gloo on CPU).
    Every rank calls this once, at the same point, after the default group is up."""
    if backend_for(device) == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)


# ---- rank 0 --------------------------------------------------------------------------------------
class TensorParallelGroup:
    """Rank 0's handle on the group: its own TensorParallel, the step broadcast, the workers' health."""

    def __init__(
        self, tp: TensorParallel, device: torch.device, processes: list[subprocess.Popen[bytes]]
    ) -> None:
        self.tp = tp
        self.device = device
        self._processes = processes  # ranks 1 .. N-1 when started here; empty under torchrun
        self._control: dist.ProcessGroup | None = None  # gloo, CPU tensors: the step messages (joined())
        self.dead_reason: str | None = None
        self._closed = False
        # True while a step runs (on the engine's thread). close() from another thread then (exit after
        # a step hung) must not broadcast into the same group: it terminates the workers instead,
        # which also makes the stuck collective raise.
        self._in_step = False

    def joined(self) -> TensorParallelGroup:
        """Called once the default group is up: make the control group (see control_group)."""
        self._control = control_group(self.device)
        return self

    # ---- each step ----
    def run_step(
        self, runner: ModelRunner, step: StepInputs, on_prompt_logits: PromptLogitsFn | None
    ) -> torch.Tensor:
        """Send `step` to the workers, then run it here: the sampling rows' logits. Any failure is
        fatal for the group (TensorParallelError): the ranks could be out of step."""
        self.check_workers()
        if self.dead_reason is not None:
            raise TensorParallelError(self.dead_reason)
        if self._closed:
            raise TensorParallelError("the tensor-parallel group was closed (LLM.close or Engine.close)")
        self._in_step = True
        try:
            header, payload = encode_step(step)
            self._broadcast(header)
            self._broadcast(payload)
            return runner.run(step, on_prompt_logits)
        except Exception as e:
            self._die(f"{type(e).__name__}: {e}")
            raise TensorParallelError(self.dead_reason) from e
        finally:
            self._in_step = False

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest KV pool any rank's budget holds (every rank calls this once, after loading)."""
        t = torch.tensor([num_blocks], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        except Exception as e:
            self._die(f"{type(e).__name__}: {e}")
            raise TensorParallelError(f"while the ranks loaded the model: {self.dead_reason}") from e
        return int(t.item())

    def _broadcast(self, values: torch.Tensor) -> None:
        dist.broadcast(values, src=0, group=self._control)

    # ---- faults and shutdown ----
    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The workers this process started (ranks 1 .. N-1, in order); empty under torchrun."""
        return list(self._processes)

    def check_workers(self) -> None:
        """A worker that exited since the last step (found without a collective) kills the group."""
        if self.dead_reason is None and not self._closed and (gone := self._exited_worker()) is not None:
            self.dead_reason = f"{gone}; the engine stopped"
            self.close()

    def _exited_worker(self) -> str | None:
        for rank, p in enumerate(self._processes, start=1):
            if p.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def _die(self, error: str) -> None:
        """A step or collective failed: name the dead rank if there is one (a worker that closed its
        sockets may take a moment to be reaped), then stop every worker."""
        deadline = time.monotonic() + 2.0
        while (gone := self._exited_worker()) is None and self._processes and time.monotonic() < deadline:
            time.sleep(0.02)
        self.dead_reason = (
            f"{gone}; the engine stopped ({error})"
            if gone
            else f"a tensor-parallel step failed on rank 0, and the ranks are out of step: {error}"
        )
        self.close()

    def close(self) -> None:
        """End the workers (SHUTDOWN when the group is healthy, else terminate) and leave the group.
        Idempotent; also registered with atexit."""
        if self._closed:
            return
        self._closed = True
        graceful = self.dead_reason is None and not self._in_step and self._exited_worker() is None
        if graceful:
            with contextlib.suppress(Exception):  # a worker died meanwhile: terminated below
                self._broadcast(torch.tensor([SHUTDOWN] + [0] * (_HEADER_LEN - 1), dtype=torch.int64))
        deadline = time.monotonic() + (_CLOSE_TIMEOUT_S if graceful else 0.0)
        for p in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=2.0)
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdin is not None:
                p.stdin.close()
        if dist.is_initialized():
            # a broken NCCL communicator may refuse: this process is leaving it anyway
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def start_group(config: EngineConfig) -> TensorParallelGroup:
    """Start (or, under torchrun, join) the group of config.tensor_parallel_size ranks. Returns on
    rank 0; other torchrun ranks serve as workers here and leave with SystemExit(0)."""
    n = config.tensor_parallel_size
    if dist.is_initialized():
        raise InvalidParameterError(
            "tensor_parallel_size",
            "this process already belongs to a torch.distributed group (another tensor-parallel engine "
            "still open?): close() it first",
        )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(config)
    device = rank_device(config, 0)
    set_cpu_threads(config)
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
    processes: list[subprocess.Popen[bytes]] = []
    group = TensorParallelGroup(TensorParallel(0, n), device, processes)
    config_json = json.dumps(dataclasses.asdict(config))
    # onecall importable in the worker as it is here (also from a source tree that is not installed)
    source_root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")])),
    }
    try:
        for rank in range(1, n):
            argv = [config_json, str(rank), str(n), str(store.port)]
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER_COMMAND, *argv], stdin=subprocess.PIPE, env=env
                )
            )
        _wait_for_workers(group, store, n - 1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device), store=store, rank=0, world_size=n, timeout=_GROUP_TIMEOUT
        )
        group.joined()
    except BaseException:
        group.dead_reason = group.dead_reason or "the group did not start"
        group.close()
        raise
    atexit.register(group.close)
    return group


def _wait_for_workers(group: TensorParallelGroup, store: dist.TCPStore, num_workers: int) -> None:
    """Until every worker checked in at the store; TensorParallelError if one exits first."""
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while store.add(_READY_KEY, 0) < num_workers:
        if (gone := group._exited_worker()) is not None:
            raise TensorParallelError(f"{gone} while starting (its error is on stderr)")
        if time.monotonic() > deadline:
            raise TensorParallelError(
                f"the tensor-parallel workers did not start in {_STARTUP_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.02)


def _join_torchrun(config: EngineConfig) -> TensorParallelGroup:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != config.tensor_parallel_size:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"is {config.tensor_parallel_size}, but torchrun started WORLD_SIZE={world_size} processes",
        )
    device = rank_device(config, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_cpu_threads(config)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT)
    if rank != 0:
        _serve_steps(config, device, rank, world_size, control_group(device))
        raise SystemExit(0)
    group = TensorParallelGroup(TensorParallel(0, world_size), device, []).joined()
    atexit.register(group.close)
    return group


# ---- ranks 1 .. N-1 -------------------------------------------------------------------------------
_WORKER_COMMAND = "import sys; from onecall.engine.tp_workers import worker_main; worker_main(sys.argv[1:])"


def worker_main(argv: list[str]) -> None:
    """A started worker's main (argv: config JSON, rank, world size, the store's port on 127.0.0.1):
    watch rank 0, join the group, then serve steps until SHUTDOWN."""
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(**json.loads(argv[0]))
    rank, world_size, port = int(argv[1]), int(argv[2]), int(argv[3])
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S)
    )
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.add(_READY_KEY, 1)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT
    )
    try:
        _serve_steps(config, device, rank, world_size, control_group(device))
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        print(f"onecall: tensor-parallel rank {rank} stops: {e}", file=sys.stderr)
        os._exit(1)


def _exit_with_parent() -> None:
    """Block reading stdin, which rank 0 holds open and never writes: its end means rank 0 is gone."""
    with contextlib.suppress(OSError):
        while os.read(0, 4096):  # the raw descriptor: sys.stdin's lock would block the interpreter's exit
            pass
    os._exit(0)


def _serve_steps(
    config: EngineConfig, device: torch.device, rank: int, world_size: int, control: dist.ProcessGroup | None
) -> None:
    """Load this rank's slice, agree on the KV pool, then run every step rank 0 sends until SHUTDOWN."""
    dtype = config.torch_dtype
    set_cpu_threads(config)
    files = resolve_model(config.model)
    model = load_model(
        config, files, ModelConfig.from_hf_config(load_hf_config_dict(files)), dtype, device,
        TensorParallel(rank, world_size),
    )  # fmt: skip
    local = model.config
    kv_dtype = config.torch_kv_cache_dtype
    blocks = torch.tensor([kv_blocks_in_budget(config, local, kv_dtype, device)], dtype=torch.int64)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=control)  # rank 0's agree_num_blocks
    kv_cache = PagedKVCache(
        local.num_hidden_layers, int(blocks.item()), config.block_size, local.num_key_value_heads,
        local.head_dim, kv_dtype, device,
    )  # fmt: skip
    backend = default_backend(device, config.kernels)
    if backend == "triton" and device.type == "cuda":  # the fused small ops, as rank 0's engine installs them
        from onecall.model import triton_ops

        triton_ops.install(model)
    runner = ModelRunner(model, kv_cache, None, device, backend, block_size=config.block_size)
    while (step := receive_step(control)) is not None:
        runner.run(step)
    dist.destroy_process_group()


def receive_step(control: dist.ProcessGroup | None) -> StepInputs | None:
    """The next step rank 0 broadcasts; None for SHUTDOWN."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=control)
    kind, *sizes = header.tolist()
    if kind == SHUTDOWN:
        return None
    assert kind == STEP, f"unknown tensor-parallel message {kind}"
    payload = torch.empty(_payload_len(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=control)
    return decode_step(sizes, payload.tolist())


# ---- the wire format ------------------------------------------------------------------------------
def encode_step(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """StepInputs -> (header, payload) int64 CPU tensors (see the module docstring)."""
    tables = step.block_tables
    sizes = [
        len(step.copies),
        len(step.input_ids),
        len(step.seq_lens),
        sum(len(t) for t in tables),
        len(step.sample_rows),
        len(step.prompt_rows),
        step.num_decode,
    ]
    flat: list[int] = [x for pair in step.copies for x in pair]
    flat += step.input_ids
    flat += step.positions
    flat += step.seq_lens
    flat += step.query_lens
    flat += step.run_lengths
    flat += [len(t) for t in tables]
    for t in tables:
        flat += t
    flat += step.sample_rows
    flat += [x for pair in step.prompt_rows for x in pair]
    assert len(flat) == _payload_len(sizes), "the step's lists disagree with their counts"
    return torch.tensor([STEP, *sizes], dtype=torch.int64), torch.tensor(flat, dtype=torch.int64)


def decode_step(sizes: list[int], flat: list[int]) -> StepInputs:
    num_copies, num_tokens, num_seqs, _, num_sample, num_prompt, num_decode = sizes
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return flat[pos - n : pos]

    copies = take(2 * num_copies)
    input_ids, positions = take(num_tokens), take(num_tokens)
    seq_lens, query_lens, run_lengths = take(num_seqs), take(num_seqs), take(num_seqs)
    tables = [take(n) for n in take(num_seqs)]
    sample_rows = take(num_sample)
    prompt = take(2 * num_prompt)
    assert pos == len(flat), "the payload is longer than its header says"
    return StepInputs(
        copies=list(zip(copies[::2], copies[1::2], strict=True)),
        input_ids=input_ids,
        positions=positions,
        block_tables=list(tables),
        seq_lens=seq_lens,
        query_lens=query_lens,
        run_lengths=run_lengths,
        sample_rows=sample_rows,
        prompt_rows=list(zip(prompt[::2], prompt[1::2], strict=True)),
        num_decode=num_decode,
    )


def _payload_len(sizes: list[int]) -> int:
    num_copies, num_tokens, num_seqs, num_table_entries, num_sample, num_prompt, _ = sizes
    return 2 * num_copies + 2 * num_tokens + 4 * num_seqs + num_table_entries + num_sample + 2 * num_prompt
