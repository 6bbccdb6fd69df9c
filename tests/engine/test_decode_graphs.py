"""Static-shape decode steps (engine/decode_graphs.py) on CPU: buckets, padding, static metadata.

On CUDA these steps are captured as CUDA graphs; everything but the capture runs here, with the
Triton attention backend under TRITON_INTERPRET=1 (tests/conftest.py): the engine on padded,
bucketed buffers must give the same greedy tokens as the engine's ordinary path, alone and for
batches that need padding (3 -> bucket 4, 5 -> bucket 8), across steps where the batch shrinks.
"""

from __future__ import annotations

import os

import pytest

from onecall.engine.decode_graphs import BUCKETS, bucket_for
from onecall.sampling_params import SamplingParams
from tests.helpers.tiny_engine import run_all, tiny_engine

pytest.importorskip("triton")
needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (conftest sets it)",
)


def test_buckets() -> None:
    assert [bucket_for(n, 64) for n in (1, 2, 3, 4, 5, 9, 17, 33, 64)] == [1, 2, 4, 4, 8, 16, 24, 48, 64]
    assert bucket_for(65, 64) is None  # above the largest bucket: the step runs eagerly
    assert bucket_for(3, 2) is None
    assert list(BUCKETS) == sorted(BUCKETS)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize(
    "num_requests", [1, pytest.param(3, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)]
)
def test_static_decode_gives_the_eager_tokens(num_requests: int) -> None:
    prompts = {f"r{i}": f"Count the apples number {i} " + "and pears " * i for i in range(num_requests)}
    # different lengths: requests finish at different steps, so the batch shrinks and re-buckets
    params = {
        f"r{i}": SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True)
        for i in range(num_requests)
    }
    eager = run_all(tiny_engine(arch="qwen2"), prompts, params)
    engine = tiny_engine(arch="qwen2")
    engine.enable_static_decode(capture=False, backend="triton")
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.scratch_block == engine.parts.num_blocks - 1
    assert (
        engine.block_manager.num_blocks == engine.parts.num_blocks - 1
    )  # the scratch block is not handed out
    static = run_all(engine, prompts, params)
    for rid in prompts:
        assert static[rid].token_ids == eager[rid].token_ids, rid
    # the static path ran: the first decode step's bucket (and each smaller one as requests finished)
    assert bucket_for(num_requests, 64) in graphs.buckets and set(graphs.buckets) <= set(BUCKETS)
    assert not any(graphs.buckets.values())  # none captured on CPU
    # every layout wrote its logits into the one shared buffer: no output buffer per layout
    assert graphs.logits.shape == (graphs.max_bucket + 1, engine.parts.model.vocab_size)
    assert graphs.logits_bytes(graphs.max_bucket, engine.parts.model.vocab_size) == graphs.logits.nbytes
    assert not any(hasattr(g, "logits") for g in graphs._graphs.values())


