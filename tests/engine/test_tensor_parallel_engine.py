"""Tensor parallel through the engine (engine/tp/workers.py): LLM(tensor_parallel_size=2) on CPU, two
gloo ranks, against the same model in one process.

The oracle is the engine at tensor_parallel_size 1 with the reference kernels: greedy tokens must be
equal, token for token, on tiny random Llama, Qwen2 and Qwen3 folders (safetensors, a byte-level
tokenizer of 257 ids, so the vocabulary does not divide by 2 and rank 1 holds a padding row). The
batch mixes what makes a step's message non-trivial: a shared prefix (prefix-cache hits, a
copy-on-write of a partly matched block), prompts longer than the token budget (chunked prefill),
decode rows next to prefill rows, and prompt logprobs (extra vocabulary gathers that every rank
must make). Prompt logprobs are compared to 1e-4: the all-reduces sum partial matmuls in another
order than one matmul does (float32, logits of magnitude ~10).

Faults: the embedded SmolLM2 (9 query, 3 KV heads) is refused for 2 before any process starts; a
worker killed with SIGKILL makes the next step raise TensorParallelError (an EngineDeadError) naming
the rank, within a bounded time, and leaves no process behind; a rank 0 killed with SIGKILL takes its
workers with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from onecall import LLM, SamplingParams
from onecall.config import EngineConfig
from onecall.engine.engine import RequestOutput
from onecall.engine.step_inputs import StepInputs
from onecall.engine.tp.messages import decode_step, encode_step
from onecall.engine.tp.workers import TensorParallelError
from onecall.engine_flags import add_engine_args, engine_kwargs
from onecall.errors import EngineDeadError, InvalidParameterError, UnsupportedModelError
from onecall.text.byte_level import byte_alphabet
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_hf_folder

VOCAB = 257  # 256 bytes + <|end|>: odd, so rank 1's vocabulary shard ends in a padding row
ENGINE: dict[str, Any] = dict(
    device="cpu", dtype="float32", kernels="reference", num_threads=1, block_size=4, kv_cache_gib=0.01,
    max_num_batched_tokens=16,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SHARED = [7, 100, 42, 9, 200, 13]  # 6 tokens: a prefix hit of 1.5 blocks, the half block copied on write


def tiny_folder(root: Path, arch: str) -> Path:
    """A Hugging Face folder: config, safetensors weights scaled up (wide logit gaps, so float32
    reordering cannot flip an argmax), and a byte-level tokenizer.json."""
    config = tiny_hf_config(arch, vocab_size=VOCAB, eos_token_id=256)
    state = {
        name: t if "norm" in name else t * (10.0 if "embed" in name else 5.0)
        for name, t in random_state_dict(config, seed=7).items()
    }
    folder = write_tiny_hf_folder(root / f"tiny-{arch}", state, config, shards=2)
    vocab = {ch: i for i, ch in byte_alphabet().items()} | {"<|end|>": 256}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    hf.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return folder


def run_batch(llm: LLM) -> list[RequestOutput]:
    prompts: list[Any] = [
        SHARED + [5, 6, 7],
        SHARED + [1, 2],
        list(range(30, 70)),  # 40 tokens: three chunks of at most 16
        [3],
    ]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2), GREEDY]
    out = llm.generate(prompts[:1], params[:1])  # the shared prefix is cached before the batch comes
    return out + llm.generate(prompts[1:], params[1:])


def top_ids(out: RequestOutput) -> list[list[int]]:
    assert out.prompt_top_logprobs is not None
    return [[i for i, _ in top or []] for top in out.prompt_top_logprobs]


@pytest.mark.slow  # spawns a worker per case
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_the_tokens_of_one(arch: str, tmp_path: Path) -> None:
    folder = str(tiny_folder(tmp_path, arch))
    with LLM(folder, **ENGINE) as one:
        want = run_batch(one)
    with LLM(folder, tensor_parallel_size=2, **ENGINE) as two:
        assert two.engine.parts.model.config.num_attention_heads == 2  # rank 0 holds half the heads
        workers = two.engine.parts.tp_group.processes  # type: ignore[union-attr]
        got = run_batch(two)
        assert two.engine.parts.num_blocks // 2 == one.engine.parts.num_blocks  # half the KV heads a block
    assert [w.returncode for w in workers] == [0] and not dist.is_initialized()  # left on SHUTDOWN
    assert got[1].num_cached_tokens == want[1].num_cached_tokens == 6  # prefix hit, copy-on-write included
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
    w_lp, g_lp = want[2].prompt_logprobs, got[2].prompt_logprobs
    assert w_lp is not None and g_lp is not None and len(g_lp) == 40 and g_lp[0] is w_lp[0] is None
    torch.testing.assert_close(torch.tensor(g_lp[1:]), torch.tensor(w_lp[1:]), rtol=0, atol=1e-4)
    assert top_ids(got[2]) == top_ids(want[2])  # the same alternatives, in the same order


def test_the_embedded_smollm2_is_refused_for_two_before_any_process_starts() -> None:
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(9\), num_key_value_heads \(3\)"):
        LLM(tensor_parallel_size=2, device="cpu")
    assert not dist.is_initialized()
    assert not [pid for pid in _children(os.getpid()) if b"worker_main" in _cmdline(pid)]


def test_the_size_is_validated_and_the_flag_reaches_the_config() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="device"):
        EngineConfig(tensor_parallel_size=2, device="meta")
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["tensor_parallel_size"] == 1
    kwargs = engine_kwargs(parser.parse_args(["--tensor-parallel-size", "2"]))
    assert EngineConfig(**kwargs).tensor_parallel_size == 2


def test_a_step_survives_the_wire() -> None:
    step = StepInputs(
        copies=[(3, 9), (4, 10)], input_ids=[11, 12, 13, 14], positions=[7, 0, 1, 2],
        block_tables=[[5, 6], [2]], seq_lens=[8, 3], query_lens=[1, 3], run_lengths=[2, 1],
        sample_rows=[0, 3], prompt_rows=[(1, 2)], num_decode=1,
    )  # fmt: skip
    header, payload = encode_step(step)
    assert header.dtype == payload.dtype == torch.int64 and header.shape == (8,)
    assert decode_step(header.tolist()[1:], payload.tolist()) == step
    empty = StepInputs([], [1], [0], [[0]], [1], [1], [1], [], [], 0)
    header, payload = encode_step(empty)
    assert decode_step(header.tolist()[1:], payload.tolist()) == empty


def _kill_and_step(llm: LLM) -> tuple[BaseException | None, float]:
    """SIGKILL rank 1, then generate: what was raised, and how long it took (bounded by a thread join)."""
    group = llm.engine.parts.tp_group
    assert group is not None
    (worker,) = group.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    raised: list[BaseException] = []

    def step() -> None:
        try:
            llm.generate([[1, 2, 3]], GREEDY)
        except BaseException as e:
            raised.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "rank 0 hung on a dead rank"
    return (raised[0] if raised else None), time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before the step", "in the broadcast"])
def test_a_killed_rank_stops_the_engine_with_a_typed_error(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the step: rank 0 sees the exit code when it starts the step. In the broadcast: that check
    is skipped, so gloo's closed socket is what fails, and the dead rank is still named."""
    with LLM(str(tiny_folder(tmp_path, "llama")), tensor_parallel_size=2, **ENGINE) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 10
        workers = llm.engine.parts.tp_group.processes  # type: ignore[union-attr]
        if where == "in the broadcast":
            group = llm.engine.parts.tp_group
            monkeypatch.setattr(group, "check_workers", lambda: None)
        error, seconds = _kill_and_step(llm)
        assert isinstance(error, TensorParallelError) and isinstance(error, EngineDeadError)
        assert "tensor-parallel rank 1" in str(error) and "exited with code -9" in str(error)
        assert seconds < 10
        assert llm.engine.dead_reason == str(error)
        with pytest.raises(EngineDeadError, match="rank 1"):  # and on every later call, at once
            llm.generate([[1, 2, 3]], GREEDY)
    assert [w.returncode for w in workers] == [-signal.SIGKILL] and not dist.is_initialized()


