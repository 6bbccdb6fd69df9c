"""The batched sampler: one step's logits -> one token id per request.

`sample(logits, requests)` runs these stages, each vectorized over the rows that
use it and skipped when none does (a batch of plain greedy rows costs one argmax):

  1. repetition / frequency / presence penalties    (penalties.py)
  2. logit_bias                                     (penalties.py)
  3. constraint bitmasks and banned_token_ids -> -inf (masks.py, bitmask.py); a row left with no
     allowed token, or whose grammar raised, is reported in SampleResult.failed, never sampled
  4. logprobs = log_softmax of these *processed* logits
  5. greedy rows (temperature 0) take the argmax (torch's, or the caller's `argmax`: the engine
     passes kernels/cpu/native.py's, the same indices from a vectorized C pass)
  6. sampled rows: temperature -> top_k -> top_p -> min_p -> draw

Logprobs (stage 4) see penalties, bias and masks but not temperature, top-k,
top-p or min-p: they describe the model's distribution as the request shaped
it, the same for a greedy and a sampled request. (vLLM's default "raw" mode
is taken before any processing; ours is after stages 1-3.)

The draw is inverse-CDF: one uniform u per row, token = first id whose
cumulative probability exceeds u * total. A row with a generator draws its u
from it (exactly one number per step), so a seeded request gives the same
tokens whatever else shares the batch; the other rows share one draw. Only
float rounding at a top-p cutoff could differ between batch shapes.

The sampler is pure apart from advancing generators and asking constraints
for this step's mask: it never calls `TokenConstraint.advance`; the engine
does that when it appends the token.

Rows at trace_level "full" also get their logit provenance (provenance.py):
a copy of the row after stages 1-2, 3, temperature and truncation, read once
the token is chosen. Copies are taken before the stage after them edits the
logits in place, and draw no random numbers; a batch without such a row
builds no recorder and runs exactly the plain path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from onecall.sampling.masks import MaskResult, apply_token_masks
from onecall.sampling.penalties import apply_logit_bias, apply_penalties
from onecall.sampling.provenance import ProvenanceRecorder
from onecall.sampling.types import SampleResult, SamplingRequest

# Below this temperature a row is greedy: dividing by it would overflow float32.
_MIN_TEMPERATURE = 1e-5
# Top-p first looks at each row's likeliest _NUM_CANDIDATES tokens (a cheap
# partial sort); a row whose nucleus does not close inside them is redone with
# _CANDIDATE_GROWTH times as many, up to a full-vocabulary sort (CPU: topk(256)
# costs about 1/20 of a sort of 49152).
_NUM_CANDIDATES = 256
_CANDIDATE_GROWTH = 16


def sample(
    logits: torch.Tensor,
    requests: Sequence[SamplingRequest],
    *,
    inplace: bool = False,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` (batch, vocab).

    The caller's tensor is never modified unless `inplace` (the engine owns its
    step's float32 logits and passes True: stages 1-3 then edit only the rows
    that ask for them, with no (batch, vocab) copy). `argmax` replaces
    `x.argmax(dim=-1)` for the greedy rows and must return the same indices.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(requests), "logits must be (len(requests), vocab)"
    batch = logits.shape[0]
    device = logits.device
    full = [i for i, r in enumerate(requests) if r.params.trace_level == "full"]
    recorder = ProvenanceRecorder(full) if full else None  # None: no copies, no extra work
    if recorder is not None:
        recorder.capture("raw", logits)  # before stages 1-3 may edit `logits` in place

    # 1-3. processed logits, on our own float32 copy when a stage edits them (unless inplace).
    masks = MaskResult.none(batch)
    if any(_edits_logits(r) for r in requests):
        if not (inplace and logits.dtype == torch.float32):
            logits = logits.to(torch.float32, copy=True)
        apply_penalties(logits, requests)
        apply_logit_bias(logits, requests)
        if recorder is not None:
            recorder.capture("penalties", logits)
        masks = apply_token_masks(logits, requests)
    else:
        logits = logits.float()  # no copy when already float32; read-only from here on
        if recorder is not None:
            recorder.capture("penalties", logits)
    if recorder is not None:
        recorder.capture("mask", logits)

    # 4. logprobs of the processed logits.
    lp_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    logprobs = torch.log_softmax(_rows(logits, lp_rows), dim=-1) if lp_rows else None  # (len(lp_rows), vocab)

    # 5-6. greedy argmax, then overwrite the sampled rows.
    sampled = [i for i, r in enumerate(requests) if r.params.temperature >= _MIN_TEMPERATURE]
    if len(sampled) == batch:
        token_ids = _sample_rows(logits, requests, recorder, sampled)
    else:
        token_ids = logits.argmax(dim=-1) if argmax is None else argmax(logits)  # (batch,)
        if sampled:
            rows = [requests[i] for i in sampled]
            token_ids[torch.tensor(sampled, device=device)] = _sample_rows(
                _rows(logits, sampled), rows, recorder, sampled
            )
    result = _result(token_ids, logprobs, lp_rows, requests, masks)
    result.provenance = (
        recorder.finish(result.token_ids, result.num_allowed, result.num_masked)
        if recorder
        else [None] * batch
    )
    return result


def _edits_logits(r: SamplingRequest) -> bool:
    p = r.params
    return bool(
        p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.logit_bias
        or r.constraint is not None
        or r.banned_token_ids
    )


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] (a copy), or x itself when rows is every row in order."""
    if rows == list(range(x.shape[0])):
        return x
    return x[torch.tensor(rows, device=x.device)]


