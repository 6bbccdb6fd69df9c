"""Tiny GGUF models loaded as the engine loads them, for the kernel tests that hold a stored type's
whole model to the reference path (tests/kernels/test_quant_kernels.py, test_iq4_kernel.py,
test_kquant_kernels.py, test_mxfp4_kernel.py, test_fast_embedding.py).

`load` builds a DecoderLM from a GGUF file on the fast kernels (stored weights the native kernels take
are never expanded: meta tensors, their data only in the stored groups, as engine_parts loads) or on
the reference path (everything dequantized); `never` stands in for a function that must not run (the
packer's float32 expansion); `assert_every_projection_stored` says that every projection runs every
row on one packed form with no float32 copy; `compare_logits` runs a prefill and greedy decode steps
through both models and holds every logit to a tolerance the calling test writes down.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import StoredGroups
from onecall.kernels.cpu.fast_linear import FastLinear
from onecall.loading.weights import load_weights
from onecall.model.decoder import DecoderLM
from tests.model.test_model_numerics import Harness, Seq


def load(path: Path, fast: bool) -> DecoderLM:
    """The file as engine_parts loads it: with the fast kernels, stored weights the native kernels take
    are never expanded; else every weight dequantized to float32 (the reference path)."""
    files = resolve_model(path)
    stored: dict[str, StoredGroups] | None = {} if fast else None
    model = DecoderLM(
        model_config_from_hf(load_hf_config_dict(files)), kernels="fast" if fast else "reference"
    )
    load_weights(model, iter_weights(files, torch.float32, stored, expand_stored=not fast), stored)
    return model.eval()


def never(*args: Any) -> torch.Tensor:
    raise AssertionError("a stored projection was expanded to float32")


def assert_every_projection_stored(
    fast: DecoderLM, n: int, kind: str, packed: type, check: Callable[[Any], bool] = lambda _: True
) -> None:
    """All `n` projections run every row on `packed` weights (each passing `check`), none with a oneDNN
    float32 copy; the kernels line names `kind`; the one-call decode step runs them too."""
    assert f"native {kind} ({n} of {n} projections, every row)" in fast.kernels, fast.kernels
    projections = [m for m in fast.modules() if isinstance(m, FastLinear)]
    assert len(projections) == n and all(p.every_row and p.packed is None for p in projections)
    assert all(isinstance(p.parts[0][2], packed) and check(p.parts[0][2]) for p in projections)
    assert not any(name.endswith("proj.weight") for name, _ in fast.named_parameters())
    assert fast.native_step is not None


def compare_logits(fast: DecoderLM, ref: DecoderLM, vocab: int, atol: float) -> None:
    """A 13-token prefill, then 3 greedy (reference) tokens decoded one at a time, through each model:
    every logit within `atol`."""
    tokens = torch.randint(0, vocab, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    harness, seq = Harness(ref), Seq(list(tokens))
    want = harness.step([(seq, 13)])
    for _ in range(3):
        seq.tokens.append(int(want[-1][-1].argmax()))
        want += harness.step([(seq, 1)])
    harness, seq = Harness(fast), Seq(tokens[:13])
    got = harness.step([(seq, 13)])
    for step in want[:-1]:  # the reference's greedy token after each of its steps
        seq.tokens.append(int(step[-1].argmax()))
        got += harness.step([(seq, 1)])
    for g, w in zip(got, want, strict=True):
        diff = float((g - w).abs().max())
        assert diff <= atol, diff