@pytest.mark.slow
@needs_triton
def test_an_engine_on_the_triton_backend_sets_static_decode_up_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What Engine() does on CUDA with the fast kernels (backend "triton", cuda_graphs on), here with
    the backend forced: the static path is set up in the constructor (without capture off CUDA)."""
    import onecall.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "default_backend", lambda device, kernels, **_: "triton")
    engine = tiny_engine(arch="llama")
    assert engine.runner.decode_graphs is not None and not engine.runner.decode_graphs.capture
    out = run_all(engine, {"a": "Hello there", "b": "Two"}, SamplingParams(temperature=0.0, max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in out.values())
    assert engine.runner.decode_graphs.buckets  # decode steps ran on the static buffers
    assert not tiny_engine(arch="llama", cuda_graphs=False).runner.decode_graphs


@pytest.mark.slow
@needs_triton
def test_a_capture_that_raises_any_error_falls_back_to_the_eager_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed capture runs its layout eagerly from then on, the reason kept in capture_errors,
    whatever it raised: Triton's own errors (OutOfResources, CompilationError) are no RuntimeError.
    The buffers live on CPU here; `device` says CUDA so that _prepare tries the capture."""
    import torch

    class TritonLikeError(Exception):  # triton.errors.TritonError derives from Exception only
        pass

    prompts = {"a": "Hello there", "b": "Two"}
    params = {rid: SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True) for rid in prompts}
    eager = run_all(tiny_engine(arch="qwen2"), prompts, params)
    engine = tiny_engine(arch="qwen2")
    engine.enable_static_decode(capture=True, backend="triton")
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    graphs.device = torch.device("cuda")  # only _prepare reads it after the buffers are made
    attempts: list[str] = []

    def failing_capture(layout: object) -> None:
        attempts.append(str(layout))
        raise TritonLikeError("out of resources: shared memory")

    monkeypatch.setattr(graphs, "_capture", failing_capture)
    static = run_all(engine, prompts, params)
    for rid in prompts:
        assert static[rid].token_ids == eager[rid].token_ids, rid
    assert graphs.buckets and not any(graphs.buckets.values())  # every layout ran eagerly
    assert len(attempts) == len(graphs.capture_errors) == len(graphs.buckets) + len(graphs.chunk_buckets)
    assert set(graphs.capture_errors.values()) == {"TritonLikeError: out of resources: shared memory"}


def test_the_kv_budget_leaves_room_for_the_static_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the pool is sized from free memory before any static step runs: with CUDA graphs on, the
    shared logits buffer they will make is left out of it (read from patched device figures)."""
    import torch

    from onecall.config import DEFAULT_GPU_KV_CACHE_FRACTION, EngineConfig
    from onecall.engine.decode_graphs import DecodeGraphs
    from onecall.engine.engine_parts import kv_blocks_in_budget
    from onecall.model.kv_cache import PagedKVCache
    from tests.helpers.tiny_engine import tiny_model

    mc = tiny_model("qwen2").config
    free = 3 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 4 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cuda = torch.device("cuda")
    per_block = PagedKVCache.bytes_per_block(mc.num_kv_layers, 16, mc.num_key_value_heads, mc.head_dim, torch.bfloat16)
    blocks = {
        graphs: kv_blocks_in_budget(EngineConfig(cuda_graphs=graphs, max_num_seqs=64), mc, torch.bfloat16, cuda)
        for graphs in (False, True)
    }
    budget = int(free * DEFAULT_GPU_KV_CACHE_FRACTION)
    assert blocks[False] == budget // per_block
    assert blocks[True] == (budget - DecodeGraphs.logits_bytes(64, mc.vocab_size)) // per_block


@pytest.mark.slow
@needs_triton
def test_common_layouts_are_prepared_at_start_up_on_scratch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_common runs (on CUDA: captures) the common layouts before any request, on rows that live
    in the scratch block only: afterwards the layouts are known, and requests still get the eager
    engine's tokens (nothing real was read or written)."""
    import onecall.engine.decode_graphs as dg

    monkeypatch.setattr(dg, "COMMON_LAYOUTS", ((1, 0), (2, 0), (0, 8), (1, 16)))
    prompts = {"a": "Count the apples and pears", "b": "Name three colours please"}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eager = run_all(tiny_engine(arch="qwen2"), prompts, params)
    engine = tiny_engine(arch="qwen2")
    engine.enable_static_decode(capture=False, backend="triton")
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    names = graphs.prepare_common(engine.config.block_size)
    assert names == ["decode 1", "decode 2", "decode 0 + chunk 8", "decode 1 + chunk 16"]
    assert set(graphs.buckets) == {1, 2} and set(graphs.chunk_buckets) == {(0, 8), (1, 16)}
    assert graphs.prepare_common(engine.config.block_size) == []  # prepared once
    static = run_all(engine, prompts, params)
    assert {r: o.token_ids for r, o in static.items()} == {r: o.token_ids for r, o in eager.items()}
