"""Attention over the paged KV cache, with the per-step metadata it needs.

A step's batch is flat: sequence i contributes query_lens[i] consecutive tokens
whose positions are seq_lens[i] - query_lens[i] ... seq_lens[i] - 1 (seq_lens is
the KV length after this step: cached prefix + new tokens). Everything that
depends only on the step (slots to write, slots to read, masks) is built once in
`build_attention_metadata`, then reused by every layer.

Two paths compute the same thing:
- the reference loop, one sequence at a time: gather its KV slots, SDPA with a
  causal mask shifted by the cached length (obviously correct; used for prefill);
- batched decode: every sequence with query_len == 1 in one padded SDPA with a
  key-padding mask. `batched_decode=False` turns it off, so tests can hold the
  fast path against the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onecall.model.kv_cache import PagedKVCache


@dataclass
class DecodeBatch:
    """The query_len == 1 sequences of a step, padded to one (num_decodes, max_len) grid."""

    seq_ids: list[int]  # which sequences of the step (indices into query_lens)
    token_idx: torch.Tensor  # (num_decodes,) int64: their token's row in the flat batch
    slots: torch.Tensor  # (num_decodes * max_len,) int64 KV slots, row-major; padding points at slot 0
    max_len: int
    mask: torch.Tensor | None  # (num_decodes, 1, 1, max_len) bool, True = attend; None if no padding
    covers_all: bool  # the decodes are the whole batch, in order (no scatter needed)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot where each new token's K/V goes
    query_lens: list[int]
    seq_lens: list[int]
    query_starts: list[int]  # (num_seqs + 1): sequence i's tokens are rows query_starts[i]:query_starts[i+1]
    loop_seq_ids: list[int]  # sequences taken by the reference loop
    kv_slots: dict[int, torch.Tensor]  # loop sequence -> (seq_len,) int64 slots of its whole KV
    # loop sequence -> (query_len, seq_len) bool, True = attend. None when there is one query (it sees
    # everything) or no cached prefix (then SDPA's own is_causal applies: query_len == seq_len).
    causal_masks: dict[int, torch.Tensor | None]
    decode: DecodeBatch | None  # batched-decode sequences, or None

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


def _seq_slots(block_table: Sequence[int], seq_len: int, block_size: int) -> torch.Tensor:
    """(seq_len,) int64 slots of positions 0..seq_len-1, on CPU."""
    num_blocks = -(-seq_len // block_size)
    assert len(block_table) >= num_blocks, f"block table has {len(block_table)} blocks, needs {num_blocks}"
    blocks = torch.tensor(block_table[:num_blocks], dtype=torch.int64)
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:seq_len]


def _causal_mask(query_len: int, seq_len: int) -> torch.Tensor:
    """(query_len, seq_len) bool: query i (position seq_len - query_len + i) sees keys 0..its position."""
    cached = seq_len - query_len
    return torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=cached)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str,
    batched_decode: bool = True,
) -> AttentionMetadata:
    """Build a step's metadata. block_tables[i][j] = physical block of positions j*block_size... of seq i."""
    assert len(block_tables) == len(seq_lens) == len(query_lens), (
        "one block table, seq_len, query_len per seq"
    )
    # 1. Slots of every sequence's whole KV; the new tokens' slots are its tail.
    all_slots = [_seq_slots(bt, s, block_size) for bt, s in zip(block_tables, seq_lens, strict=True)]
    for q, s in zip(query_lens, seq_lens, strict=True):
        assert 1 <= q <= s, f"query_len {q} must be in [1, seq_len {s}]"
    slot_mapping = torch.cat(
        [slots[s - q :] for slots, s, q in zip(all_slots, seq_lens, query_lens, strict=True)]
    )
    query_starts = [0]
    for q in query_lens:
        query_starts.append(query_starts[-1] + q)

    # 2. Split: query_len == 1 sequences go to the batched decode path (if on), the rest to the loop.
    decode_ids = [i for i, q in enumerate(query_lens) if q == 1] if batched_decode else []
    decode_set = set(decode_ids)
    loop_ids = [i for i in range(len(query_lens)) if i not in decode_set]
    decode = (
        _build_decode_batch(decode_ids, all_slots, seq_lens, query_starts, device) if decode_ids else None
    )

    # 3. The loop's per-sequence gather indices and causal masks.
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        query_starts=query_starts,
        loop_seq_ids=loop_ids,
        kv_slots={i: all_slots[i].to(device) for i in loop_ids},
        causal_masks={
            i: _causal_mask(query_lens[i], seq_lens[i]).to(device)
            if 1 < query_lens[i] < seq_lens[i]
            else None
            for i in loop_ids
        },
        decode=decode,
    )