_RANK0_SCRIPT = """
import os, signal, sys
from onecall import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, **{engine})
print(llm.engine.parts.tp_group.processes[0].pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_workers_leave_when_rank_0_is_killed(tmp_path: Path) -> None:
    """Also: a script that builds the LLM at top level, with no `if __name__ == "__main__"` guard."""
    folder = tiny_folder(tmp_path, "qwen3")
    script = tmp_path / "unguarded.py"
    script.write_text(_RANK0_SCRIPT.format(engine=repr(ENGINE)))
    proc = subprocess.run(
        [sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(pid), f"worker {pid} outlived rank 0"


_TORCHRUN_SCRIPT = """
import os, sys
from onecall import LLM, SamplingParams
engine, prompts = {engine}, [[1, 2, 3], list(range(40, 70))]
greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
if os.environ["RANK"] == "0":
    with LLM(sys.argv[1], **engine) as one:
        want = [o.token_ids for o in one.generate(prompts, greedy)]
llm = LLM(sys.argv[1], tensor_parallel_size=2, **engine)  # rank 1 serves steps in here, then exits 0
got = [o.token_ids for o in llm.generate(prompts, greedy)]
print("tokens equal:", got == want, flush=True)
"""


@pytest.mark.slow
def test_under_torchrun_the_ranks_join_through_its_variables(tmp_path: Path) -> None:
    """torchrun starts both processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT): nothing is spawned, rank 1
    runs the worker loop inside LLM() and leaves with exit code 0 when rank 0 exits."""
    from tests.helpers.server_process import free_port

    script = tmp_path / "tp.py"
    script.write_text(_TORCHRUN_SCRIPT.format(engine=repr(ENGINE)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), str(tiny_folder(tmp_path, "qwen3"))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n").count("tokens equal: True") == 1, proc.stdout  # rank 0 prints it


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except FileNotFoundError:
        return b""


def _spawned_workers(pid: int) -> list[int]:
    """`pid`'s tensor-parallel workers."""
    return [child for child in _children(pid) if b"worker_main" in _cmdline(child)]


