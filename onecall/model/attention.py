"""Attention over the paged KV cache, one call per layer for a whole mixed batch.

The step's metadata (model/attention_metadata.py: rows per sequence, where each sequence's KV
lives, slots to write) is built once per step and read here by every layer.

Backends (one switch, `AttentionMetadata.backend`), all computing the same thing:

    | backend     | reads a sequence's KV                             | per layer            |
    |-------------|---------------------------------------------------|----------------------|
    | "reference" | gathers its slots one by one (index_select)       | one SDPA per seq     |
    | "paged"     | in place: a strided view of the cache when its    | one SDPA per seq     |
    |             | blocks are one run (the allocator keeps them so),  |                      |
    |             | else a gather of whole blocks; with the native    | (native: one kernel  |
    |             | kernels, through kv_start / the blocks in C       | per prefill seq)     |
    | "triton"    | in place, through the block table, in the kernel  | one kernel per batch |

"reference" is the oracle the tests hold the others against. "paged" is the CPU default: on
a CPU, SDPA over a view of the cache reads each KV byte once (measured against the other
choices in docs/benchmarks.md). Where the native kernels load (the step's AttentionKernels,
kernels/cpu/ops.py: kernels/select.py picks them with the backend), "paged" runs decode rows through the paged decode kernel and each prefill chunk through the native causal
prefill kernel (csrc/prefill_attention.c: tiled, online softmax, GQA and the window options in the
kernel; measured faster than SDPA's flash kernel in the README's kernel table); SDPA stays the path
for what the kernels do not take (other dtypes, head sizes) and the reference they are tested
against. "triton" (kernels/cuda/triton_attention.py) is the CUDA path; its numerics run on CPU under
TRITON_INTERPRET=1 in the tests.

Per-layer options, on every backend: a sliding window (Mistral, Gemma's local layers, gpt-oss's
sliding layers), logit soft-capping (Gemma 2) and attention sinks (gpt-oss); see paged_attention. On
"paged"/"reference" a sequence they change runs through `_attend_windowed` (its keys cut to the
window, an explicit band mask) unless the native prefill kernel takes it (it applies all three per
row); decode rows take the native kernel's own window, cap and sinks; Triton masks by position, skips
tiles before the window and folds the sink in after the last tile.

Sinks and SDPA: SDPA has no sinks, so a layer with sinks never runs it. `_attend_windowed` computes
such a layer's softmax itself, as transformers' eager gpt-oss attention does: scores (float32),
the mask, the head's sink appended as one more logit column, softmax, the sink's column dropped
(its value is zero). Queries go in row chunks so the score tensor stays under _SCORE_BUDGET floats.
The kernels fold the same sink in after their online softmax (kernels/ops.py gives the formula);
tests/model/test_gpt_oss.py holds every path against this one.

Batch invariance: on "paged" and "reference" a sequence's attention is computed by a call that
sees only that sequence (its own query rows, its own KV, its own mask), so its result does not
depend on what else shares the step. The native prefill kernel goes further: a row's bits depend
only on its query, position and KV, so a prompt chunked at any boundary gives the same bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from onecall.kernels.ops import TORCH_ATTENTION, AttentionKernels
from onecall.model.attention_metadata import AttentionMetadata, SeqSpan
from onecall.model.kv_cache import PagedKVCache


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: PagedKVCache,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k_new/v_new into the cache, then attend each sequence causally over its whole KV.

    q: (num_tokens, num_heads, head_dim); k_new, v_new: (num_tokens, num_kv_heads, head_dim), or both
    None when the caller has already stored them at meta.slot_mapping (LayerOps.rope_store).
    Returns (num_tokens, num_heads, head_dim). GQA: head h reads KV head h // (num_heads // num_kv_heads).

    Per-layer options (transformers' definitions): `sliding_window` W, a query at position t sees
    keys t - W + 1 .. t only (Mistral, Gemma's local layers); `logit_softcap` c, scores (after the
    scale) become c * tanh(score / c) before the mask and softmax (Gemma 2); `sinks` (num_heads,), one
    logit per query head that joins every softmax denominator of that head with no value: out =
    sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)) (gpt-oss; kept in float32 by its layers).
    """
    k_cache, v_cache = kv_cache.k[layer_idx], kv_cache.v[layer_idx]  # (num_slots, num_kv_heads, head_dim)
    return attend_cache_layer(
        q, k_new, v_new, k_cache, v_cache, meta, scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
    )  # fmt: skip


