"""Steps with static shapes: decode batches, and one short prompt chunk beside them, padded to a few
bucket sizes and replayed as CUDA graphs.

On a GPU a batch-1 decode step of an 8B model should cost one read of the weights (a few ms), but
launched op by op from Python it costs as much again in launch overhead. The same holds for a short
prompt chunk (the new tokens of a prompt whose prefix is cached, a chunked prefill's remainder):
the weights are read once whether the chunk is 1 token or 64. So a step whose sequences all feed one
token, except perhaps the last, which feeds a chunk of at most MAX_CHUNK tokens, runs on fixed buffers:

    layout      (decode bucket, chunk bucket): the smallest of BUCKETS >= the one-token sequences
                (0 when a chunk runs alone), the smallest of CHUNK_BUCKETS >= the chunk's tokens
                (0 for a pure-decode step; a one-token chunk is a decode row, since attention
                treats them alike)
    rows        decode rows, their padding, the chunk's rows, the chunk's padding:
                    0 .. n-1 | n .. d-1 | d .. d+c-1 | d+c .. d+C-1   (d, C: the buckets)
    sequences   d one-token sequences (real, then padding), then for a chunk two more: the chunk's
                own, and one "padding sequence" holding its padding rows (possibly none)
    buffers     input ids, positions, slot mapping, block tables (sequences, max_blocks), seq lens,
                query starts, logit rows: preallocated once at the largest layout, filled in place
                each step; attention reads lengths and row ranges from these tensors, so a graph
                launches the Triton kernel with a fixed grid and the step's values decide its work
    padding     decode padding: id 0 at position 0, writing its K/V into the scratch block (a block
                no sequence owns) and attending to that one slot. Chunk padding: ids 0 at positions
                0 .. P-1 of the padding sequence, whose block table is the scratch block repeated;
                row p writes slot p % block_size of the scratch block (several rows may write one
                slot: any of their finite values will do). No padding row writes a real block, and
                attention is per sequence, every other op per row: a real row's values are those of
                the eager step (to the arithmetic's rounding: matmuls over more rows may block the
                sums differently)
    logits      pure decode: every row's. With a chunk only rows the step needs, by a static index
                (logit_rows): the decode rows, then the chunk's last token, then the decode padding
    copies      a step's copy-on-write slot copies (an admitted prompt's partially matched prefix
                block) run before the forward, outside any graph
    graph       per layout, the forward + logits captured as a torch.cuda.CUDAGraph, then replayed:
                COMMON_LAYOUTS at start-up (prepare_common, on scratch-block rows), any other at its
                first use (that step pays a warm-up run and the capture); all layouts
                share the buffers (each fills what it reads) and one memory pool, and write their
                logits into one output buffer (max_bucket + 1, vocab) float32 made with the others
                (a buffer per layout was ~1.1 GB each at 64 rows of a 262k vocabulary; the copy
                into it costs a read and a write of the step's logits). `logits_bytes` says what it
                takes, which the KV budget leaves free (engine_parts.kv_blocks_in_budget)

Everything but the capture runs on any device: on CPU `run` calls the same forward on the same
padded buffers, so tests check the layouts, padding and metadata without a GPU (with the Triton
backend under TRITON_INTERPRET=1, the one the graphs use on CUDA). A capture that fails falls back
to that eager path for the layout, once, with the reason kept in `capture_errors`. (The class keeps
the name DecodeGraphs it had when it ran decode steps only.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from onecall.engine.step_inputs import StepInputs
from onecall.kernels.select import attention_kernels
from onecall.model.attention_metadata import AttentionMetadata, SeqSpan, padded_block_list
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CHUNK_BUCKETS = (8, 16, 32, 64)
MAX_CHUNK = CHUNK_BUCKETS[-1]  # a prompt chunk longer than this runs eagerly
# the layouts captured at start-up (DecodeGraphs.prepare_common), so the first requests' steps replay a
# graph instead of paying a capture: single-stream decode, small batches, and a short prompt chunk
# alone or beside one decode row (a cached prefix plus a few new tokens: the TTFT path)
COMMON_LAYOUTS = (
    (1, 0), (2, 0), (4, 0), (8, 0), (0, 8), (0, 16), (0, 32), (0, 64), (1, 16), (1, 64),
)  # fmt: skip


def bucket_for(num_seqs: int, max_bucket: int) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None above max_bucket (then run eagerly)."""
    for b in BUCKETS:
        if b > max_bucket:
            break
        if b >= num_seqs:
            return b
    return None


