"""The mask prefetcher: masks filled on a worker thread during the forward give the same tokens.

A constraint here is a plain Python object whose allowed set depends on the tokens it
has been advanced with, and whose fill is slow (a sleep, so the worker is still busy
when the sampler asks). References: the same constraint driven directly, without the
prefetcher, through the sampler; and an engine run in which the fills are checked to
have happened on the worker thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from onecall.sampling.bitmask import pack_bitmask
from onecall.sampling.mask_prefetch import MaskPrefetcher
from onecall.sampling.sampler import sample
from onecall.sampling.types import SamplingRequest
from onecall.sampling_params import SamplingParams
from tests.helpers.tiny_engine import tiny_engine


class CountingConstraint:
    """Allows ids (k * stride + offset) % vocab for a few k, shifting with every advance; slow fills."""

    def __init__(self, vocab: int, offset: int, delay: float = 0.0, skip_first: bool = False) -> None:
        self.vocab, self.offset, self.delay = vocab, offset, delay
        self.skip_first = skip_first  # decline the first step (like a grammar during reasoning)
        self.seen: list[int] = []
        self.fill_threads: list[str] = []

    def allowed(self) -> list[int]:
        base = self.offset + 7 * len(self.seen)
        return [(base + 13 * k) % self.vocab for k in range(5)]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        self.fill_threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        if self.skip_first and not self.seen:
            return False
        allowed = torch.zeros(1, self.vocab, dtype=torch.bool)
        allowed[0, self.allowed()] = True
        bitmask[row].copy_(pack_bitmask(allowed)[0])
        return True

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)

    def is_finished(self) -> bool:
        return False


def test_prefetched_rows_equal_direct_fills() -> None:
    vocab = 100
    logits = torch.randn(3, vocab)
    params = SamplingParams(temperature=0.0)

    def requests(constraints: list[CountingConstraint | None]) -> list[SamplingRequest]:
        return [SamplingRequest(params, [1], [], None, constraint=c) for c in constraints]

    direct = [CountingConstraint(vocab, 3), None, CountingConstraint(vocab, 40, skip_first=True)]
    want = sample(logits, requests(direct))

    prefetcher = MaskPrefetcher(vocab)
    inner = [CountingConstraint(vocab, 3, delay=0.05), CountingConstraint(vocab, 40, 0.05, skip_first=True)]
    stand_ins = prefetcher.start(list(inner))
    got = sample(logits, requests([stand_ins[0], None, stand_ins[1]]))
    prefetcher.close()

    assert got.token_ids == want.token_ids
    assert got.token_ids[0] in inner[0].allowed()
    assert got.num_allowed == want.num_allowed == [5, None, None]  # row 2 declined its first step
    assert all(name.startswith("onecall-masks") for c in inner for name in c.fill_threads)


def test_engine_fills_masks_on_the_worker_and_tokens_obey_them() -> None:
    engine = tiny_engine()
    vocab = engine.model_config.vocab_size
    constraints = {f"c{i}": CountingConstraint(vocab, 100 + 50 * i, delay=0.002) for i in range(2)}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, c in constraints.items():
        engine.add_request(rid, f"prompt {rid}", params, constraint=c)
    engine.add_request("free", "an unconstrained prompt", params)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    outs = final

    for rid, c in constraints.items():
        tokens = outs[rid].token_ids
        assert len(tokens) == 6
        for step, token in enumerate(tokens):  # each token is one the constraint allowed at its step
            base = c.offset + 7 * step
            assert token in {(base + 13 * k) % vocab for k in range(5)}
        assert c.seen == tokens
        assert c.fill_threads and all(name.startswith("onecall-masks") for name in c.fill_threads)
    assert len(outs["free"].token_ids) == 6
