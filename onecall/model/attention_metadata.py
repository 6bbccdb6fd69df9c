"""The per-step attention metadata: what every layer's attention reads, built once per step.

A step's batch is flat: sequence i contributes query_len consecutive tokens (rows
q_start:q_end) whose positions are seq_len - query_len ... seq_len - 1 (seq_len is the KV
length after this step: cached prefix + new tokens). A prefill chunk and a decode row are
the same thing with different query_len, so one mixed batch needs no special cases.
Everything that depends only on the step (slots to write, where each sequence's KV lives,
masks) is built once in `build_attention_metadata` and reused by every layer; which of it is
built depends on the backend model/attention.py runs ("reference": slot lists; "paged": a run's
first slot or its blocks, and for the native kernels the decode rows' padded block tables;
"triton": block tables, lengths and query starts as tensors, the form CUDA graphs replay). The
metadata also carries what the step's kernels need to know: the backend's AttentionKernels
(kernels/select.py picks them) and how many leading rows are decode tokens (`num_decode`, which the
projections read: kernels/cpu/fast_linear.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onecall.kernels.ops import TORCH_ATTENTION, AttentionKernels
from onecall.kernels.select import attention_kernels, triton_available

ATTENTION_BACKENDS = ("reference", "paged", "triton")


def default_backend(device: torch.device | str, kernels: str, *, latent_attention: bool = False) -> str:
    """The attention backend for a device and the kernels switch: "triton" on CUDA with the fast
    kernels (when triton is installed, as it is with torch's CUDA builds), "paged" otherwise. A model
    with latent attention (DeepSeek-V3's MLA, model/deepseek.py) attends in its own torch code over
    each sequence's cache rows, which only the "paged" metadata carries: "paged" on every device."""
    if latent_attention:
        return "paged"
    if torch.device(device).type == "cuda" and kernels == "fast" and triton_available():
        return "triton"
    return "paged"


@dataclass
class SeqSpan:
    """One sequence of the step, as attention sees it."""

    q_start: int  # its query rows in the flat batch: q_start:q_end
    q_end: int
    seq_len: int  # KV length after this step (cached + new)
    kv_start: int  # "paged": first slot of its KV when its blocks form one run, else -1
    blocks: torch.Tensor | None  # "paged", not one run: (num_blocks,) int64 block ids, in order
    slots: torch.Tensor | None  # "reference": (seq_len,) int64 slots of its whole KV
    # (query_len, seq_len) bool, True = attend: only when 1 < query_len < seq_len (a chunk after a
    # cached prefix). One query sees everything; query_len == seq_len is SDPA's own is_causal.
    mask: torch.Tensor | None

    @property
    def query_len(self) -> int:
        return self.q_end - self.q_start


@dataclass
class DecodeRows:
    """The step's one-query sequences, for one decode-kernel call per layer that reads their KV in
    place through the block tables (where the step's AttentionKernels read decode rows)."""

    seq_index: list[int]  # which of meta.seqs
    rows: torch.Tensor  # (n,) int64: their rows in the flat batch
    rows_are_prefix: bool  # rows == 0..n-1 (the engine puts decode rows first): slice, no gather
    block_tables: torch.Tensor  # (n, max_blocks) int32, padded with 0
    seq_lens: torch.Tensor  # (n,) int32


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers."""

    backend: str
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot where each new token's K/V goes
    seqs: list[SeqSpan]
    block_size: int
    # "triton" only: the whole batch as tensors on the device
    block_tables: torch.Tensor | None = None  # (num_seqs, max_blocks) int32, padded with 0
    seq_lens_t: torch.Tensor | None = None  # (num_seqs,) int32
    query_starts_t: torch.Tensor | None = None  # (num_seqs + 1,) int32
    max_query_len: int = 0
    kernels: AttentionKernels = TORCH_ATTENTION  # what attention runs on (kernels/select.py)
    decode: DecodeRows | None = None  # the one-query sequences, where `kernels` reads decode rows
    # rows 0 .. num_decode - 1 are decode tokens, the rest prompt tokens: the projections run each on
    # their own kernels whatever shares the batch. None: not planned (tests; see fast_linear.py)
    num_decode: int | None = None
    # hybrid models: (num_seqs,) int64, the LinearStateCache slot of each sequence (model/state_cache.py)
    state_slots: torch.Tensor | None = None
    # hybrid models: (sequence index, position p, slot): also write the state after the sequence's first
    # p tokens into that slot (p inside this step's chunk of it: a prefix snapshot mid-chunk)
    state_snapshots: list[tuple[int, int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.seqs[-1].q_end if self.seqs else 0


def _causal_mask(query_len: int, seq_len: int) -> torch.Tensor:
    """(query_len, seq_len) bool: query i (position seq_len - query_len + i) sees keys 0..its position."""
    cached = seq_len - query_len
    return torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=cached)


def first_run_length(block_table: Sequence[int]) -> int:
    """How many leading blocks of the table are consecutive ids (table[i] == table[0] + i)."""
    n = 1 if block_table else 0
    while n < len(block_table) and block_table[n] == block_table[n - 1] + 1:
        n += 1
    return n


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str,
    backend: str = "paged",
    run_lengths: Sequence[int] | None = None,
    num_decode: int | None = None,
    state_slots: Sequence[int] | None = None,
    state_snapshots: Sequence[tuple[int, int, int]] | None = None,
) -> AttentionMetadata:
    """Build a step's metadata. block_tables[i][j] = physical block of positions j*block_size... of seq i.

    `run_lengths[i]` (optional): how many leading blocks of table i are one run, when the caller
    tracks it incrementally (the engine's KV manager does); otherwise it is computed here.
    `num_decode`: how many leading rows are decode tokens (the engine packs them first).
    `state_slots`: a hybrid model's state slot per sequence (model/state_cache.py).
    """
    assert backend in ATTENTION_BACKENDS, f"unknown attention backend {backend!r}"
    assert len(block_tables) == len(seq_lens) == len(query_lens), (
        "one block table, seq_len, query_len per seq"
    )
    device = torch.device(device)
    # every new token's slot as a Python int, one tensor at the end: a decode step makes no tensor per
    # sequence for its slots (a decode row is one int; a prompt chunk's run of ints costs far less than
    # its forward)
    slot_list: list[int] = []
    seqs: list[SeqSpan] = []
    q_start = 0
    for i, (table, seq_len, query_len) in enumerate(zip(block_tables, seq_lens, query_lens, strict=True)):
        assert 1 <= query_len <= seq_len, f"query_len {query_len} must be in [1, seq_len {seq_len}]"
        num_blocks = -(-seq_len // block_size)
        assert len(table) >= num_blocks, f"block table has {len(table)} blocks, needs {num_blocks}"
        # 1. slots of the new tokens (positions seq_len - query_len .. seq_len - 1)
        first = seq_len - query_len
        if query_len == 1:
            slot_list.append(table[first // block_size] * block_size + first % block_size)
        else:
            slot_list += _slot_list(table, first, seq_len, block_size)
        # 2. where its whole KV lives, per backend
        kv_start, blocks, slots = -1, None, None
        if backend == "reference":
            slots = _slots(table, 0, seq_len, block_size).to(device)
        elif backend == "paged":
            run = first_run_length(table) if run_lengths is None else run_lengths[i]
            if run >= num_blocks:
                kv_start = table[0] * block_size
            else:
                blocks = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
        mask = None
        if backend != "triton" and 1 < query_len < seq_len:
            mask = _causal_mask(query_len, seq_len).to(device)
        seqs.append(SeqSpan(q_start, q_start + query_len, seq_len, kv_start, blocks, slots, mask))
        q_start += query_len
    slot_mapping = torch.tensor(slot_list, dtype=torch.int64)
    kernels = attention_kernels(backend, device)
    meta = AttentionMetadata(backend, slot_mapping.to(device), seqs, block_size, kernels=kernels)
    meta.num_decode = num_decode
    if state_slots is not None:
        assert len(state_slots) == len(seqs), "one state slot per sequence"
        meta.state_slots = torch.tensor(list(state_slots), dtype=torch.int64, device=device)
    if state_snapshots:
        assert state_slots is not None, "snapshots are of sequences with state slots"
        for i, p, _ in state_snapshots:
            s = seqs[i]
            assert s.seq_len - s.query_len < p <= s.seq_len, "a snapshot inside the sequence's chunk"
        meta.state_snapshots = list(state_snapshots)
    if kernels.reads_decode_rows:
        meta.decode = _decode_rows(seqs, block_tables, block_size)
    if backend == "triton":
        _add_triton_tensors(meta, block_tables, seq_lens, query_lens, device)
    return meta


def _slot_list(table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of positions start..end-1, as ints."""
    out: list[int] = []
    for b in range(start // block_size, -(-end // block_size)):
        base = table[b] * block_size
        out += range(base + max(start - b * block_size, 0), base + min(end - b * block_size, block_size))
    return out


def _slots(table: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """(end - start,) int64 slots of positions start..end-1, on CPU."""
    first_block, last_block = start // block_size, -(-end // block_size)
    blocks = torch.tensor(table[first_block:last_block], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    offset = start - first_block * block_size
    return slots[offset : offset + end - start]


def padded_block_tables(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    width: int | None = None,
    pad: int = 0,
) -> torch.Tensor:
    """(num_seqs, width) int32 on CPU: row i holds the blocks covering seq_lens[i] positions of
    table i, then `pad`. `width` defaults to the widest row; what the kernels read as block tables."""
    flat, width = padded_block_list(block_tables, seq_lens, block_size, width, pad)
    return torch.tensor(flat, dtype=torch.int32).view(len(seq_lens), width)


def padded_block_list(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    width: int | None = None,
    pad: int = 0,
) -> tuple[list[int], int]:
    """padded_block_tables' rows as one flat list (one tensor, not one per row), and the width."""
    needed = [-(-s // block_size) for s in seq_lens]
    width = width or max(needed, default=0)
    flat: list[int] = []
    for table, n in zip(block_tables, needed, strict=True):
        flat += table[:n]
        flat += [pad] * (width - n)
    return flat, width


def _decode_rows(
    seqs: list[SeqSpan], block_tables: Sequence[Sequence[int]], block_size: int
) -> DecodeRows | None:
    index = [i for i, s in enumerate(seqs) if s.query_len == 1]
    if not index:
        return None
    tables = padded_block_tables(
        [block_tables[i] for i in index], [seqs[i].seq_len for i in index], block_size
    )
    rows = [seqs[i].q_start for i in index]
    return DecodeRows(
        seq_index=index,
        rows=torch.tensor(rows, dtype=torch.int64),
        rows_are_prefix=rows == list(range(len(rows))),
        block_tables=tables,
        seq_lens=torch.tensor([seqs[i].seq_len for i in index], dtype=torch.int32),
    )


def _add_triton_tensors(
    meta: AttentionMetadata,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    device: torch.device,
) -> None:
    tables = padded_block_tables(block_tables, seq_lens, meta.block_size)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta.block_tables = tables.to(device)
    meta.seq_lens_t = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
    meta.query_starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
    meta.max_query_len = max(query_lens)
