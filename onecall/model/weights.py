"""Checkpoint tensors (Hugging Face names) -> a DecoderLM's parameters.

The loaders (model/checkpoint.py: GGUF, safetensors) yield (name, tensor) pairs named like Hugging
Face's checkpoints; `load_weights` copies each into our parameters, stacking the separate q/k/v and
gate/up tensors into the fused projections (DecoderLM.PROJECTION_PARTS, part_rows). On the fast path
(DecoderLM built with pack_on_load) projections go to model/packing.py's packer instead, as they
arrive, and no dense projection weight is ever allocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from onecall.errors import UnsupportedModelError
from onecall.model.decoder import PROJECTION_PARTS, DecoderLM
from onecall.model.packing import install, new_packer
from onecall.model.quants import StoredGroups


def weight_table(model: DecoderLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Hugging Face name -> (our parameter, first row, end row) it fills."""
    rows = model.part_rows()
    fused = {ours: theirs for ours, theirs in PROJECTION_PARTS.items() if len(theirs) > 1}
    table: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, param in model.named_parameters():
        ours = next((f for f in fused if f"{f}." in name), None)
        if ours is None:
            table[name] = (param, 0, param.shape[0])
            continue
        for hf_part in fused[ours]:
            table[name.replace(ours, hf_part)] = (param, *rows[hf_part])
    return table


@torch.no_grad()
def load_weights(
    model: DecoderLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    stored_weights: Mapping[str, StoredGroups] | None = None,
) -> None:
    """Copy Hugging Face-named tensors into the model's (partly fused) parameters, casting dtype and
    device. With pack_on_load, projections go to the fast kernels instead (with `stored_weights`, which
    the weight iterator may fill as it goes: see GGUFFile.iter_tensors).

    Raises UnsupportedModelError naming the tensor for an unexpected name, a shape mismatch,
    or (at the end) any parameter left unloaded.
    """
    table = weight_table(model)
    tied = model.lm_head is None
    packer = None
    if model.pack_on_load and model.kernels == "reference":
        # not `stored_weights or {}`: the dict the weight iterator fills is still empty here
        packer = new_packer(model, {} if stored_weights is None else stored_weights)
    loaded: set[str] = set()
    try:
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # transformers' RoPE buffer; we compute our own tables
            if tied and name == "lm_head.weight":
                # Tied checkpoints may still carry lm_head; the embedding is the one we use.
                _check_shape(name, tensor, model.model.embed_tokens.weight.shape)
                continue
            if name not in table:
                raise UnsupportedModelError(
                    f"unexpected tensor {name!r} in checkpoint for {model.config.architecture}"
                )
            param, start, end = table[name]
            _check_shape(name, tensor, param[start:end].shape)
            if packer is None or not packer.accept(name, tensor.float()):
                param[start:end].copy_(tensor)
            loaded.add(name)
        missing = [name for name in table if name not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise UnsupportedModelError(f"checkpoint is missing tensors: {shown}")
        if packer is not None:
            install(model, packer)
    finally:
        if packer is not None:
            packer.close()


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise UnsupportedModelError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
        )
