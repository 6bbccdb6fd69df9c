"""Logit edits that come before logprobs: penalties, logit_bias, constraint masks and bans.

Each stage touches only the rows that ask for it and is skipped entirely when no
row does, so a plain batch pays nothing here. Penalties are sparse: they gather
and scatter only the (row, token) pairs that occurred, never a (batch, vocab)
count table. All three edit `logits` in place; `sampler.sample` hands them its
own float32 copy, or, when the engine lends it the step's logits (inplace),
the rows they edit are the only ones written.

Penalties follow OpenAI/vLLM, applied in this order:
  1. repetition_penalty p over prompt + output tokens (HF/vLLM): a seen token's
     logit l becomes l / p if l > 0 else l * p.
  2. frequency f and presence r over output tokens only:
     l -= f * count + r * (count > 0).
A row is touched only by the penalties it sets, so its logits do not depend on
what else shares the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from onecall.sampling.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask

if TYPE_CHECKING:
    from onecall.sampling.sampler import SamplingRequest


def _token_counts(
    token_lists: Sequence[Sequence[int]], rows: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (batch row, token id) pairs of token_lists[j] (row rows[j]) and how often each occurs.

    Returns (row_idx, token_idx, counts), each (num_distinct,); sparse, so the
    cost follows the number of tokens, not batch * vocab.
    """
    flat = [tok for toks in token_lists for tok in toks]
    if not flat:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty, empty
    assert min(flat) >= 0 and max(flat) < vocab_size, "token id outside the vocabulary"
    lengths = torch.tensor([len(toks) for toks in token_lists], device=device)
    row_of_token = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)  # (num_tokens,)
    keys = row_of_token * vocab_size + torch.tensor(flat, dtype=torch.long, device=device)
    distinct, counts = torch.unique(keys, return_counts=True)
    return distinct // vocab_size, distinct % vocab_size, counts


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that use any of them."""
    device, vocab_size = logits.device, logits.shape[1]
    params = [r.params for r in requests]

    # 1. repetition over prompt + output (multiplicative, so the order within the step matters: first).
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = [list(requests[i].prompt_token_ids) + list(requests[i].output_token_ids) for i in rep_rows]
        row_idx, tok_idx, _ = _token_counts(seen, rep_rows, vocab_size, device)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)
        pen = penalty[row_idx]  # (num_distinct,)
        vals = logits[row_idx, tok_idx]
        logits[row_idx, tok_idx] = torch.where(vals > 0, vals / pen, vals * pen)

    # 2. frequency and presence over output tokens: l -= f * count + r * (count > 0).
    fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp_rows:
        outputs = [requests[i].output_token_ids for i in fp_rows]
        row_idx, tok_idx, counts = _token_counts(outputs, fp_rows, vocab_size, device)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)
        logits[row_idx, tok_idx] -= freq[row_idx] * counts + pres[row_idx]


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
    """Add each row's logit_bias {token id: bias}, in place."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, r in enumerate(requests):
        for tok, bias in (r.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if not rows:
        return
    # SamplingParams.validate_vocab has rejected out-of-range ids at admission.
    assert max(cols) < logits.shape[1], "logit_bias token id outside the vocabulary"
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)


@dataclass
class MaskResult:
    """Per row of the batch: what stage 3 masked, what a constraint allowed, and what it cost."""

    num_masked: list[int]  # ids set to -inf by a constraint or banned_token_ids
    num_allowed: list[int | None]  # ids a constraint left allowed; None = no constraint this step
    mask_time: list[float]  # seconds: this row's fill + the one shared unpack/apply (0 if none)

    @classmethod
    def none(cls, batch: int) -> MaskResult:
        return cls([0] * batch, [None] * batch, [0.0] * batch)


def apply_token_masks(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> MaskResult:
    """Set to -inf every id a row's constraint disallows or its banned_token_ids name, in place.

    1. one bitmask (sampling/bitmask.py) for the rows with a constraint; each
       constraint fills its own row, or declines (unconstrained this step);
    2. bans cleared in the unpacked rows; a constrained row the bans would
       empty keeps its constraint's mask alone (the grammar wins over
       min_tokens: a grammar that may only end must be allowed to end);
    3. one pass over the touched rows; every other row is never read.
    A row left with nothing allowed by its constraint alone, or by bans alone,
    is a bug (a constraint must always allow something, at least EOS) and
    trips an assert rather than sampling garbage.
    """
    batch, vocab_size = logits.shape
    result = MaskResult.none(batch)
    t_start = time.perf_counter()
    # 1. constraint rows fill one shared bitmask
    rows, fill_time, allowed = _fill_constraints(requests, vocab_size, logits.device)
    num_grammar_rows = len(rows)
    banned_rows = [i for i, r in enumerate(requests) if r.banned_token_ids]
    if not rows and not banned_rows:
        return result

    # 2. bans: ban-only rows join after the constraint rows
    if banned_rows:
        rows += [i for i in banned_rows if i not in fill_time]
        grammar_allowed = allowed
        allowed = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=logits.device)  # (rows, vocab)
        if grammar_allowed is not None:
            allowed[:num_grammar_rows] = grammar_allowed
        position = {i: k for k, i in enumerate(rows)}
        ban_pos = [position[i] for i in banned_rows for _ in requests[i].banned_token_ids]
        ban_ids = [t for i in banned_rows for t in requests[i].banned_token_ids]
        allowed[torch.tensor(ban_pos, device=logits.device), torch.tensor(ban_ids, device=logits.device)] = (
            False
        )
        if grammar_allowed is not None:
            emptied = (~allowed[:num_grammar_rows].any(dim=-1)).nonzero().flatten().tolist()
            allowed[emptied] = grammar_allowed[emptied]
    assert allowed is not None

    # 3. one pass over the touched rows
    num_masked = apply_bitmask(logits, rows, allowed)
    shared = time.perf_counter() - t_start - sum(fill_time.values())
    for k, i in enumerate(rows):
        assert num_masked[k] < vocab_size, (
            f"row {i}: constraint and bans leave no allowed token (constraint bug)"
        )
        result.num_masked[i] = num_masked[k]
        if i in fill_time:
            result.num_allowed[i] = vocab_size - num_masked[k]
            result.mask_time[i] = fill_time[i] + shared
    return result


def _fill_constraints(
    requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
) -> tuple[list[int], dict[int, float], torch.Tensor | None]:
    """(rows whose constraint applies this step, each one's fill seconds, their (rows, vocab) allowed mask).

    Allocates nothing when no row has a constraint. The bitmask is filled on the
    CPU (1 bit per id) and unpacked on the logits' device.
    """
    constrained = [i for i, r in enumerate(requests) if r.constraint is not None]
    if not constrained:
        return [], {}, None
    bitmask = allocate_bitmask(len(constrained), vocab_size)  # (num_constrained, words) int32, CPU
    active: list[int] = []
    fill_time: dict[int, float] = {}
    for j, i in enumerate(constrained):
        constraint = requests[i].constraint
        assert constraint is not None
        t0 = time.perf_counter()
        if constraint.fill_bitmask(bitmask, j):
            active.append(j)
            fill_time[i] = time.perf_counter() - t0
    if not active:
        return [], {}, None
    words = bitmask if len(active) == len(constrained) else bitmask[active]
    allowed = unpack_bitmask(words.to(device, non_blocking=True), vocab_size)
    return [constrained[j] for j in active], fill_time, allowed