@dataclass(frozen=True)
class Layout:
    """A static step's shape: `decode` one-token rows (a bucket), then `chunk` rows of one prompt chunk
    (a CHUNK_BUCKETS size; 0: a pure-decode step)."""

    decode: int
    chunk: int = 0

    @property
    def num_tokens(self) -> int:
        return self.decode + self.chunk

    @property
    def num_seqs(self) -> int:
        return self.decode + (2 if self.chunk else 0)  # the chunk's own, and its padding sequence

    @property
    def num_logits(self) -> int:
        return self.num_tokens if not self.chunk else self.decode + 1

    @property
    def name(self) -> str:
        return f"decode {self.decode}" + (f" + chunk {self.chunk}" if self.chunk else "")


def layout_for(query_lens: Sequence[int], max_bucket: int) -> Layout | None:
    """The layout of a step whose sequences feed query_lens tokens (one-token ones first), or None
    when it has none: more than one sequence feeding several tokens, a chunk over MAX_CHUNK, more
    one-token sequences than max_bucket."""
    if not query_lens or any(q != 1 for q in query_lens[:-1]):
        return None
    chunk = query_lens[-1]
    if chunk == 1:
        bucket = bucket_for(len(query_lens), max_bucket)
        return None if bucket is None else Layout(bucket)
    num_decode = len(query_lens) - 1
    bucket = bucket_for(num_decode, max_bucket) if num_decode else 0
    if bucket is None or chunk > MAX_CHUNK:
        return None
    return Layout(bucket, next(c for c in CHUNK_BUCKETS if c >= chunk))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (CPU, or a capture that failed)