def _sample_rows(
    logits: torch.Tensor,
    requests: Sequence[SamplingRequest],
    recorder: ProvenanceRecorder | None = None,
    batch_rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """Temperature -> top_k -> top_p -> min_p -> draw, for rows that all sample. Returns (n,) int64.

    With a recorder, x is copied after temperature and after truncation (row j of `logits` is
    batch row batch_rows[j]); the draw reads the same x and the same uniforms either way."""
    device = logits.device
    params = [r.params for r in requests]
    # 1. temperature (a new tensor: the input stays untouched).
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    x = logits / temperature[:, None]  # (n, vocab)
    if recorder is not None:
        recorder.capture("temperature", x, batch_rows)  # before top-k/top-p edit x in place

    # 2. top-k and top-p, with one (partial) sort over the rows that use either.
    trunc = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if trunc:
        top_k = [params[j].top_k for j in trunc]
        top_p = [params[j].top_p for j in trunc]
        if len(trunc) == len(params):
            x = _top_k_top_p(x, top_k, top_p)
        else:
            idx = torch.tensor(trunc, device=device)
            x[idx] = _top_k_top_p(x[idx], top_k, top_p)

    # 3. min_p: drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p).
    if any(p.min_p > 0.0 for p in params):
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device
        )
        threshold = x.max(dim=-1, keepdim=True).values + log_min_p[:, None].to(x.dtype)
        x = x.masked_fill(x < threshold, float("-inf"))
    if recorder is not None:
        recorder.capture("truncation", x, batch_rows)

    # 4. inverse-CDF draw. v < total guarantees the first cdf entry above v has
    #    positive probability (a masked token adds exactly 0 to the running sum).
    cdf = torch.softmax(x, dim=-1).cumsum(dim=-1)  # (n, vocab)
    total = cdf[:, -1]
    v = torch.minimum(_uniforms(requests, device) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v[:, None], right=True).squeeze(1)