def _build_decode_batch(
    seq_ids: list[int],
    all_slots: list[torch.Tensor],
    seq_lens: Sequence[int],
    query_starts: list[int],
    device: torch.device | str,
) -> DecodeBatch:
    lens = [seq_lens[i] for i in seq_ids]
    max_len = max(lens)
    slots = torch.zeros(len(seq_ids), max_len, dtype=torch.int64)  # padding -> slot 0, masked out
    for row, i in enumerate(seq_ids):
        slots[row, : lens[row]] = all_slots[i]
    mask = None
    if min(lens) != max_len:
        lens_t = torch.tensor(lens, dtype=torch.int64)
        mask = (torch.arange(max_len)[None, :] < lens_t[:, None])[:, None, None, :]
    token_idx = [query_starts[i] for i in seq_ids]
    return DecodeBatch(
        seq_ids=seq_ids,
        token_idx=torch.tensor(token_idx, dtype=torch.int64, device=device),
        slots=slots.reshape(-1).to(device),
        max_len=max_len,
        mask=None if mask is None else mask.to(device),
        covers_all=token_idx == list(range(query_starts[-1])),
    )


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv: PagedKVCache,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k_new/v_new into the cache, then attend each sequence causally over its whole KV.

    q: (num_tokens, num_heads, head_dim); k_new, v_new: (num_tokens, num_kv_heads, head_dim).
    Returns (num_tokens, num_heads, head_dim). GQA: head h reads KV head h // (num_heads // num_kv_heads).
    """
    assert q.shape[0] == meta.num_tokens == meta.slot_mapping.shape[0], "batch does not match the metadata"
    k_cache, v_cache = kv.k[layer_idx], kv.v[layer_idx]  # (num_slots, num_kv_heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)

    d = meta.decode
    if d is not None and d.covers_all:
        return _decode_attention(q, k_cache, v_cache, d, scale)
    out = torch.empty_like(q)
    if d is not None:
        out.index_copy_(
            0, d.token_idx, _decode_attention(q.index_select(0, d.token_idx), k_cache, v_cache, d, scale)
        )
    for i in meta.loop_seq_ids:
        start, end = meta.query_starts[i], meta.query_starts[i + 1]
        slots = meta.kv_slots[i]
        k = k_cache.index_select(0, slots).transpose(0, 1)  # (num_kv_heads, seq_len, head_dim)
        v = v_cache.index_select(0, slots).transpose(0, 1)
        # 4-D inputs (a batch of one): CPU SDPA takes its flash kernel only for 4-D tensors; with
        # 3-D ones it falls back to the math path, 5x slower at a 1,024-token prefill.
        o = F.scaled_dot_product_attention(
            q[None, start:end].transpose(1, 2),  # (1, num_heads, query_len, head_dim)
            k[None],
            v[None],
            attn_mask=meta.causal_masks[i],
            is_causal=1 < end - start == meta.seq_lens[i],
            scale=scale,
            enable_gqa=True,
        )[0]
        out[start:end] = o.transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: DecodeBatch, scale: float
) -> torch.Tensor:
    """One query per sequence, all sequences in one padded SDPA. q: (num_decodes, num_heads, head_dim).

    GQA by folding: the `group` query heads that share a KV head become `group` queries of that KV
    head, (num_decodes, num_kv_heads, group, head_dim). With one query per sequence they all see the
    same keys, so no mask changes, and no repeated K/V is built (CPU SDPA is 2-3x faster so).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    grid = (num_seqs, d.max_len, num_kv_heads, head_dim)
    # (num_decodes, num_kv_heads, max_len, head_dim)
    k = k_cache.index_select(0, d.slots).view(grid).transpose(1, 2)
    v = v_cache.index_select(0, d.slots).view(grid).transpose(1, 2)
    # Head h = kv_head * group + g, as in transformers' repeat_kv.
    q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
