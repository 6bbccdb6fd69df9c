"""Batch invariance on the default (fast) path: a request's tokens do not depend on its batch.

The same seeded request runs alone, in a batch of 16 with other requests of other lengths, and with
its prompt cut into small chunks (chunked prefill); its tokens must be identical every time. What
makes it hold (see kernels/cpu/fast_linear.py and model/attention.py): every row of a 4-bit projection,
decode or prompt, goes through the native 4-bit kernel (torch's int4 kernel for decode rows and
oneDNN for prompt rows where it cannot build), each row-independent; attention is computed per
sequence (SDPA for prompts, the native kernel for decode rows) over that sequence's KV only.
"""

from __future__ import annotations

import pytest

from onecall.sampling_params import SamplingParams
from tests.helpers.int4 import int4_engine
from tests.helpers.tiny_engine import run_all

TARGET = "The quick brown fox jumps over the lazy dog, and then it rests for a while."
OTHERS = {f"o{i}": "Tell me a story about a number " + "seven " * i for i in range(15)}


def _tokens(params: SamplingParams, prompts: dict[str, str], **config: object) -> list[int]:
    engine = int4_engine("fast", **config)
    assert ("int8 activations" in engine.parts.model.kernels) == config.get("int8_activations", False)
    return list(run_all(engine, prompts, params)["target"].token_ids)


@pytest.mark.slow  # ~7 s each: make test runs them, make test-fast does not
@pytest.mark.parametrize("int8_activations", [False, True])  # both activation roundings are per row
def test_seeded_tokens_alone_in_a_batch_and_chunked_are_identical(int8_activations: bool) -> None:
    for params in (
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ):
        act = {"int8_activations": int8_activations}
        alone = _tokens(params, {"target": TARGET}, **act)
        batched = _tokens(params, {**OTHERS, "target": TARGET}, **act)
        chunked = _tokens(params, {"target": TARGET, "x": "a short one"}, max_num_batched_tokens=5, **act)
        late = _tokens(params, {"x": "w " * 40, "target": TARGET}, max_num_batched_tokens=11, **act)
        assert batched == alone
        assert chunked == alone
        assert late == alone