def _serve(folder: Path) -> Any:
    from tests.helpers.server_process import ServerProcess

    return ServerProcess(
        "--model", str(folder), "--tensor-parallel-size", "2", "--kernels", "reference", "--device", "cpu",
        "--kv-cache-gib", "0.01",
    ).start()  # fmt: skip


def _complete(server: Any) -> httpx.Response:
    body = {"model": "tiny-qwen2", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=30)


@pytest.mark.server
def test_the_server_answers_503_once_a_rank_is_killed(tmp_path: Path) -> None:
    from tests.helpers.server_process import assert_error

    server = _serve(tiny_folder(tmp_path, "qwen2"))
    try:
        assert _complete(server).status_code == 200
        (worker,) = _spawned_workers(server._proc.pid)
        os.kill(worker, signal.SIGKILL)
        err = assert_error(_complete(server), 503, type="service_unavailable_error", code="engine_dead")
        assert "tensor-parallel rank 1" in err["message"] and "code -9" in err["message"], err
        health = assert_error(
            httpx.get(server.url("/health"), timeout=5), 503, type="service_unavailable_error"
        )
        assert "tensor-parallel rank 1" in health["message"], health
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.server
def test_a_stopped_server_leaves_no_worker_behind(tmp_path: Path) -> None:
    server = _serve(tiny_folder(tmp_path, "qwen2"))
    try:
        assert _complete(server).status_code == 200
        (worker,) = _spawned_workers(server._proc.pid)
    finally:
        assert server.stop() == 0, server.log()
    assert not _is_running(worker)


@pytest.mark.server
def test_health_turns_503_when_a_rank_dies_while_the_server_is_idle(tmp_path: Path) -> None:
    """No request after the kill: the idle engine thread polls the ranks (about once a second)."""
    from tests.helpers.server_process import assert_error

    server = _serve(tiny_folder(tmp_path, "qwen2"))
    try:
        assert _complete(server).status_code == 200
        (worker,) = _spawned_workers(server._proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        health = httpx.get(server.url("/health"), timeout=5)
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            health = httpx.get(server.url("/health"), timeout=5)
        err = assert_error(health, 503, type="service_unavailable_error")
        assert "tensor-parallel rank 1" in err["message"] and "code -9" in err["message"], err
    finally:
        assert server.stop() == 0, server.log()
