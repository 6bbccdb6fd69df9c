"""ModelRunner: a scheduled batch -> tensors -> model -> logits of the rows that sample.

The only engine module that touches tensors. Per step it
  1. applies the KV manager's pending copy-on-write slot copies,
  2. flattens every scheduled chunk into one packed batch, decode rows first (input ids,
     positions, block tables, sequence and query lengths -> AttentionMetadata),
  3. runs the model once, and
  4. returns the logits at the last fed position of each sequence that samples, and
  5. for a sequence collecting prompt logprobs (engine/sequence.py), the log-softmax of the
     raw logits at every fed position that predicts a prompt token it has no entry for yet:
     the chosen prompt token's logprob and its params.prompt_logprobs likeliest alternatives.
     Chunked prefill collects chunk by chunk; rows go through the logits projection in slices
     of _PROMPT_LOGPROBS_ROWS, so a long chunk never holds (chunk, vocab) floats at once.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from onecall.engine.block_manager import BlockManager
from onecall.engine.decode_graphs import DecodeGraphs
from onecall.engine.scheduler import ScheduledSeq
from onecall.model.attention import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.fast_linear import decode_rows
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
        block_manager: BlockManager,
        device: torch.device,
        attention_backend: str = "paged",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = device
        self.attention_backend = attention_backend  # model/attention.py: "paged", "triton" or "reference"
        self.decode_graphs: DecodeGraphs | None = None  # static-shape decode steps (CUDA graphs)

    @torch.inference_mode()
    def execute(self, batch: Seq[ScheduledSeq]) -> RunnerOutput:
        """Run one step: the sampling rows' logits, and the prompt logprobs this step collects."""
        # 1. copy-on-write of partially matched prefix blocks
        copies = self.block_manager.take_copy_ops()
        if copies:
            self.kv_cache.copy_slots([s for s, _ in copies], [d for _, d in copies])

        # 2. pack the chunks, decode rows first: the fast kernels run a request's decode tokens and its
        #    prompt tokens on fixed kernels whatever else is in the batch (fast_linear.decode_rows)
        order = sorted(range(len(batch)), key=lambda i: batch[i].seq.is_prefilling)  # stable
        num_decode = sum(not batch[i].seq.is_prefilling for i in order)
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables: list[Seq[int]] = []
        run_lengths: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        last_row: dict[int, int] = {}  # batch index -> its last row in the packed batch
        prompt_rows: dict[int, tuple[int, int, int]] = {}  # batch index -> (first row, first position, count)
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
                    prompt_rows[i] = (len(input_ids) + first - start, first, end - first)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            block_tables.append(self.block_manager.block_table_view(seq.seq_id))  # no copy: read-only here
            run_lengths.append(self.block_manager.first_run_length(seq.seq_id))
            seq_lens.append(start + n)
            query_lens.append(n)
            last_row[i] = len(input_ids) - 1
        sample_rows = [last_row[i] for i, item in enumerate(batch) if item.samples]
        if (
            self.decode_graphs is not None
            and num_decode == len(batch)
            and len(sample_rows) == len(batch)
            and not prompt_rows
        ):
            # every sequence decodes one token: the static buffers (and on CUDA a replayed graph)
            with decode_rows(num_decode):
                logits = self.decode_graphs.run(
                    input_ids, positions, block_tables, seq_lens, self.block_manager.block_size
                )
            if logits is not None:
                return RunnerOutput(logits)  # rows are in batch order: decode rows first changed nothing
        meta = build_attention_metadata(
            block_tables,
            seq_lens,
            query_lens,
            self.block_manager.block_size,
            self.device,
            backend=self.attention_backend,
            run_lengths=run_lengths,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)

        # 3. one forward over the packed batch; 4. logits only where a token is sampled
        with decode_rows(num_decode):
            hidden = self.model(ids_t, pos_t, self.kv_cache, meta)  # (num_tokens, hidden_size)
        prompt_lps = {
            i: self._prompt_logprobs(
                hidden, batch[i].seq.token_ids, batch[i].seq.params.prompt_logprobs or 0, *rows
            )
            for i, rows in prompt_rows.items()
        }
        if not sample_rows:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        elif sample_rows == list(range(len(sample_rows))) and len(sample_rows) == hidden.shape[0]:
            logits = self.model.compute_logits(hidden)  # every row samples (pure decode): no gather
        else:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return RunnerOutput(logits, prompt_lps)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, token_ids: list[int], num_top: int, row: int, position: int, count: int
    ) -> PromptLogprobs:
        """Packed rows row .. row + count - 1 hold positions position .. position + count - 1; each
        predicts the next prompt token, token_ids[p + 1] (the chunk's last row predicts a token the
        next chunk feeds: it comes from the sequence, not from this batch)."""
        out = PromptLogprobs(first_token=position + 1)
        for lo in range(0, count, _PROMPT_LOGPROBS_ROWS):
            hi = min(count, lo + _PROMPT_LOGPROBS_ROWS)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[row + lo : row + hi]), dim=-1)
            # (hi - lo, vocab_size) float32
            next_ids = token_ids[position + lo + 1 : position + hi + 1]
            targets = torch.tensor(next_ids, dtype=torch.long, device=self.device)
            out.logprobs += logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if num_top:
                top_v, top_i = logprobs.topk(num_top, dim=-1)  # (hi - lo, num_top), descending
                out.top_logprobs += [
                    list(zip(ids, vals, strict=True))
                    for ids, vals in zip(top_i.tolist(), top_v.tolist(), strict=True)
                ]
            else:
                out.top_logprobs += [[] for _ in range(hi - lo)]
        return out
