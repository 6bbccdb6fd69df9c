"""ModelRunner: a scheduled batch -> tensors -> model -> logits of the rows that sample.

The only engine module that touches tensors. Per step it
  1. applies the KV manager's pending copy-on-write slot copies,
  2. flattens every scheduled chunk into one packed batch, decode rows first (input ids,
     positions, block tables, sequence and query lengths -> AttentionMetadata),
  3. runs the model once, and
  4. returns the logits at the last fed position of each sequence that samples.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from onecall.engine.block_manager import BlockManager
from onecall.engine.decode_graphs import DecodeGraphs
from onecall.engine.scheduler import ScheduledSeq
from onecall.model.attention import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.fast_linear import decode_rows
from onecall.model.kv_cache import PagedKVCache


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
    def execute(self, batch: Seq[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns (num_sampling_seqs, vocab_size) float32 logits, in batch order."""
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
        for i in order:
            item = batch[i]
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            block_tables.append(self.block_manager.block_table_view(seq.seq_id))  # no copy: read-only here
            run_lengths.append(self.block_manager.first_run_length(seq.seq_id))
            seq_lens.append(start + n)
            query_lens.append(n)
            last_row[i] = len(input_ids) - 1
        sample_rows = [last_row[i] for i, item in enumerate(batch) if item.samples]
        if self.decode_graphs is not None and num_decode == len(batch) and len(sample_rows) == len(batch):
            # every sequence decodes one token: the static buffers (and on CUDA a replayed graph)
            with decode_rows(num_decode):
                logits = self.decode_graphs.run(
                    input_ids, positions, block_tables, seq_lens, self.block_manager.block_size
                )
            if logits is not None:
                return logits  # rows are in batch order: decode rows first changed nothing here
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
        if not sample_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        if sample_rows == list(range(len(sample_rows))) and len(sample_rows) == hidden.shape[0]:
            return self.model.compute_logits(hidden)  # every row samples (pure decode): no gather
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
