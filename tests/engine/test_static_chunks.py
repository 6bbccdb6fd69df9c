"""Short prompt chunks as static-shape steps (engine/decode_graphs.py) on CPU.

A step whose last sequence feeds a chunk of up to MAX_CHUNK tokens (after a cached prefix), beside
one-token decode rows or alone, runs on the padded static buffers (a CUDA graph on CUDA; here the same
buffers eagerly, with the Triton backend under TRITON_INTERPRET=1, tests/conftest.py). Checked:

- the logits at each sequence's last token equal the eager Triton step's (ModelRunner.run) to
  ATOL = RTOL = 1e-4 (torch.testing.assert_close), and their argmax exactly, for chunks of 1, 7, 20
  and 64 tokens after a prefix spanning several blocks, with and without decode rows;
- padding writes only the scratch block: every other slot the step does not feed keeps its bytes
  (a bystander sequence's blocks, the prefix, the slots past the chunk in its last block);
- steps that do not fit (a chunk over MAX_CHUNK, two prompt chunks, a chunk not last, a table wider
  than the buffers, too many decode rows) return None and touch nothing;
- end to end through the LLM API, chunks after a cached prefix and chunked prefills beside decode
  rows give the greedy tokens of the reference attention path, and ran on the static layouts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from onecall import LLM
from onecall.engine.decode_graphs import MAX_CHUNK, DecodeGraphs, Layout, layout_for
from onecall.engine.model_runner import ModelRunner
from onecall.engine.step_inputs import StepInputs
from onecall.model.attention_metadata import first_run_length
from onecall.model.kv_cache import PagedKVCache
from onecall.sampling_params import SamplingParams
from tests.helpers.tiny_engine import tiny_engine, tiny_model

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton on CPU needs TRITON_INTERPRET=1 (conftest sets it)",
    ),
    pytest.mark.usefixtures("single_thread"),
]

# float32 throughout; the static step multiplies more rows at once than the eager one (padding), which
# may block a matmul's sums differently: measured up to 3e-5 on logits of magnitude ~40 (float32 rounding)
ATOL = RTOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
SCRATCH = NUM_BLOCKS - 1
PREFIX = 13  # cached tokens before the chunk: three full blocks and one partial


def _cache() -> PagedKVCache:
    mc = tiny_model().config
    kv = PagedKVCache(
        mc.num_hidden_layers,
        NUM_BLOCKS,
        BLOCK_SIZE,
        mc.num_key_value_heads,
        mc.head_dim,
        torch.float32,
        "cpu",
    )
    gen = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))  # a "cached" KV everywhere, the prefix included
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    return kv


def _step(chunk: int, decode_lens: list[int], prefix: int = PREFIX) -> StepInputs:
    """One-token rows for sequences of decode_lens (KV length after the step), then one chunk of
    `chunk` tokens after `prefix` cached ones. Blocks are handed out scattered (a stride of 3 from
    block 1), so tables are not one run; block 0 belongs to no one in the step (a bystander's)."""
    free = iter(range(1, SCRATCH, 3))
    seq_lens = [*decode_lens, prefix + chunk]
    tables: list[Sequence[int]] = [[next(free) for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    query_lens = [*[1] * len(decode_lens), chunk]
    ids: list[int] = []
    positions: list[int] = []
    for n, q in zip(seq_lens, query_lens, strict=True):
        positions += range(n - q, n)
        ids += [(7 * p + 3 * n) % 500 + 10 for p in range(n - q, n)]
    rows = [sum(query_lens[: i + 1]) - 1 for i in range(len(seq_lens))]
    return StepInputs(
        copies=[], input_ids=ids, positions=positions, block_tables=tables, seq_lens=seq_lens,
        query_lens=query_lens, run_lengths=[first_run_length(t) for t in tables], sample_rows=rows,
        prompt_rows=[], num_decode=len(decode_lens),
    )  # fmt: skip


def _graphs(kv: PagedKVCache, max_bucket: int = 8, max_blocks: int = 32) -> DecodeGraphs:
    return DecodeGraphs(
        model=tiny_model(), kv_cache=kv, max_bucket=max_bucket, max_blocks_per_seq=max_blocks,
        scratch_block=SCRATCH, backend="triton", capture=False,
    )  # fmt: skip


def _fed_slots(step: StepInputs) -> set[int]:
    out: set[int] = set()
    for table, n, q in zip(step.block_tables, step.seq_lens, step.query_lens, strict=True):
        out |= {table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q, n)}
    return out


@pytest.mark.parametrize("decode_lens", [[], [6, 9, 17]], ids=["alone", "with-decode-rows"])
@pytest.mark.parametrize("chunk", [1, 7, 20, MAX_CHUNK])
def test_a_static_chunk_step_gives_the_eager_logits_and_writes_only_its_slots(
    chunk: int, decode_lens: list[int]
) -> None:
    step = _step(chunk, decode_lens)
    if decode_lens:
        step.sample_rows.reverse()  # batch order need not be packed order: the logits follow the batch
    eager_kv, static_kv = _cache(), _cache()
    before = static_kv.k.clone(), static_kv.v.clone()
    model = tiny_model()
    eager = ModelRunner(model, eager_kv, None, torch.device("cpu"), "triton", block_size=BLOCK_SIZE).run(step)
    runner = ModelRunner(model, static_kv, None, torch.device("cpu"), "triton", block_size=BLOCK_SIZE)
    graphs = runner.decode_graphs = _graphs(static_kv)
    static = runner.run_static(step)
    assert static is not None
    expected_layout = layout_for(step.query_lens, 8)
    assert expected_layout is not None and graphs.fits(step, BLOCK_SIZE) == expected_layout
    if chunk == 1:
        assert graphs.buckets == {expected_layout.decode: False}  # a one-token chunk is a decode row
    else:
        assert graphs.chunk_buckets == {(expected_layout.decode, expected_layout.chunk): False}
    assert static.shape == eager.shape == (len(step.seq_lens), model.vocab_size)
    torch.testing.assert_close(static, eager, atol=ATOL, rtol=RTOL)
    assert static.argmax(-1).tolist() == eager.argmax(-1).tolist()
    # the KV the step feeds equals the eager step's; every other slot but the scratch block's keeps
    # its bytes: the prefix, the bystander block 0, the slots past the chunk in its last block
    fed = sorted(_fed_slots(step))
    for got, want in ((static_kv.k, eager_kv.k), (static_kv.v, eager_kv.v)):
        torch.testing.assert_close(got[:, fed], want[:, fed], atol=ATOL, rtol=RTOL)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[fed] = False
    untouched[SCRATCH * BLOCK_SIZE :] = False
    assert torch.equal(static_kv.k[:, untouched], before[0][:, untouched])
    assert torch.equal(static_kv.v[:, untouched], before[1][:, untouched])


def test_layouts() -> None:
    assert layout_for([1, 1, 1], 64) == Layout(4)
    assert layout_for([1, 1, 1, 1], 64) == Layout(4)  # the last one-token sequence may be a prompt's
    assert layout_for([20], 64) == Layout(0, 32)
    assert layout_for([1, 1, 1, 2], 64) == Layout(4, 8)
    assert layout_for([1, MAX_CHUNK], 64) == Layout(1, MAX_CHUNK)
    assert Layout(4, 8).num_tokens == 12 and Layout(4, 8).num_seqs == 6 and Layout(4, 8).num_logits == 5
    assert Layout(4).num_logits == 4 and Layout(4).num_seqs == 4 and Layout(0, 8).num_seqs == 2
    for query_lens in ([], [MAX_CHUNK + 1], [3, 5], [5, 1], [1] * 9 + [4], [1] * 9):
        assert layout_for(query_lens, 8) is None, query_lens


@pytest.mark.parametrize(
    "case",
    ["chunk-too-long", "two-chunks", "chunk-not-last", "table-too-wide", "too-many-decode-rows"],
)
def test_steps_that_do_not_fit_run_eagerly_and_touch_nothing(case: str) -> None:
    max_blocks = 32
    if case == "chunk-too-long":
        step = _step(MAX_CHUNK + 1, [5])
    elif case == "two-chunks":
        step = _step(6, [5])
        step.query_lens[0] = 2  # the first sequence feeds two tokens
        step.input_ids.insert(0, 11)
        step.positions.insert(0, 3)
    elif case == "chunk-not-last":
        step = _step(1, [6])
        step.query_lens[0] = 2
    elif case == "table-too-wide":
        step, max_blocks = _step(8, [5], prefix=30), 8  # 38 positions, 10 blocks: the buffers hold 8
    else:
        step = _step(3, [5] * 9)  # 9 decode rows, the largest bucket 8
    step.copies = [(0, 1)]  # a copy-on-write the eager path would apply: the static one must not
    kv = _cache()
    before = kv.k.clone(), kv.v.clone()
    graphs = _graphs(kv, max_blocks=max_blocks)
    assert graphs.fits(step, BLOCK_SIZE) is None
    assert graphs.run(step, BLOCK_SIZE) is None
    assert torch.equal(kv.k, before[0]) and torch.equal(kv.v, before[1])
    assert not graphs.buckets and not graphs.chunk_buckets


def test_copies_are_applied_before_a_static_step() -> None:
    """An admitted prompt's copy-on-write (a partially matched prefix block) runs before its chunk:
    the prefix's last, partial block is copied into the sequence's own block first."""
    step = _step(5, [])
    table = list(step.block_tables[0])
    shared = 0  # the prefix cache's block holding positions 12..15 (PREFIX 13: position 12 cached)
    own = table[PREFIX // BLOCK_SIZE]
    step.copies = [(shared * BLOCK_SIZE, own * BLOCK_SIZE)]
    eager_kv, static_kv = _cache(), _cache()
    eager = ModelRunner(
        tiny_model(), eager_kv, None, torch.device("cpu"), "triton", block_size=BLOCK_SIZE
    ).run(step)
    static = _graphs(static_kv).run(step, BLOCK_SIZE)
    assert static is not None
    torch.testing.assert_close(static, eager, atol=ATOL, rtol=RTOL)
    slot = own * BLOCK_SIZE
    assert torch.equal(static_kv.k[:, slot], static_kv.k[:, shared * BLOCK_SIZE])


def test_a_chunk_that_does_not_sample_gives_only_the_decode_rows_logits() -> None:
    """A prompt chunk cut by the token budget samples nothing: the logits are the decode rows' only."""
    step = _step(20, [6, 9])
    step.sample_rows = step.sample_rows[:2]
    model, cpu = tiny_model(), torch.device("cpu")
    eager = ModelRunner(model, _cache(), None, cpu, "triton", block_size=BLOCK_SIZE).run(step)
    static_kv = _cache()
    runner = ModelRunner(model, static_kv, None, cpu, "triton", block_size=BLOCK_SIZE)
    runner.decode_graphs = _graphs(static_kv)
    static = runner.run_static(step)
    assert static is not None and static.shape == eager.shape == (2, model.vocab_size)
    torch.testing.assert_close(static, eager, atol=ATOL, rtol=RTOL)


def _engines(monkeypatch: pytest.MonkeyPatch, **config: Any) -> tuple[LLM, LLM]:
    """(the static path: Triton backend, static steps set up as on CUDA, no capture; the reference
    attention backend, every step eager), over the same tiny model."""
    import onecall.engine.engine as engine_module

    reference = tiny_engine(arch="qwen2", cuda_graphs=False, **config)
    reference.runner.attention_backend = "reference"
    monkeypatch.setattr(engine_module, "default_backend", lambda device, kernels, **_: "triton")
    static = tiny_engine(arch="qwen2", **config)
    assert static.runner.decode_graphs is not None and not static.runner.decode_graphs.capture
    return LLM(engine=static), LLM(engine=reference)


@pytest.mark.slow
def test_chunks_after_a_cached_prefix_through_the_llm_api(monkeypatch: pytest.MonkeyPatch) -> None:
    static, reference = _engines(monkeypatch, enable_prefix_caching=True)
    prefix = [(11 * j + 5) % 700 + 20 for j in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for llm in (static, reference):
        llm.generate(prefix, params)  # the prefix enters the cache
    for suffix in (1, 7, 20, 40):
        prompt = prefix + [(13 * j + 2) % 700 + 20 for j in range(suffix)]
        got, want = static.generate(prompt, params)[0], reference.generate(prompt, params)[0]
        assert got.num_cached_tokens >= 28  # the prompt's first chunk ran after a cached prefix
        assert list(got.token_ids) == list(want.token_ids), suffix
    graphs = static.engine.runner.decode_graphs
    assert graphs is not None
    assert {c for d, c in graphs.chunk_buckets if d == 0} >= {8, 32}  # 7 and 20 new tokens ran static


@pytest.mark.slow
def test_chunked_prefills_beside_decode_rows_through_the_llm_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token budget of 16 cuts prompts into 16-token chunks, which run beside other requests'
    decode rows: mixed layouts, each chunk after the earlier ones' KV."""
    static, reference = _engines(monkeypatch, max_num_batched_tokens=16)
    prompts = [[(7 * i + 3 * j) % 600 + 30 for j in range(8 + 19 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got, want = static.generate(prompts, params), reference.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
    graphs = static.engine.runner.decode_graphs
    assert graphs is not None and any(d > 0 for d, _ in graphs.chunk_buckets)  # chunks beside decode rows