def attend_cache_layer(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention over one layer's cache tensors, given as contiguous (num_slots, num_kv_heads,
    head_dim) tensors: a layer whose heads are shaped unlike the pool's (Gemma 4, model/gemma4.py)
    passes its own view of a cache layer."""
    window = Window(sliding_window, logit_softcap, sinks)
    assert q.shape[0] == meta.num_tokens == meta.slot_mapping.shape[0], "batch does not match the metadata"
    if k_new is not None and v_new is not None:
        k_cache.index_copy_(0, meta.slot_mapping, k_new.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v_new.to(v_cache.dtype))
    kernels = meta.kernels
    o = kernels.whole_batch(q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, sinks)
    if o is not None:
        return o
    d = meta.decode
    o_dec = None
    if d is not None:
        q_dec = q[: len(d.seq_index)] if d.rows_are_prefix else q.index_select(0, d.rows)
        o_dec = kernels.decode(
            q_dec, k_cache, v_cache, d.block_tables, d.seq_lens, meta.block_size, scale,
            sliding_window, logit_softcap, sinks,
        )  # fmt: skip
    done: set[int] = set()
    out: torch.Tensor | None = None
    if d is not None and o_dec is not None:
        if len(d.seq_index) == len(meta.seqs):
            return o_dec
        out = torch.empty_like(q)
        if d.rows_are_prefix:
            out[: len(d.seq_index)] = o_dec
        else:
            out.index_copy_(0, d.rows, o_dec)
        done = set(d.seq_index)
    if not done and len(meta.seqs) == 1:  # the whole batch is one sequence: no scatter into `out`
        return _attend(q, k_cache, v_cache, meta.seqs[0], meta.block_size, scale, window, kernels)
    if out is None:
        out = torch.empty_like(q)
    for i, s in enumerate(meta.seqs):
        if i not in done:
            out[s.q_start : s.q_end] = _attend(
                q[s.q_start : s.q_end], k_cache, v_cache, s, meta.block_size, scale, window, kernels
            )
    return out


def _sequence_kv(cache: torch.Tensor, s: SeqSpan, block_size: int) -> torch.Tensor:
    """(seq_len, num_kv_heads, head_dim): the sequence's K or V, a view of the cache when it can be."""
    if s.kv_start >= 0:
        return cache[s.kv_start : s.kv_start + s.seq_len]
    if s.blocks is not None:
        by_block = cache.view(-1, block_size, *cache.shape[1:])  # (num_blocks, block_size, kv_heads, dim)
        return by_block.index_select(0, s.blocks).flatten(0, 1)[: s.seq_len]
    assert s.slots is not None, "metadata has no KV source for this sequence"
    return cache.index_select(0, s.slots)


@dataclass(frozen=True)
class Window:
    """A layer's departures from plain causal attention (paged_attention's keyword options)."""

    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)  # (num_heads,) float32

    def first_key(self, s: SeqSpan) -> int:
        """The first position any of the sequence's query rows sees (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, s.seq_len - s.query_len - self.sliding_window + 1)

    def applies_to(self, s: SeqSpan) -> bool:
        """Whether the sequence's attention differs from plain causal attention this step."""
        cuts = self.sliding_window is not None and s.seq_len > self.sliding_window
        return cuts or self.logit_softcap is not None or self.sinks is not None

    def mask(self, s: SeqSpan, first_key: int) -> torch.Tensor | None:
        """(query_len, seq_len - first_key) bool, True = attend; None when every key is visible (one
        query: first_key already cut its window). Query i is at position seq_len - query_len + i, key j
        at first_key + j. Every layer with the same window asks for the same mask within a step: it is
        built once (_band_mask keeps the last few) and only read."""
        if s.query_len == 1:
            return None
        return _band_mask(s.seq_len, s.query_len, first_key, self.sliding_window)


