"""ModelRunner: a scheduled batch -> tensors -> model -> logits of the rows that sample.

The only engine module that touches tensors. A step has two halves:

  (a) pack(batch) -> StepInputs: plain ints and lists, nothing from the model folder, so under
      tensor parallel rank 0 can send them to the other ranks (engine/tp/messages.py):
        - the KV manager's pending copy-on-write slot copies,
        - every scheduled chunk flattened into one packed batch, decode rows first (input ids,
          positions, block tables, sequence and query lengths, run lengths),
        - the rows that sample, and the rows whose prompt logprobs are collected;
  (b) run(StepInputs) -> logits: the slot copies, the tensors and AttentionMetadata, one forward
      over the packed batch, then
        - for a sequence collecting prompt logprobs (engine/sequence.py), the raw logits at every
          fed position that predicts a prompt token it has no entry for yet, in slices of
          _PROMPT_LOGPROBS_ROWS rows, so a long chunk never holds (chunk, vocab) floats at once
          (rank 0 turns each slice into the chosen token's logprob and the likeliest alternatives),
        - the logits at the last fed position of each sequence that samples.

Every rank of a tensor-parallel group runs (b) on the same StepInputs, so each makes the same
collective calls in the same order (the all-reduces in the forward, one vocabulary gather per
compute_logits). With one process (tensor_parallel_size 1) execute() is (a) then (b) and nothing
is sent anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from onecall.engine.block_manager import BlockManager
from onecall.engine.decode_graphs import DecodeGraphs
from onecall.engine.scheduler import ScheduledSeq
from onecall.engine.state_slots import StateSlots
from onecall.engine.step_inputs import PromptLogitsFn, StepGroup, StepInputs
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache

_PROMPT_LOGPROBS_ROWS = 256  # positions per logits slice when collecting prompt logprobs


@dataclass
class PromptLogprobs:
    """One chunk's prompt logprobs for one sequence: entries for prompt tokens first_token, ..."""

    first_token: int  # the prompt index of the first entry (== len(seq.prompt_logprobs) when made)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # (num_sampling_seqs, vocab_size) float32, in batch order
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # batch index -> this chunk's


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv_cache: PagedKVCache,
        block_manager: BlockManager | None,
        device: torch.device,
        attention_backend: str = "paged",
        *,
        block_size: int | None = None,
        tp_group: StepGroup | None = None,
        state_slots: StateSlots | None = None,
    ) -> None:
        """`block_manager` is None on a tensor-parallel worker, which only run()s (then `block_size`
        is given); `tp_group` on rank 0 of a tensor-parallel group sends each step to the workers;
        `state_slots`: a hybrid model's (engine/state_slots.py), which pack() reads."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        size = block_manager.block_size if block_manager is not None else block_size
        assert size is not None, "a worker's runner needs the block size"
        self.block_size: int = size
        self.device = device
        self.attention_backend = (
            attention_backend  # model/attention_metadata.py: "paged", "triton" or "reference"
        )
        self.decode_graphs: DecodeGraphs | None = None  # static-shape decode steps (CUDA graphs)
        self.tp_group = tp_group
        self.state_slots = state_slots

    @torch.inference_mode()
    def execute(self, batch: Seq[ScheduledSeq]) -> RunnerOutput:
        """Run one step: the sampling rows' logits, and the prompt logprobs this step collects."""
        step, prompt_seqs = self.pack(batch)
        if not step.prompt_rows:
            logits = self.run_static(step)
            if logits is not None:
                return RunnerOutput(logits)
        prompt_lps = {i: PromptLogprobs(first_token=position + 1) for i, position, _ in prompt_seqs}

        def collect(k: int, lo: int, logits: torch.Tensor) -> None:
            i, position, num_top = prompt_seqs[k]
            _add_prompt_logprobs(prompt_lps[i], logits, batch[i].seq.token_ids, position + lo, num_top)

        if self.tp_group is None:
            logits = self.run(step, collect if prompt_seqs else None)
        else:
            logits = self.tp_group.run_step(self, step, collect if prompt_seqs else None)
        return RunnerOutput(logits, prompt_lps)

    @torch.inference_mode()
    def run_static(self, step: StepInputs) -> torch.Tensor | None:
        """(b) on the static buffers (engine/decode_graphs.py; on CUDA a replayed graph), when they
        are set up and the step fits them: one-token sequences and at most one short prompt chunk,
        which pack() puts last. The sampling rows' logits, as run() returns them, or None (then
        nothing ran). Prompt logprobs are not collected here: execute() sends such steps to run()."""
        if self.decode_graphs is None:
            return None
        logits = self.decode_graphs.run(step, self.block_size)  # (num_seqs, vocab): last tokens
        if logits is None:
            return None
        seq_of_row: dict[int, int] = {}  # packed row of a sequence's last token -> the sequence
        row = -1
        for k, query_len in enumerate(step.query_lens):
            row += query_len
            seq_of_row[row] = k
        pick = [seq_of_row[r] for r in step.sample_rows]
        if pick == list(range(len(step.query_lens))):
            return logits  # every sequence samples, in packed order (always so in pure decode)
        return logits.index_select(0, torch.tensor(pick, dtype=torch.long, device=logits.device))

    def pack(self, batch: Seq[ScheduledSeq]) -> tuple[StepInputs, list[tuple[int, int, int]]]:
        """(a) The step's StepInputs, and per StepInputs.prompt_rows entry what only rank 0 needs:
        (batch index, first position, params.prompt_logprobs)."""
        assert self.block_manager is not None, "only rank 0 packs steps"
        bm = self.block_manager
        # decode rows first: the fast kernels run a request's decode tokens and its prompt tokens on
        # fixed kernels whatever else is in the batch (AttentionMetadata.num_decode)
        order = sorted(range(len(batch)), key=lambda i: batch[i].seq.is_prefilling)  # stable
        num_decode = sum(not batch[i].seq.is_prefilling for i in order)
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables: list[Seq[int]] = []
        run_lengths: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        last_row: dict[int, int] = {}  # batch index -> its last row in the packed batch
        prompt_rows: list[tuple[int, int]] = []
        prompt_seqs: list[tuple[int, int, int]] = []
        for i in order:
            item = batch[i]
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            if seq.needs_prompt_logprobs:
                # position p predicts token p + 1: the positions fed now that predict a prompt token
                # still without an entry (the scheduler kept start <= k - 1, so no gap is left)
                first = max(start, len(seq.prompt_logprobs) - 1)
                end = min(start + n, seq.num_prompt_tokens - 1)
                assert start <= len(seq.prompt_logprobs) - 1, "prompt logprobs would skip a position"
                if end > first:
                    prompt_rows.append((len(input_ids) + first - start, end - first))
                    prompt_seqs.append((i, first, seq.params.prompt_logprobs or 0))
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            block_tables.append(bm.block_table_view(seq.seq_id))  # no copy: read-only here
            run_lengths.append(bm.first_run_length(seq.seq_id))
            seq_lens.append(start + n)
            query_lens.append(n)
            last_row[i] = len(input_ids) - 1
        sample_rows = [last_row[i] for i, item in enumerate(batch) if item.samples]
        step = StepInputs(
            bm.take_copy_ops(),
            input_ids,
            positions,
            block_tables,
            seq_lens,
            query_lens,
            run_lengths,
            sample_rows,
            prompt_rows,
            num_decode,
        )
        if self.state_slots is not None:
            step.state_slots = [self.state_slots.slot(batch[i].seq.seq_id) for i in order]
            step.state_copies = self.state_slots.take_copies()
            step.state_snapshots = [
                (k, *snap) for k, i in enumerate(order) if (snap := batch[i].snapshot) is not None
            ]
        return step, prompt_seqs

    @torch.inference_mode()
    def run(self, step: StepInputs, on_prompt_logits: PromptLogitsFn | None = None) -> torch.Tensor:
        """(b) The forward and the logits of one packed step: (num_sample_rows, vocab_size) float32.
        Every prompt-logprob slice goes through compute_logits (and to `on_prompt_logits`, when given)
        before the sampling rows do: the same calls, in the same order, on every rank."""
        # 1. copy-on-write of partially matched prefix blocks
        if step.copies:
            self.kv_cache.copy_slots([s for s, _ in step.copies], [d for _, d in step.copies])
        if step.state_copies:  # a hybrid model's snapshots, taken and resumed, in the order queued
            assert self.kv_cache.state is not None
            for src, dst in step.state_copies:
                self.kv_cache.state.copy([src], [dst])
        # 2. tensors and attention metadata
        meta = build_attention_metadata(
            step.block_tables,
            step.seq_lens,
            step.query_lens,
            self.block_size,
            self.device,
            backend=self.attention_backend,
            run_lengths=step.run_lengths,
            num_decode=step.num_decode,
            state_slots=step.state_slots or None,
            state_snapshots=step.state_snapshots or None,
        )
        ids_t = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        # 3. one forward over the packed batch
        hidden = self.model(ids_t, pos_t, self.kv_cache, meta)  # (num_tokens, hidden_size)
        # 4. prompt logprobs' logits, slice by slice
        for k, (row, count) in enumerate(step.prompt_rows):
            for lo in range(0, count, _PROMPT_LOGPROBS_ROWS):
                hi = min(count, lo + _PROMPT_LOGPROBS_ROWS)
                logits = self.model.compute_logits(hidden[row + lo : row + hi])  # (hi - lo, vocab_size)
                if on_prompt_logits is not None:
                    on_prompt_logits(k, lo, logits)
        # 5. logits only where a token is sampled
        sample_rows = step.sample_rows
        if not sample_rows:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        if sample_rows == list(range(len(sample_rows))) and len(sample_rows) == hidden.shape[0]:
            return self.model.compute_logits(hidden)  # every row samples (pure decode): no gather
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))


def _add_prompt_logprobs(
    out: PromptLogprobs, logits: torch.Tensor, token_ids: list[int], position: int, num_top: int
) -> None:
    """logits (n, vocab_size) at positions position .. position + n - 1; each predicts the next prompt
    token, token_ids[p + 1] (a chunk's last row predicts a token the next chunk feeds: it comes from
    the sequence, not from this batch)."""
    n = logits.shape[0]
    logprobs = torch.log_softmax(logits, dim=-1)  # (n, vocab_size) float32
    targets = torch.tensor(token_ids[position + 1 : position + n + 1], dtype=torch.long, device=logits.device)
    out.logprobs += logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    if num_top:
        top_v, top_i = logprobs.topk(num_top, dim=-1)  # (n, num_top), descending
        out.top_logprobs += [
            list(zip(ids, vals, strict=True))
            for ids, vals in zip(top_i.tolist(), top_v.tolist(), strict=True)
        ]
    else:
        out.top_logprobs += [[] for _ in range(n)]
