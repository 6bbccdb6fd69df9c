"""Decode steps with static shapes: batches padded to a few bucket sizes, replayed as CUDA graphs.

On a GPU a batch-1 decode step of an 8B model should cost one read of the weights (a few ms), but
launched op by op from Python it costs as much again in launch overhead. So a step where every
sequence decodes one token runs on fixed buffers instead:

    bucket      the smallest of BUCKETS >= the number of sequences; rows past it are padding
    buffers     input ids, positions, slot mapping, block tables (bucket, max_blocks), seq lens,
                query starts: preallocated once at the largest bucket, filled in place each step
    padding     id 0 at position 0, writing its K/V into a scratch block no sequence owns and
                attending to that one slot: finite, and never read by a real row
    graph       per bucket, the model's forward + logits captured once (torch.cuda.CUDAGraph) after a
                warm-up run, then replayed; the logits buffer's first n rows are the step's

Everything but the capture runs on any device: on CPU `replay` calls the same forward on the same
padded buffers, so tests check the bucketing, padding and metadata without a GPU (with the Triton
backend under TRITON_INTERPRET=1, the one the graphs use on CUDA). A capture that fails falls back
to that eager path for the bucket, once, with the reason kept in `capture_errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from onecall.model.attention import AttentionMetadata, SeqSpan, padded_block_tables
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(num_seqs: int, max_bucket: int) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None above max_bucket (then run eagerly)."""
    for b in BUCKETS:
        if b > max_bucket:
            break
        if b >= num_seqs:
            return b
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replay eagerly (CPU, or a capture that failed)
    logits: torch.Tensor | None = None  # (bucket, vocab) float32: the captured output


@dataclass
class DecodeGraphs:
    """Static-shape decode for one model and KV cache. `scratch_block` is a block no sequence owns."""

    model: DecoderLM
    kv_cache: PagedKVCache
    max_bucket: int
    max_blocks_per_seq: int
    scratch_block: int
    backend: str  # the attention backend the static metadata is built for ("triton" on CUDA)
    capture: bool  # capture CUDA graphs (CUDA only); False: replay runs the forward eagerly
    capture_errors: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        device = self.model.model.embed_tokens.weight.device
        n, width = self.max_bucket, self.max_blocks_per_seq
        self.device = device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # the CUDA graphs' shared memory pool (a handle from the first graph)

    @property
    def buckets(self) -> dict[int, bool]:
        """The buckets used so far -> whether each replays a captured CUDA graph (else eager)."""
        return {bucket: g.graph is not None for bucket, g in self._graphs.items()}

    # ---- one step ------------------------------------------------------------------------------
    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: Sequence[Sequence[int]],
        seq_lens: list[int],
        block_size: int,
    ) -> torch.Tensor | None:
        """Logits (n, vocab) float32 of n one-token sequences, or None when n is above the largest
        bucket or a table is wider than the buffers (the caller runs the step eagerly)."""
        n = len(input_ids)
        bucket = bucket_for(n, self.max_bucket)
        if bucket is None or any(-(-s // block_size) > self.max_blocks_per_seq for s in seq_lens):
            return None
        self._fill(input_ids, positions, block_tables, seq_lens, block_size, bucket)
        graph = self._graphs.get(bucket) or self._prepare(bucket)
        if graph.graph is None:
            return self._forward(bucket)[:n]
        graph.graph.replay()
        assert graph.logits is not None
        return graph.logits[:n]

    def _fill(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: Sequence[Sequence[int]],
        seq_lens: list[int],
        block_size: int,
        bucket: int,
    ) -> None:
        """Copy the step into the static buffers; rows n..bucket-1 become padding (see the docstring)."""
        n = len(input_ids)
        ids = torch.zeros(bucket, dtype=torch.int64)
        pos = torch.zeros(bucket, dtype=torch.int64)
        slots = torch.full((bucket,), self.scratch_block * block_size, dtype=torch.int64)
        lens = torch.ones(bucket, dtype=torch.int32)
        ids[:n] = torch.tensor(input_ids)
        pos[:n] = torch.tensor(positions)
        lens[:n] = torch.tensor(seq_lens)
        for row, (table, seq_len) in enumerate(zip(block_tables, seq_lens, strict=True)):
            last = seq_len - 1  # this step's token: its K/V goes to the last position's slot
            slots[row] = int(table[last // block_size]) * block_size + last % block_size
        # padding rows: one position, in the scratch block (blocks past a row's length are never read)
        tables = padded_block_tables(
            [*block_tables, *[[self.scratch_block]] * (bucket - n)],
            [*seq_lens, *[1] * (bucket - n)],
            block_size,
            width=self.max_blocks_per_seq,
            pad=self.scratch_block,
        )
        self.input_ids[:bucket].copy_(ids, non_blocking=True)
        self.positions[:bucket].copy_(pos, non_blocking=True)
        self.slot_mapping[:bucket].copy_(slots, non_blocking=True)
        self.block_tables[:bucket].copy_(tables, non_blocking=True)
        self.seq_lens[:bucket].copy_(lens, non_blocking=True)

    def _meta(self, bucket: int) -> AttentionMetadata:
        """Metadata over the static buffers. Its SeqSpans only carry the row layout (one query per
        row); lengths and block tables live in the tensors, which the backends read."""
        spans = [SeqSpan(i, i + 1, 1, -1, None, None, None) for i in range(bucket)]
        return AttentionMetadata(
            backend=self.backend,
            slot_mapping=self.slot_mapping[:bucket],
            seqs=spans,
            block_size=self.kv_cache.block_size,
            block_tables=self.block_tables[:bucket],
            seq_lens_t=self.seq_lens[:bucket],
            query_starts_t=self.query_starts[: bucket + 1],
            max_query_len=1,
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, self._meta(bucket)
        )
        return self.model.compute_logits(hidden)

    # ---- capture ---------------------------------------------------------------------------------
    def _prepare(self, bucket: int) -> _Graph:
        """Capture the bucket's graph (CUDA), or mark it eager. The buffers hold a valid step (the
        current one) when this runs, so the warm-up and the capture compute real values."""
        if not (self.capture and self.device.type == "cuda"):
            graph = _Graph(None)
        else:
            try:
                graph = self._capture(bucket)
            except RuntimeError as e:  # capture is an optimisation: never fail the step for it
                self.capture_errors[bucket] = str(e)
                graph = _Graph(None)
        self._graphs[bucket] = graph
        return graph

    def _capture(self, bucket: int) -> _Graph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)  # warm-up: Triton kernels compiled, allocator primed
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        self._pool = graph.pool()
        return _Graph(graph, logits)
