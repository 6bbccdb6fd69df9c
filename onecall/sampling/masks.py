"""Stage 3 of the sampler: constraint masks (grammars) and banned ids set to -inf, in place.

Rows with a constraint fill one shared bitmask (sampling/bitmask.py); bans join as extra rows; one
pass applies them to the touched rows only, so a batch without constraints or bans pays nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onecall.sampling.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask
from onecall.sampling.types import SamplingRequest


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
