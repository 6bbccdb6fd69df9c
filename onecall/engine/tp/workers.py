"""Tensor parallel, rank 0's side: starting the other ranks (or joining torchrun's), sending them each
step, and what happens when one dies.

    rank 0 (this process: Engine, scheduler, API, trace)       ranks 1 .. N-1 (started here)
    ----------------------------------------------------       -----------------------------
    start_group(): the heads divide by N? then start           worker_main() (engine/tp/worker_loop.py):
      start N-1 `python -c` processes, wait for each to          join the group, load 1/N of the
      check in at the TCP store, join the group                  weights, agree on the KV pool
    load 1/N of the weights; agree_num_blocks (all-reduce MIN)
    every step: ModelRunner.pack -> run_step():                loop: receive_step() ->
      broadcast header (+ payload) -> ModelRunner.run            ModelRunner.run (the same
                                                                 collectives, in the same order)
    close(): broadcast SHUTDOWN, wait (terminate if need be)   SHUTDOWN: leave the group, exit 0

The messages and the gloo group they travel on are engine/tp/messages.py's; the workers' side,
and the device and thread set-up every rank shares, engine/tp/worker_loop.py's.

Workers are fresh interpreters (`python -c "...worker_main()"`, the config as JSON in argv), not
multiprocessing's spawn: spawn re-runs the parent's main script in the child, so a script that
builds LLM(tensor_parallel_size=2) at top level, without an `if __name__ == "__main__"` guard, would
fail. The config is EngineConfig's plain fields; nothing from the model folder is sent.

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
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onecall.config import EngineConfig
from onecall.engine.step_inputs import PromptLogitsFn, StepInputs, StepRunner
from onecall.engine.tp.messages import GROUP_TIMEOUT, backend_for, control_group, encode_step, shutdown_header
from onecall.engine.tp.worker_loop import (
    READY_KEY,
    STARTUP_TIMEOUT_S,
    WORKER_COMMAND,
    rank_device,
    serve_steps,
    set_cpu_threads,
)
from onecall.errors import EngineDeadError, InvalidParameterError
from onecall.formats.checkpoint import load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.model.parallel import TensorParallel

_CLOSE_TIMEOUT_S = 10.0  # for the workers to leave after SHUTDOWN, before they are terminated


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or a step failed across the ranks; the engine cannot go on."""


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
        self, runner: StepRunner, step: StepInputs, on_prompt_logits: PromptLogitsFn | None
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
                self._broadcast(shutdown_header())
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
    """Start (or, under torchrun, join) the group of config.tensor_parallel_size ranks, once the
    model's heads are known to divide by it. Returns on rank 0; other torchrun ranks serve as
    workers here and leave with SystemExit(0)."""
    n = config.tensor_parallel_size
    model_config = model_config_from_hf(load_hf_config_dict(resolve_model(config.model)))
    TensorParallel(0, n).check_divides(model_config)
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
    source_root = str(Path(__file__).resolve().parents[3])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")])),
    }
    try:
        for rank in range(1, n):
            argv = [config_json, str(rank), str(n), str(store.port)]
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER_COMMAND, *argv], stdin=subprocess.PIPE, env=env
                )
            )
        _wait_for_workers(group, store, n - 1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=n, timeout=GROUP_TIMEOUT)
        group.joined()
    except BaseException:
        group.dead_reason = group.dead_reason or "the group did not start"
        group.close()
        raise
    atexit.register(group.close)
    return group


def _wait_for_workers(group: TensorParallelGroup, store: dist.TCPStore, num_workers: int) -> None:
    """Until every worker checked in at the store; TensorParallelError if one exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while store.add(READY_KEY, 0) < num_workers:
        if (gone := group._exited_worker()) is not None:
            raise TensorParallelError(f"{gone} while starting (its error is on stderr)")
        if time.monotonic() > deadline:
            raise TensorParallelError(
                f"the tensor-parallel workers did not start in {STARTUP_TIMEOUT_S:.0f} s"
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
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    if rank != 0:
        serve_steps(config, device, rank, world_size, control_group(device))
        raise SystemExit(0)
    group = TensorParallelGroup(TensorParallel(0, world_size), device, []).joined()
    atexit.register(group.close)
    return group
