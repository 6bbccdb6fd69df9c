"""The step metadata's bookkeeping (model/attention_metadata.py), alone: slots and padded block tables
against their definitions, for scrambled tables and chunks that start and end inside blocks."""

from __future__ import annotations

import random

import torch

from onecall.model.attention_metadata import build_attention_metadata, padded_block_tables


def _batch(rng: random.Random, block_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    tables, seq_lens, query_lens = [], [], []
    pool = rng.sample(range(1, 400), 399)
    for _ in range(rng.randint(1, 6)):
        seq_len = rng.randint(1, 90)
        query_len = rng.choice([1, 1, rng.randint(1, seq_len)])
        n = -(-seq_len // block_size) + rng.randint(0, 2)  # tables may hold blocks beyond seq_len
        tables.append([pool.pop() for _ in range(n)])
        seq_lens.append(seq_len)
        query_lens.append(query_len)
    return tables, seq_lens, query_lens


def test_slot_mapping_and_block_tables_follow_their_definitions() -> None:
    rng = random.Random(0)
    for trial in range(200):
        block_size = rng.choice([1, 4, 16])
        tables, seq_lens, query_lens = _batch(rng, block_size)
        backend = ("paged", "reference", "triton")[trial % 3]
        meta = build_attention_metadata(tables, seq_lens, query_lens, block_size, "cpu", backend=backend)
        want = [
            table[p // block_size] * block_size + p % block_size
            for table, n, q in zip(tables, seq_lens, query_lens, strict=True)
            for p in range(n - q, n)
        ]
        assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == want
        padded = padded_block_tables(tables, seq_lens, block_size, pad=-7)
        width = max(-(-n // block_size) for n in seq_lens)
        assert padded.dtype == torch.int32 and padded.shape == (len(tables), width)
        for row, table, n in zip(padded.tolist(), tables, seq_lens, strict=True):
            used = -(-n // block_size)
            assert row == table[:used] + [-7] * (width - used)


def test_an_empty_step_has_empty_tensors() -> None:
    meta = build_attention_metadata([], [], [], 16, "cpu")
    assert meta.slot_mapping.shape == (0,) and meta.slot_mapping.dtype == torch.int64 and meta.num_tokens == 0
    assert padded_block_tables([], [], 16).shape == (0, 0)