@functools.lru_cache(maxsize=8)
def _band_mask(seq_len: int, query_len: int, first_key: int, sliding_window: int | None) -> torch.Tensor:
    """Window.mask's tensor; callers never write to it (SDPA and masked_fill only read a mask)."""
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(first_key, seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: SeqSpan,
    block_size: int,
    scale: float,
    window: Window,
    kernels: AttentionKernels = TORCH_ATTENTION,
) -> torch.Tensor:
    """One sequence: q (query_len, num_heads, head_dim) over its KV -> (query_len, num_heads, head_dim).
    A chunk of more than one row runs on the step's prefill kernel where it takes the chunk (window
    options included, the cache read in place), else through SDPA here."""
    query_len, num_heads, head_dim = q.shape
    if kernels.reads_prefill_chunks and query_len > 1 and s.slots is None:
        o = kernels.prefill(
            q, k_cache, v_cache, s.seq_len, s.kv_start, s.blocks, block_size, scale,
            window.sliding_window, window.logit_softcap, window.sinks,
        )  # fmt: skip
        if o is not None:
            return o
    # (1, num_kv_heads, seq_len, head_dim); a cache stored in another dtype (kv_cache_dtype) is read
    # through a converted copy here: this is the prompt path, where compute outweighs the copy
    k = _sequence_kv(k_cache, s, block_size).to(q.dtype).transpose(0, 1)[None]
    v = _sequence_kv(v_cache, s, block_size).to(q.dtype).transpose(0, 1)[None]
    num_kv_heads = k.shape[1]
    if window.applies_to(s):
        first = window.first_key(s)
        k, v = k[:, :, first:], v[:, :, first:]  # keys before `first` are outside every row's window
        return _attend_windowed(q, k, v, window.mask(s, first), scale, window.logit_softcap, window.sinks)
    if query_len == 1:
        # GQA by folding: the `group` query heads that share a KV head become `group` queries of that
        # KV head, (1, num_kv_heads, group, head_dim). One query sees every key, so no mask changes and
        # no repeated K/V is built. Head h = kv_head * group + g, as in transformers' repeat_kv.
        o = F.scaled_dot_product_attention(q.view(1, num_kv_heads, -1, head_dim), k, v, scale=scale)
        return o.view(1, num_heads, head_dim)
    # 4-D inputs (a batch of one): CPU SDPA takes its flash kernel only for 4-D tensors; with 3-D
    # ones it falls back to the math path, 5x slower at a 1,024-token prefill.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, num_heads, query_len, head_dim)
        k,
        v,
        attn_mask=s.mask,
        is_causal=s.mask is None,  # query_len == seq_len here (the other case has a mask)
        scale=scale,
        enable_gqa=True,
    )[0]
    return o.transpose(0, 1)


# The most scores (floats) _attend_windowed's own softmax holds at once: 64 MiB of float32; a longer
# chunk runs in groups of query rows (each row's softmax is its own, so the split changes nothing).
_SCORE_BUDGET = 1 << 24


def _attend_windowed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (query_len, num_heads, head_dim) over k, v (1, num_kv_heads, num_keys, head_dim) with an
    explicit (query_len, num_keys) mask (None: every key visible). SDPA when only the mask differs;
    soft-capping changes the scores themselves and sinks the softmax's denominator, so either runs as
    plain matmuls and a float32 softmax (transformers' eager attention), GQA by repeating each KV head
    for its group, a sink as one more logit column of its head whose probability is dropped."""
    query_len, num_heads, head_dim = q.shape
    qh = q.transpose(0, 1)[None]  # (1, num_heads, query_len, head_dim)
    mask = None if mask is None else mask.to(q.device)
    if logit_softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0]
        return o.transpose(0, 1)
    group = num_heads // k.shape[1]
    k, v = k[0].repeat_interleave(group, dim=0), v[0].repeat_interleave(group, dim=0)
    num_keys = k.shape[1]
    sink_logits = None if sinks is None else sinks.float().view(num_heads, 1, 1)
    out = torch.empty_like(q)
    rows = max(1, _SCORE_BUDGET // (num_heads * (num_keys + 1)))
    for r0 in range(0, query_len, rows):
        r1 = min(r0 + rows, query_len)
        scores = torch.matmul(qh[0, :, r0:r1], k.transpose(1, 2)).float() * scale  # (heads, rows, keys)
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[r0:r1], float("-inf"))
        if sink_logits is None:
            probs = scores.softmax(dim=-1)
        else:  # [scores | sink] -> softmax -> drop the sink's column
            column = sink_logits.expand(num_heads, r1 - r0, 1)
            probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :num_keys]
        o = torch.matmul(probs.to(v.dtype), v)  # (num_heads, rows, head_dim)
        out[r0:r1] = o.transpose(0, 1)
    return out