@dataclass
class DecodeGraphs:
    """Static-shape steps for one model and KV cache. `scratch_block` is a block no sequence owns."""

    model: DecoderLM
    kv_cache: PagedKVCache
    max_bucket: int  # the most one-token sequences a static step holds
    max_blocks_per_seq: int
    scratch_block: int
    backend: str  # the attention backend the static metadata is built for ("triton" on CUDA)
    capture: bool  # capture CUDA graphs (CUDA only); False: every layout runs the forward eagerly
    capture_errors: dict[str, str] = field(default_factory=dict)  # layout name -> why capture failed

    def __post_init__(self) -> None:
        device = self.model.model.norm.weight.device
        tokens, seqs, width = self.max_bucket + MAX_CHUNK, self.max_bucket + 2, self.max_blocks_per_seq
        self.device = device
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(seqs, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        self.logit_rows = torch.zeros(self.max_bucket + 1, dtype=torch.int64, device=device)
        # every layout's logits, written in place (a layout has at most max_bucket + 1 sampling rows)
        self.logits = torch.empty(
            self.max_bucket + 1, self.model.vocab_size, dtype=torch.float32, device=device
        )
        # a step's values travel in one transfer: written into a host buffer (pinned on CUDA, so the
        # copy is a real asynchronous DMA), copied to one device buffer, then split on the device. The
        # next _fill waits for the previous transfer (an event) before rewriting the host buffer: a
        # step where nothing samples (a non-final prompt chunk alone) never syncs the host otherwise.
        staged = 3 * tokens + seqs * width + seqs + (seqs + 1) + self.max_bucket + 1
        self._host = torch.empty(staged, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staged = torch.empty(staged, dtype=torch.int64, device=device)
        # recorded after each transfer, on the stream of the staged buffer's device (CUDA only)
        self._copied = torch.cuda.Event() if self._staged.is_cuda else None
        self._copy_pending = False
        self._graphs: dict[Layout, _Graph] = {}
        self._pool: Any = None  # the CUDA graphs' shared memory pool (a handle from the first graph)

    @property
    def buckets(self) -> dict[int, bool]:
        """The pure-decode buckets used so far -> whether each replays a captured CUDA graph."""
        return {lay.decode: g.graph is not None for lay, g in self._graphs.items() if not lay.chunk}

    @property
    def chunk_buckets(self) -> dict[tuple[int, int], bool]:
        """The (decode bucket, chunk bucket) layouts with a prompt chunk used so far -> whether each
        replays a captured CUDA graph."""
        return {(lay.decode, lay.chunk): g.graph is not None for lay, g in self._graphs.items() if lay.chunk}

    def fits(self, step: StepInputs, block_size: int) -> Layout | None:
        """The step's layout, or None when it runs eagerly (see layout_for; or a block table wider
        than the buffers, for a sequence or for the chunk's padding sequence)."""
        layout = layout_for(step.query_lens, self.max_bucket)
        widest = max(step.seq_lens, default=0)
        if layout is None or -(-max(widest, layout.chunk) // block_size) > self.max_blocks_per_seq:
            return None
        return layout

    # ---- one step ------------------------------------------------------------------------------
    def run(self, step: StepInputs, block_size: int) -> torch.Tensor | None:
        """Logits (num_seqs, vocab) float32 at each sequence's last token, in the step's order, or None
        when the step does not fit (then nothing was done: the caller runs it eagerly). The step's
        copy-on-write slot copies are applied first. The tensor may be the graph's output buffer:
        valid until the next step."""
        layout = self.fits(step, block_size)
        if layout is None:
            return None
        if step.copies:
            self.kv_cache.copy_slots([s for s, _ in step.copies], [d for _, d in step.copies])
        self._fill(step, block_size, layout)
        graph = self._graphs.get(layout) or self._prepare(layout)
        n = len(step.seq_lens)
        if graph.graph is None:
            self._forward(layout)
        else:
            graph.graph.replay()
        return self.logits[:n]

    def _fill(self, step: StepInputs, block_size: int, layout: Layout) -> None:
        """Copy the step into the static buffers, padding it to the layout (see the docstring)."""
        # 1. rows: real decode rows, decode padding, the chunk's rows, the chunk's padding
        num_tokens, first = layout.num_tokens, self.scratch_block * block_size
        num_decode = len(step.seq_lens) - (1 if layout.chunk else 0)  # the real one-token sequences
        chunk_len = len(step.input_ids) - num_decode  # 0 for pure decode
        pad = layout.chunk - chunk_len  # the chunk's padding rows
        row_pad = layout.decode - num_decode  # decode padding: id 0 at position 0 in the scratch block
        real_slots = _slots(step.block_tables, step.seq_lens, step.query_lens, block_size)
        ids = [*step.input_ids[:num_decode], *[0] * row_pad, *step.input_ids[num_decode:], *[0] * pad]
        pos = [*step.positions[:num_decode], *[0] * row_pad, *step.positions[num_decode:], *range(pad)]
        slots = [
            *real_slots[:num_decode], *[first] * row_pad, *real_slots[num_decode:],
            *(first + p % block_size for p in range(pad)),
        ]  # fmt: skip
        # 2. sequences: one-token ones (padding: one position in the scratch block), then the chunk's
        # and its padding sequence's (the scratch block repeated); blocks past a length are never read
        tables = [*step.block_tables[:num_decode], *[[self.scratch_block]] * row_pad]
        lens = [*step.seq_lens[:num_decode], *[1] * row_pad]
        starts = list(range(layout.decode + 1))
        logit_rows: list[int] = []
        if layout.chunk:
            tables += [step.block_tables[-1], [self.scratch_block] * -(-pad // block_size)]
            lens += [step.seq_lens[-1], pad]
            starts += [layout.decode + chunk_len, num_tokens]
            chunk_last = layout.decode + chunk_len - 1
            logit_rows = [*range(num_decode), chunk_last, *range(num_decode, layout.decode)]
        width, num_seqs = self.max_blocks_per_seq, layout.num_seqs
        padded, _ = padded_block_list(tables, lens, block_size, width=width, pad=self.scratch_block)
        # 3. one host buffer, one transfer, then each static buffer takes its part on the device
        parts = (ids, pos, slots, padded, lens, starts, logit_rows)
        flat = [v for part in parts for v in part]
        if self._copied is not None and self._copy_pending:
            self._copied.synchronize()  # the previous step's transfer has read the host buffer
        host = self._host[: len(flat)]
        host.copy_(torch.tensor(flat, dtype=torch.int64))
        staged = self._staged[: len(flat)]
        staged.copy_(host, non_blocking=True)
        if self._copied is not None:  # on the stream that queued the copy (that of staged's device)
            self._copied.record(torch.cuda.current_stream(staged.device))
            self._copy_pending = True
        views = staged.split([len(part) for part in parts])
        self.input_ids[:num_tokens].copy_(views[0])
        self.positions[:num_tokens].copy_(views[1])
        self.slot_mapping[:num_tokens].copy_(views[2])
        self.block_tables[:num_seqs].copy_(views[3].view(num_seqs, width))  # int64 -> int32 on the device
        self.seq_lens[:num_seqs].copy_(views[4])
        self.query_starts[: num_seqs + 1].copy_(views[5])
        if logit_rows:
            self.logit_rows[: len(logit_rows)].copy_(views[6])

    def _meta(self, layout: Layout) -> AttentionMetadata:
        """Metadata over the static buffers. Its SeqSpans carry only the layout's row ranges (and
        seq_len -1): the step's lengths and row ranges live in the tensors, which the backend reads."""
        spans = [SeqSpan(i, i + 1, -1, -1, None, None, None) for i in range(layout.decode)]
        if layout.chunk:
            end = layout.num_tokens
            spans += [
                SeqSpan(layout.decode, end, -1, -1, None, None, None),
                SeqSpan(end, end, -1, -1, None, None, None),
            ]
        return AttentionMetadata(
            backend=self.backend,
            slot_mapping=self.slot_mapping[: layout.num_tokens],
            seqs=spans,
            block_size=self.kv_cache.block_size,
            block_tables=self.block_tables[: layout.num_seqs],
            seq_lens_t=self.seq_lens[: layout.num_seqs],
            query_starts_t=self.query_starts[: layout.num_seqs + 1],
            max_query_len=max(layout.chunk, 1),
            kernels=attention_kernels(self.backend, self.device),
            num_decode=layout.decode,
        )

    def _forward(self, layout: Layout) -> None:
        """The layout's forward and logits, the logits written into the shared buffer."""
        n = layout.num_tokens
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv_cache, self._meta(layout))
        if layout.chunk:  # only the rows the step needs (see the docstring)
            hidden = hidden.index_select(0, self.logit_rows[: layout.num_logits])
        logits = self.model.compute_logits(hidden)  # (layout.num_logits, vocab); every row when pure decode
        self.logits[: logits.shape[0]].copy_(logits)

    @staticmethod
    def logits_bytes(max_bucket: int, vocab_size: int) -> int:
        """What the shared logits buffer of a DecodeGraphs with `max_bucket` takes."""
        return (max_bucket + 1) * vocab_size * 4

    # ---- capture ---------------------------------------------------------------------------------
    def prepare_common(self, block_size: int) -> list[str]:
        """Prepare (on CUDA: capture) every COMMON_LAYOUTS layout this DecodeGraphs can hold, each on a
        step of padding-like rows in the scratch block (no sequence owns it, so nothing real is read
        or written). Returns the layouts' names, in order. Call it at start-up, before any request."""
        done: list[str] = []
        for decode, chunk in COMMON_LAYOUTS:
            if decode > self.max_bucket or (decode and bucket_for(decode, self.max_bucket) != decode):
                continue
            layout = Layout(decode, chunk)
            if layout in self._graphs or -(-max(chunk, 1) // block_size) > self.max_blocks_per_seq:
                continue
            step = _scratch_step(layout, self.scratch_block, block_size)
            self._fill(step, block_size, layout)
            self._prepare(layout)
            done.append(layout.name)
        return done

    def _prepare(self, layout: Layout) -> _Graph:
        """Capture the layout's graph (CUDA), or mark it eager. The buffers hold a valid step (the
        current one) when this runs, so the warm-up and the capture compute real values."""
        graph = _Graph(None)
        if self.capture and self.device.type == "cuda":
            try:
                graph = self._capture(layout)
            except Exception as e:  # capture is an optimisation: never fail the step for it (Triton's
                # errors are no RuntimeError; a forward that fails outright fails again, eagerly)
                self.capture_errors[layout.name] = f"{type(e).__name__}: {e}"
        self._graphs[layout] = graph
        return graph

    def _capture(self, layout: Layout) -> _Graph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(layout)  # warm-up: Triton kernels compiled, allocator primed
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(layout)  # its intermediates, the logits before the copy included, stay in the pool
        self._pool = graph.pool()
        return _Graph(graph)


def _scratch_step(layout: Layout, scratch_block: int, block_size: int) -> StepInputs:
    """A step of `layout`'s shape whose every sequence lives in the scratch block: one-token rows at
    position 0, and a chunk at positions 0 .. chunk - 1 over the scratch block repeated."""
    decode, chunk = layout.decode, layout.chunk
    tables: list[Sequence[int]] = [[scratch_block]] * decode
    ids, positions, lens, queries = [0] * decode, [0] * decode, [1] * decode, [1] * decode
    if chunk:
        tables.append([scratch_block] * -(-chunk // block_size))
        ids += [0] * chunk
        positions += list(range(chunk))
        lens.append(chunk)
        queries.append(chunk)
    num_seqs = len(lens)
    rows = list(range(decode)) + ([decode + chunk - 1] if chunk else [])
    return StepInputs([], ids, positions, tables, lens, queries, [1] * num_seqs, rows, [], decode)


def _slots(
    block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], query_lens: Sequence[int], block_size: int
) -> list[int]:
    """The cache slot of every fed token: sequence i's last query_lens[i] positions, in order."""
    out: list[int] = []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens, strict=True):
        out += [
            int(table[p // block_size]) * block_size + p % block_size
            for p in range(seq_len - query_len, seq_len)
        ]
    return out
