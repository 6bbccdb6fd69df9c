"""Logit provenance: where each generated token came from, stage by stage (trace_level "full").

For a row whose SamplingParams.trace_level is "full", `sampler.sample()` hands the recorder a
copy of the row after each of its stages; once the token is chosen, each copy becomes a
StageSnapshot: the TOP_N likeliest candidates (token id, value, probability under that stage's
softmax) and the chosen token's rank there (1 = the top; tied values share the better rank).

    stage         what the row holds                                       greedy rows
    raw           logits as the model produced them                        recorded
    penalties     after repetition/frequency/presence penalties, logit_bias  recorded
    mask          after the grammar mask and banned ids (-inf)             recorded
    temperature   mask / temperature                                       skipped
    truncation    after top-k, top-p, min-p (num_surviving: ids left)      skipped

`TokenProvenance.probability` is the chosen token's probability in the distribution the choice
was made from: the truncation stage's for a sampled row; for a greedy row (an argmax, no
distribution) the mask stage's softmax at temperature 1, the same figure logprobs describe.

Recording only reads: the copies are clones, snapshots come from topk and comparisons on
them, and no random number is drawn, so a row's token is the same with or without it. A batch
with no "full" row builds no recorder at all and runs the sampler's plain path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

TOP_N = 10  # candidates kept per stage
STAGES = ("raw", "penalties", "mask", "temperature", "truncation")
_GREEDY_NOTE = "greedy (temperature 0): the token is the argmax of the mask stage"


@dataclass
class Candidate:
    token_id: int
    logit: float  # the row's value at this stage (temperature stage: logit / temperature)
    prob: float  # softmax of this stage's row


@dataclass
class StageSnapshot:
    """One stage of one token: its top candidates and where the chosen token stood."""

    stage: str  # one of STAGES
    skipped: bool = False  # the stage did not run for this row (greedy: temperature, truncation)
    top: list[Candidate] = field(default_factory=list)  # descending; -inf (removed) ids left out
    chosen_rank: int | None = None  # 1 + the number of ids with a strictly higher value
    chosen_logit: float | None = None  # None when the stage removed it (-inf) or was skipped
    chosen_prob: float | None = None
    num_allowed: int | None = None  # mask stage: ids a grammar left allowed (None: no grammar)
    num_masked: int | None = None  # mask stage: ids the grammar and bans set to -inf
    num_surviving: int | None = None  # truncation stage: ids top-k/top-p/min-p kept
    entropy: float | None = None  # nats: Shannon entropy of this stage's whole distribution
    note: str | None = None


@dataclass
class TokenProvenance:
    """One generated token's path through the sampler."""

    token_id: int
    mode: str  # "greedy" or "sample"
    stages: list[StageSnapshot]  # in STAGES order
    probability: float | None  # the chosen token's probability where the choice was made

    def stage(self, name: str) -> StageSnapshot:
        return next(s for s in self.stages if s.stage == name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (no inf/NaN: removed ids and skipped stages hold None)."""
        return asdict(self)


class ProvenanceRecorder:
    """Collects row copies for one sample() call; `rows` are the batch rows at trace_level full.

    The copies go into one (len(rows), len(STAGES), vocab) float32 buffer, so `finish` reads all
    stages of all full rows with a handful of batched reductions and one host transfer.
    """

    def __init__(self, rows: Sequence[int], top_n: int = TOP_N) -> None:
        assert rows, "build a recorder only when some row asks for provenance"
        self.top_n = top_n
        self._slot = {i: k for k, i in enumerate(rows)}  # batch row -> buffer slot
        self._stages: list[set[str]] = [set() for _ in rows]  # what each slot has recorded
        self._buf: torch.Tensor | None = None  # (len(rows), len(STAGES), vocab), on first capture

    def capture(self, stage: str, x: torch.Tensor, batch_rows: Sequence[int] | None = None) -> None:
        """Copy this stage's row of every full row in `x` (x's row j is batch row batch_rows[j],
        or j when batch_rows is None). Later in-place edits of `x` do not reach the copies."""
        rows = range(x.shape[0]) if batch_rows is None else batch_rows
        pairs = [(j, self._slot[i]) for j, i in enumerate(rows) if i in self._slot]
        if not pairs:
            return
        if self._buf is None:
            shape = (len(self._slot), len(STAGES), x.shape[1])
            self._buf = torch.zeros(shape, dtype=torch.float32, device=x.device)
        src, dst = [j for j, _ in pairs], [k for _, k in pairs]
        self._buf[dst, STAGES.index(stage)] = x[src].to(torch.float32)  # a copy: x may change later
        for k in dst:
            self._stages[k].add(stage)

    def finish(
        self, token_ids: Sequence[int], num_allowed: Sequence[int | None], num_masked: Sequence[int]
    ) -> list[TokenProvenance | None]:
        """One TokenProvenance per batch row (None for rows at trace_level basic)."""
        # 1. every figure of every stage of every full row, batched: (rows, stages[, top_n])
        buf = self._buf
        assert buf is not None, "raw, penalties and mask are captured for every row"
        chosen_ids = torch.tensor([token_ids[i] for i in self._slot], device=buf.device)
        chosen = buf.gather(2, chosen_ids[:, None, None].expand(-1, len(STAGES), 1))  # (rows, stages, 1)
        lse = torch.logsumexp(buf, dim=-1, keepdim=True)  # (rows, stages, 1)
        logp = buf - lse
        p_logp = torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0)  # removed ids add 0, not NaN
        vals, ids = buf.topk(min(self.top_n, buf.shape[-1]), dim=-1)
        figures = {
            "vals": vals,
            "ids": ids,
            "probs": (vals - lse).exp(),
            "chosen": chosen.squeeze(-1),
            "chosen_prob": (chosen - lse).exp().squeeze(-1),
            "rank": (buf > chosen).sum(dim=-1) + 1,
            "finite": torch.isfinite(buf).sum(dim=-1),
            "entropy": -p_logp.sum(dim=-1),
        }
        host = {k: v.tolist() for k, v in figures.items()}  # the one transfer
        # 2. per row, the stages it ran
        out: list[TokenProvenance | None] = [None] * len(token_ids)
        for i, k in self._slot.items():
            row = {name: v[k] for name, v in host.items()}
            out[i] = self._token(token_ids[i], k, row, num_allowed[i], num_masked[i])
        return out

    def _token(
        self, token: int, slot: int, row: dict[str, Any], num_allowed: int | None, num_masked: int
    ) -> TokenProvenance:
        recorded = self._stages[slot]
        is_sampled = "temperature" in recorded
        assert is_sampled == ("truncation" in recorded), "a sampled row records both of its own stages"
        stages: list[StageSnapshot] = []
        for s, name in enumerate(STAGES):
            if name not in recorded:
                stages.append(StageSnapshot(name, skipped=True, note=_GREEDY_NOTE))
                continue
            top = [
                Candidate(t, v, p)
                for t, v, p in zip(row["ids"][s], row["vals"][s], row["probs"][s], strict=True)
                if math.isfinite(v)
            ]
            snap = StageSnapshot(name, top=top, entropy=row["entropy"][s])
            if math.isfinite(row["chosen"][s]):
                snap.chosen_rank, snap.chosen_logit = row["rank"][s], row["chosen"][s]
                snap.chosen_prob = row["chosen_prob"][s]
            else:
                snap.note = "the chosen token was removed at this stage"
            if name == "mask":
                snap.num_allowed, snap.num_masked = num_allowed, num_masked
            elif name == "truncation":
                snap.num_surviving = row["finite"][s]
            stages.append(snap)
        final = stages[STAGES.index("truncation" if is_sampled else "mask")]
        return TokenProvenance(token, "sample" if is_sampled else "greedy", stages, final.chosen_prob)
