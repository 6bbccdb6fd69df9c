"""Stage 3 of the sampler: constraint masks (grammars) and banned ids set to -inf, in place.

Rows with a constraint fill one shared bitmask (sampling/bitmask.py); bans join as extra rows; one
pass applies them to the touched rows only, so a batch without constraints or bans pays nothing.
A row that cannot be sampled (its grammar raised, or nothing is left allowed) fails alone: it is
reported in MaskResult.failed and the engine ends that request; the rest of the batch never notices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from onecall.errors import InvalidParameterError, RequestFaultError
from onecall.sampling.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask
from onecall.sampling.types import SamplingRequest


@dataclass
class MaskResult:
    """Per row of the batch: what stage 3 masked, what a constraint allowed, and what it cost."""

    num_masked: list[int]  # ids set to -inf by a constraint or banned_token_ids
    num_allowed: list[int | None]  # ids a constraint left allowed; None = no constraint this step
    mask_time: list[float]  # seconds: this row's fill + the one shared unpack/apply (0 if none)
    failed: dict[int, RequestFaultError] = field(default_factory=dict)  # row -> why it has no token

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
    A row whose constraint raised, or that is left with nothing allowed (by its
    constraint alone, or by bans alone), is its request's own fault, not the
    batch's: it goes into `failed` (a RequestFaultError naming the cause), its
    row is zeroed (the later stages stay finite; its token is never used) and
    the engine ends that request alone.
    """
    batch, vocab_size = logits.shape
    result = MaskResult.none(batch)
    t_start = time.perf_counter()
    # 1. constraint rows fill one shared bitmask (a fill that raises fails its own row only)
    rows, fill_time, allowed, failed = _fill_constraints(requests, vocab_size, logits.device)
    result.failed.update(failed)
    num_grammar_rows = len(rows)
    banned_rows = [i for i, r in enumerate(requests) if r.banned_token_ids and i not in failed]
    if not rows and not banned_rows:
        _neutralize(logits, result.failed)
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
        result.num_masked[i] = num_masked[k]
        if i in fill_time:
            result.num_allowed[i] = vocab_size - num_masked[k]
            result.mask_time[i] = fill_time[i] + shared
        if num_masked[k] == vocab_size:
            result.failed[i] = _nothing_allowed(requests[i], has_constraint=i in fill_time)
    _neutralize(logits, result.failed)
    return result


def _nothing_allowed(r: SamplingRequest, *, has_constraint: bool) -> RequestFaultError:
    """Why a row has no token left: its grammar allows none (bans never empty a grammar's row, step
    2), or min_tokens holds back EOS and stop_token_ids that make up the whole vocabulary."""
    if has_constraint:
        param, why = "structured_outputs", "the grammar allows no token here"
    else:
        param = "min_tokens"
        why = (
            f"min_tokens ({r.params.min_tokens}) holds back EOS and the stop_token_ids, "
            "and together they are every token of the vocabulary"
        )
    cause = InvalidParameterError(param, f"{why} (at output token {len(r.output_token_ids)})")
    return RequestFaultError("sampler", cause, param)


def _neutralize(logits: torch.Tensor, failed: dict[int, RequestFaultError]) -> None:
    """Zero the failed rows: their token is never used, and zeros keep log_softmax and the draw finite."""
    if failed:
        logits[torch.tensor(sorted(failed), device=logits.device)] = 0.0


def _fill_constraints(
    requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
) -> tuple[list[int], dict[int, float], torch.Tensor | None, dict[int, RequestFaultError]]:
    """(rows whose constraint applies this step, each one's fill seconds, their (rows, vocab) allowed
    mask, the rows whose fill raised).

    Allocates nothing when no row has a constraint. The bitmask is filled on the
    CPU (1 bit per id) and unpacked on the logits' device.
    """
    constrained = [i for i, r in enumerate(requests) if r.constraint is not None]
    failed: dict[int, RequestFaultError] = {}
    if not constrained:
        return [], {}, None, failed
    bitmask = allocate_bitmask(len(constrained), vocab_size)  # (num_constrained, words) int32, CPU
    active: list[int] = []
    fill_time: dict[int, float] = {}
    for j, i in enumerate(constrained):
        constraint = requests[i].constraint
        assert constraint is not None
        t0 = time.perf_counter()
        try:
            applies = constraint.fill_bitmask(bitmask, j)
        except Exception as e:  # this request's grammar: it fails alone
            failed[i] = RequestFaultError("grammar", e, "structured_outputs")
            continue
        if applies:
            active.append(j)
            fill_time[i] = time.perf_counter() - t0
    if not active:
        return [], {}, None, failed
    words = bitmask if len(active) == len(constrained) else bitmask[active]
    allowed = unpack_bitmask(words.to(device, non_blocking=True), vocab_size)
    return [constrained[j] for j in active], fill_time, allowed, failed