def _uniforms(requests: Sequence[SamplingRequest], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the rest from one shared draw."""
    n = len(requests)
    seeded = [j for j, r in enumerate(requests) if r.generator is not None]
    if not seeded:
        return torch.rand(n, device=device)
    u = torch.empty(n, device=device)
    if len(seeded) < n:
        unseeded = [j for j, r in enumerate(requests) if r.generator is None]
        u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), device=device)
    for j in seeded:
        u[j : j + 1] = torch.rand(1, generator=requests[j].generator, device=device)
    return u


def _top_k_top_p(
    x: torch.Tensor, top_k: list[int], top_p: list[float], max_candidates: int = _NUM_CANDIDATES
) -> torch.Tensor:
    """x (n, vocab) with every token outside the row's top-k, then top-p (nucleus), set to -inf.

    top_k 0 = all; top_p 1 = all. The nucleus is the shortest prefix of the
    descending order whose renormalized (after top-k) mass reaches top_p.
    """
    n, vocab = x.shape
    device = x.device
    k_list = [min(k, vocab) if k > 0 else vocab for k in top_k]
    # 1. candidates: a row's k, or (for top-p rows) at most max_candidates of them.
    num_cand = min(
        vocab, max(min(k, max_candidates) if p < 1.0 else k for k, p in zip(k_list, top_p, strict=True))
    )
    vals, idx = x.topk(num_cand, dim=-1)  # (n, num_cand), descending
    k = torch.tensor(k_list, device=device)
    keep = torch.arange(num_cand, device=device)[None, :] < k[:, None]  # (n, num_cand)

    # 2. nucleus inside the candidates; a row whose top-k is larger than the
    #    candidates and whose mass does not reach top_p in them is redone below.
    covered: torch.Tensor | None = None
    if any(p < 1.0 for p in top_p):
        p = torch.tensor([q if q < 1.0 else math.inf for q in top_p], dtype=x.dtype, device=device)
        # (n,) log of the mass the top-k set renormalizes to. Without top-k it is the
        # whole row, summed in vocab order whatever num_cand is, so a row's nucleus
        # does not depend on the rest of the batch.
        log_z = torch.logsumexp(vals.masked_fill(~keep, -math.inf), dim=-1)
        if any(kk == vocab for kk in k_list):
            log_z = torch.where(k == vocab, torch.logsumexp(x, dim=-1), log_z)
        probs = torch.exp(vals - log_z[:, None]).masked_fill(~keep, 0.0)
        cum = probs.cumsum(dim=-1)
        keep &= (cum - probs) < p[:, None]
        covered = (k <= num_cand) | ((k == vocab) & (cum[:, -1] >= p))

    out = torch.full_like(x, -math.inf).scatter_(1, idx, vals.masked_fill(~keep, -math.inf))
    # 3. more candidates (finally the whole row) for the rows these could not decide.
    if covered is not None and num_cand < vocab and not bool(covered.all()):
        redo = (~covered).nonzero().squeeze(1).tolist()
        redo_idx = torch.tensor(redo, device=device)
        more = max_candidates * _CANDIDATE_GROWTH
        out[redo_idx] = _top_k_top_p(x[redo_idx], [top_k[j] for j in redo], [top_p[j] for j in redo], more)
    return out


def _result(
    token_ids: torch.Tensor,
    logprobs: torch.Tensor | None,
    lp_rows: list[int],
    requests: Sequence[SamplingRequest],
    masks: MaskResult,
) -> SampleResult:
    """Move the step's tensors to Python lists (the one host sync besides top-p's)."""
    batch = len(requests)
    chosen_lp: list[float | None] = [None] * batch
    top_lp: list[list[tuple[int, float]] | None] = [None] * batch
    if logprobs is not None:
        device = token_ids.device
        chosen = logprobs.gather(1, token_ids[torch.tensor(lp_rows, device=device)][:, None]).squeeze(1)
        max_n = max(requests[i].params.logprobs or 0 for i in lp_rows)
        top_v, top_i = logprobs.topk(max_n, dim=-1)  # (len(lp_rows), max_n), descending
        for i, lp, vs, ids in zip(lp_rows, chosen.tolist(), top_v.tolist(), top_i.tolist(), strict=True):
            n = requests[i].params.logprobs or 0
            chosen_lp[i] = lp
            # masked tokens (-inf) are never offered as alternatives
            top_lp[i] = [(t, v) for t, v in zip(ids[:n], vs[:n], strict=True) if v != -math.inf]
    return SampleResult(
        token_ids.tolist(),
        chosen_lp,
        top_lp,
        masks.num_masked,
        masks.num_allowed,
        masks.mask_time,
        failed=masks.failed,
    )
