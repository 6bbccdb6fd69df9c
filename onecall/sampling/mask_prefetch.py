"""Grammar masks filled on a worker thread while the model runs the step's forward pass.

A constrained row's mask for step t depends only on the tokens up to t - 1, which
are known before the forward pass starts. So the engine starts the fills first,

    engine.step: schedule -> MaskPrefetcher.start(constraints) -> forward   -> sample
                                       `-- worker: fill row 0, row 1, ... --^ (waits only if still busy)

and hands the sampler a PrefetchedConstraint per row, whose `fill_bitmask` copies
the finished row instead of computing it. llguidance computes masks in Rust with
the GIL released, so the fills overlap the forward pass (torch also releases the
GIL); unconstrained rows in the batch no longer wait for them. The sampler sees
an ordinary TokenConstraint, and `mask_time` in the trace becomes the time the
step actually waited for a mask (plus its share of applying them), not the fill
work done in the shadow of the forward.

Invariant: a constraint's state changes only in `advance`, which the engine calls
after sampling, never while a fill is in flight (the step waits for all fills in
`fill_bitmask`, or in `wait` for rows that did not sample).
"""

from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from onecall.sampling.bitmask import allocate_bitmask
from onecall.sampling.types import TokenConstraint


class PrefetchedConstraint:
    """A TokenConstraint whose mask for this step is being filled on the prefetch worker."""

    def __init__(
        self,
        inner: TokenConstraint,
        job: Future[list[bool | Exception]],
        bitmask: torch.Tensor,
        row: int,
    ) -> None:
        self.inner = inner
        self._job = job
        self._bitmask = bitmask
        self._row = row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        applies = self._job.result()[self._row]  # waits for the worker if it is not done yet
        if isinstance(applies, Exception):
            raise applies  # this row's fill raised: the sampler fails this row alone (masks.py)
        if applies:
            bitmask[row].copy_(self._bitmask[self._row])
        return applies

    def advance(self, token_id: int) -> None:
        self.inner.advance(token_id)

    def is_finished(self) -> bool:
        return self.inner.is_finished()


class MaskPrefetcher:
    """One worker thread that fills the step's constraint masks; the engine owns one."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained step
        self._job: Future[list[bool | Exception]] | None = None

    def start(self, constraints: list[TokenConstraint]) -> list[PrefetchedConstraint]:
        """Begin filling one bitmask row per constraint; returns their stand-ins, in order."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onecall-masks")
        bitmask = allocate_bitmask(len(constraints), self.vocab_size)
        job = self._pool.submit(self._fill, constraints, bitmask)
        self._job = job
        return [PrefetchedConstraint(c, job, bitmask, j) for j, c in enumerate(constraints)]

    @staticmethod
    def _fill(constraints: list[TokenConstraint], bitmask: torch.Tensor) -> list[bool | Exception]:
        """Each row's answer, or the exception its fill raised (it belongs to that row alone)."""
        out: list[bool | Exception] = []
        for j, c in enumerate(constraints):
            try:
                out.append(c.fill_bitmask(bitmask, j))
            except Exception as e:
                out.append(e)
        return out

    def wait(self) -> None:
        """Block until the last step's fills are done. A fill's error is not raised here: it
        reached the sampler (fill_bitmask) already, as its own row's failure."""
        if self._job is not None:
            job, self._job = self._job, None
            futures.wait([job])

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
