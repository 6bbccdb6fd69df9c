"""The sampler's shared types: what a batch row asks for, what a step returns, the constraint hook.

Kept apart from the sampler's implementation so that its stages (penalties.py, masks.py), the
grammar backend and the engine all import the types without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from onecall.errors import RequestFaultError
from onecall.sampling.provenance import TokenProvenance
from onecall.sampling_params import SamplingParams


class TokenConstraint(Protocol):
    """Per-request allowed-token hook; the grammar backend (sampling/grammar.py) implements it.

    Each step the sampler allocates one bitmask for the rows that have a
    constraint (sampling/bitmask.py), each constraint fills its own row, and
    one pass applies them all; rows without a constraint cost nothing.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this step's allowed ids into `bitmask[row]` (int32 words on the CPU; bit t % 32 of
        word t // 32 set = id t allowed; bits past the constraint's vocabulary left 0). Return False
        to leave this step unconstrained (e.g. while the model is still reasoning)."""
        ...

    def advance(self, token_id: int) -> None:
        """Called by the engine with the token it appends (the sampler never calls it)."""
        ...

    def is_finished(self) -> bool:
        """True once the constrained output is complete: the request then stops ("stop")."""
        ...


@dataclass
class SamplingRequest:
    """One row of the batch, built by the engine each step.

    `generator` (on the logits' device) is the request's own, created once from
    params.seed and kept across steps; a row with one draws only from it.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None
    banned_token_ids: Sequence[int] = ()  # e.g. EOS ids while len(output) < min_tokens


@dataclass
class SampleResult:
    """Per-row results; the logprob fields are None for rows that did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob under the processed logits
    top_logprobs: list[list[tuple[int, float]] | None]  # params.logprobs alternatives, descending
    num_masked: list[int]  # tokens the constraint and bans set to -inf this step
    num_allowed: list[int | None]  # tokens a constraint left allowed; None = no constraint this step
    mask_time: list[float]  # seconds: the row's constraint filling its mask, plus the one shared apply
    provenance: list[TokenProvenance | None] = field(default_factory=list)  # trace_level "full" rows
    # rows that could not be sampled (their grammar raised, or nothing was left allowed): the token in
    # their slot means nothing and the engine ends each such request alone with its error
    failed: dict[int, RequestFaultError] = field(default_factory=dict)
