"""Logit edits that come before logprobs: penalties and logit_bias (masks and bans: masks.py).

Each stage touches only the rows that ask for it and is skipped entirely when no
row does, so a plain batch pays nothing here. Penalties are sparse: they gather
and scatter only the (row, token) pairs that occurred, never a (batch, vocab)
count table. Both edit `logits` in place; `sampler.sample` hands them its
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

from collections.abc import Sequence

import torch

from onecall.sampling.types import SamplingRequest


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
