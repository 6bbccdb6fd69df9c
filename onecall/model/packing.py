"""The fast kernels' side of a DecoderLM: which projections to pack, packing them, swapping them in.

A DecoderLM is the forward (model/decoder.py). On the fast path (float32 CPU, EngineConfig.kernels
"fast"), every projection becomes a FastLinear (model/fast_linear.py: oneDNN-prepacked float32 for
prompt rows, the checkpoint's own 4-bit groups for decode rows), the logits a FastLMHead, and the
small ops between them native passes (model/native.py). Either while the checkpoint streams in
(`new_packer` + `install`, driven by weights.load_weights) or after a dense load
(`enable_fast_kernels`). `weight_bytes_read` counts what a step then streams from memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from onecall.model import native
from onecall.model.decoder import PROJECTION_PARTS, DecoderLM
from onecall.model.fast_linear import FastLinear, PackSlot, StreamingPacker, fast_kernels_supported
from onecall.model.layers import MLP, Attention, RMSNorm
from onecall.model.moe import SparseMoE
from onecall.model.native_step import NativeDecodeStep
from onecall.model.quants import StoredGroups


def pack_slots(model: DecoderLM) -> list[PackSlot]:
    """Every projection of every layer, with the checkpoint names and rows that fill it."""
    rows = model.part_rows()
    slots = []
    for i, ours, owner, attr in model.projections():
        linear: nn.Linear = getattr(owner, attr)
        shape = (linear.out_features, linear.in_features)
        theirs = PROJECTION_PARTS[ours]
        parts = {f"model.layers.{i}.{t}.weight": rows.get(t, (0, shape[0])) for t in theirs}
        slots.append(PackSlot(owner, attr, shape, parts, linear.bias))
    return slots


def new_packer(model: DecoderLM, stored: Mapping[str, StoredGroups]) -> StreamingPacker:
    """A packer for the model's projections; `stored` may still be filling (see StreamingPacker)."""
    return StreamingPacker(pack_slots(model), stored, torch.get_num_threads())


def install(model: DecoderLM, packer: StreamingPacker) -> None:
    """Wait for the packer, swap in the packed projections, the logits head and the native small ops,
    and record what the model now runs on (DecoderLM.kernels)."""
    model.fast_lm_head, modules = packer.finish(model.output_weight(), model.output_weight_name())
    lib = native.load()
    if lib is not None:  # small ops fused into native passes (model/native.py)
        for module in model.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.native = lib
        model.native_step = NativeDecodeStep.build(model.model)
    pieces = []
    every_row = sum(m.q4 is not None for m in modules)  # every row on the native 4-bit kernel
    if every_row:
        pieces.append(f"native int4 ({every_row} of {len(modules)} projections, every row)")
    rest = [m for m in modules if m.q4 is None]  # prompt rows on oneDNN, decode rows maybe stored groups
    if rest:
        kinds = sorted({k for m in rest if (k := m.decode_kernel) is not None})
        num_stored = sum(m.has_decode_kernel for m in rest)
        decode = f" + {'/'.join(kinds)} decode ({num_stored} of {len(modules)} projections)" if kinds else ""
        pieces.append(f"onednn float32{decode}")
    step = ", native decode step" if model.native_step is not None else ""
    model.kernels = f"{', '.join(pieces)}, {model.fast_lm_head.kernel} logits{step}"


@torch.no_grad()
def enable_fast_kernels(model: DecoderLM, stored_weights: Mapping[str, StoredGroups] | None = None) -> str:
    """Swap every projection for a FastLinear (and the logits for a FastLMHead) after a dense
    load_weights (a model built with pack_on_load has them already). `stored_weights` (Hugging Face
    name -> Int4Groups or Int8Groups) are the checkpoint's own quantized weights; a fused projection
    runs decode rows on stored groups only when every one of its parts has them.

    Returns what was enabled, for logs and traces. A no-op ("reference") off float32 CPU.
    """
    weight = model.model.embed_tokens.weight
    if model.kernels != "reference" or not fast_kernels_supported(weight.device, weight.dtype):
        return model.kernels
    packer = new_packer(model, {} if stored_weights is None else stored_weights)
    try:
        for slot in packer.slots:
            packer.submit(slot, getattr(slot.owner, slot.attr).weight.detach())
        install(model, packer)
    finally:
        packer.close()
    return model.kernels


def weight_bytes_read(model: DecoderLM, rows: int = 1) -> int:
    """Bytes of weights one forward over `rows` tokens streams from memory, then the logits of those
    rows: what decode's bandwidth figure divides by. Every projection in the form its kernel reads
    (FastLinear: 4-bit or float32), each MoE block as SparseMoE.weight_bytes_read counts it (the
    router and the experts `rows` tokens can reach, in their stored form), norms, and the output
    matrix (a tied embedding counts once, as the logits weight; an untied embedding table is only
    gathered from, so it does not count)."""
    total = 0
    moe_prefixes: list[str] = []  # "model.layers.3.mlp.": parameters a MoE block counted already
    for name, module in model.named_modules():
        if isinstance(module, FastLinear):
            total += module.weight_bytes_read(rows)
        elif isinstance(module, SparseMoE):
            total += module.weight_bytes_read(rows)
            moe_prefixes.append(f"{name}.")
    head = model.fast_lm_head
    for name, param in model.named_parameters():
        if name == "model.embed_tokens.weight" or (head is not None and name == "lm_head.weight"):
            continue
        if not name.startswith(tuple(moe_prefixes)):
            total += param.numel() * param.element_size()
    if head is not None:
        return total + head.weight_bytes_read()
    out = model.output_weight()
    return total + (out.numel() * out.element_size() if model.lm_head is None else 0)
