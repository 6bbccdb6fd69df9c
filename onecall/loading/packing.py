"""The fast kernels' side of a DecoderLM: which projections to pack, packing them, swapping them in.

A DecoderLM is the forward (model/decoder.py). On the fast path (float32 CPU, EngineConfig.kernels
"fast"), every projection becomes a FastLinear (kernels/cpu/fast_linear.py: the checkpoint's own stored
weights for every row where a native kernel takes them, 4-bit, 5-bit, int8 groups or 16-bit floats,
else oneDNN-prepacked float32), the logits a FastLMHead, and the small ops between them native passes (kernels/cpu/native.py).
Either while the checkpoint streams in (a StreamingPacker from `new_packer`, fed by
weights.load_weights, then `install`) or after a dense load (`enable_fast_kernels`).
`weight_bytes_read` counts what a step then streams from memory.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from onecall.formats.quants import StoredGroups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import FastLinear, FastLMHead, pack_stored, runs_stored_only
from onecall.kernels.select import fast_kernels_supported
from onecall.loading.native_step import NativeDecodeStep
from onecall.model.decoder import PROJECTION_PARTS, DecoderLM
from onecall.model.deepseek import DeepseekMoE
from onecall.model.gpt_oss import GptOssMoE
from onecall.model.moe import SparseMoE


class Prepacked(Protocol):
    """Every projection, the logits head and the embedding already in their kernels' layouts: a hit of
    loading/pack_cache.py (its CachedPacks), which nothing here needs to know more of."""

    head: native.Packed  # the logits head's table

    def linear(self, key: str, bias: torch.Tensor | None) -> FastLinear:
        """The projection PackSlot `key` names, holding `bias` by reference."""
        ...

    def embedding(self) -> StoredEmbedding:
        """The token embedding (tied: on the head's own table)."""
        ...


@dataclass
class PackSlot:
    """One projection to pack: the module attribute its FastLinear replaces, and the checkpoint
    tensors that fill its rows (a fused q/k/v or gate/up weight has several)."""

    key: str  # "model.layers.{i}.{ours}": its name in loading/pack_cache.py
    owner: nn.Module
    attr: str
    shape: tuple[int, int]  # (out_features, in_features)
    parts: dict[str, tuple[int, int]]  # checkpoint name -> (first row, end row), in row order
    bias: torch.Tensor | None


class StreamingPacker:
    """Packs projections into FastLinear modules while the checkpoint streams in.

    `accept(name, tensor)` takes a projection's part; when a projection has all its parts it is
    packed on a worker thread (torch's packing ops release the GIL) while loading goes on. So no
    dense float32 copy of the projections is ever a parameter: each lives only until packed, and
    cold start pays neither their first-touch page faults nor a copy (about 0.4 s for
    SmolLM2-135M's 424 MB on this machine). A projection whose parts are all stored weights the native
    kernels run (fast_linear.runs_stored_only) needs no float32 weight at all: its parts may arrive as meta tensors (a GGUF loader
    that did not expand them, GGUFFile.iter_tensors(expand_stored=False)) and are packed from the stored
    groups alone; any other meta part is expanded from its stored groups here. `finish` installs the
    modules and packs the logits. With `cached` (loading/pack_cache.py: a hit), every projection and
    the logits head come packed already: a part that still arrives is dropped, nothing is packed.
    """

    def __init__(
        self,
        slots: list[PackSlot],
        stored: MutableMapping[str, StoredGroups],
        workers: int,
        act8: bool = False,
        cached: Prepacked | None = None,
    ) -> None:
        self.slots = slots
        self.cached = cached
        self.act8 = act8  # 4-bit groups for the int8-activation kernel (DecoderLM.int8_activations)
        self._slot_of = {name: (slot, rows) for slot in slots for name, rows in slot.parts.items()}
        # may still be filling: a part's groups are stored before it is yielded; a projection's entries
        # leave it once handed to its packing job (which holds them until packed), so a file's unpacked
        # groups are never all held at once (the peak of a load)
        self._stored = stored
        self._staging: dict[int, dict[str, torch.Tensor]] = {}  # id(slot) -> the parts received so far
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers))
        self._jobs: list[tuple[PackSlot, Future[FastLinear]]] = []

    def accept(self, name: str, tensor: torch.Tensor) -> bool:
        """Take `tensor` (float32, or meta: see the class docstring) if it is part of a projection
        (shape already checked); False otherwise."""
        entry = self._slot_of.get(name)
        if entry is None:
            return False
        slot, _ = entry
        if self.cached is not None:
            return True  # packed already (a hit holds every projection: Prepacked)
        parts = self._staging.setdefault(id(slot), {})
        parts[name] = tensor
        if len(parts) == len(slot.parts):
            del self._staging[id(slot)]
            self._submit_parts(slot, parts)
        return True

    def _submit_parts(self, slot: PackSlot, parts: dict[str, torch.Tensor]) -> None:
        stored = self._stored_parts(slot)
        if stored is not None and runs_stored_only(stored):
            self._jobs.append((slot, self._pool.submit(FastLinear, None, slot.bias, stored, self.act8)))
        elif len(parts) == 1:
            ((name, tensor),) = parts.items()
            self.submit(slot, self._dense(name, tensor))
        else:
            weight = torch.empty(slot.shape, dtype=torch.float32)
            for name, (start, end) in slot.parts.items():
                weight[start:end].copy_(self._dense(name, parts[name]))
            self.submit(slot, weight)
        for name in slot.parts:  # the job holds what it needs (see __init__)
            self._stored.pop(name, None)

    def _dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part as a float32 tensor: itself, or (meta) expanded from its stored groups."""
        return self._stored[name].dequantize().float() if tensor.is_meta else tensor

    def _stored_parts(self, slot: PackSlot) -> list[tuple[int, int, StoredGroups]] | None:
        """The slot's parts as stored groups, in row order; None if a part has none."""
        parts = []
        for name, (start, end) in slot.parts.items():
            groups = self._stored.get(name)
            if groups is None:
                return None
            parts.append((start, end, groups))
        return parts

    def submit(self, slot: PackSlot, weight: torch.Tensor) -> None:
        """Pack `slot` from its whole (out, in) float32 weight on a worker thread."""
        stored = self._stored_parts(slot)  # a part without stored groups: oneDNN for every row
        self._jobs.append((slot, self._pool.submit(FastLinear, weight, slot.bias, stored, self.act8)))

    def finish(self, output_weight: torch.Tensor, output_name: str) -> tuple[FastLMHead, list[FastLinear]]:
        """Wait for every packing, swap each FastLinear in, and pack the logits projection (from the
        checkpoint's own int8 or 4-bit groups when `output_name` was stored as such; from the cache's
        tables on a hit)."""
        try:
            if self.cached is not None:
                modules = [self.cached.linear(slot.key, slot.bias) for slot in self.slots]
                for slot, module in zip(self.slots, modules, strict=True):
                    setattr(slot.owner, slot.attr, module)
                return FastLMHead.from_table(self.cached.head), modules
            head = self._pool.submit(FastLMHead, output_weight, self._stored.get(output_name))
            modules = [job.result() for _, job in self._jobs]
            for (slot, _), module in zip(self._jobs, modules, strict=True):
                setattr(slot.owner, slot.attr, module)
            return head.result(), modules
        finally:
            self.close()

    @property
    def stored(self) -> MutableMapping[str, StoredGroups]:
        """The checkpoint's stored groups by Hugging Face name (whole once the weights are loaded)."""
        return self._stored

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def pack_slots(model: DecoderLM) -> list[PackSlot]:
    """Every projection of every layer, with the checkpoint names and rows that fill it."""
    rows = model.part_rows()
    slots = []
    for i, ours, owner, attr in model.projections():
        linear: nn.Linear = getattr(owner, attr)
        shape = (linear.out_features, linear.in_features)
        theirs = PROJECTION_PARTS[ours]
        parts = {f"model.layers.{i}.{t}.weight": rows.get(t, (0, shape[0])) for t in theirs}
        slots.append(PackSlot(f"model.layers.{i}.{ours}", owner, attr, shape, parts, linear.bias))
    return slots


def new_packer(
    model: DecoderLM, stored: MutableMapping[str, StoredGroups], cached: Prepacked | None = None
) -> StreamingPacker:
    """A packer for the model's projections; `stored` may still be filling (see StreamingPacker);
    `cached`: every projection and the logits head from loading/pack_cache.py (a hit): none packed."""
    return StreamingPacker(pack_slots(model), stored, torch.get_num_threads(), model.int8_activations, cached)


def install(model: DecoderLM, packer: StreamingPacker) -> None:
    """Wait for the packer, swap in the packed projections and the logits head (the small ops are the
    model's own: DecoderLM.ops, chosen when it was built), and record what the model now runs on
    (DecoderLM.kernels)."""
    cached = packer.cached
    # on a hit the float32 output matrix is never made (nor read): the cache holds the head's table
    output = model.output_weight() if cached is None else torch.empty(0, device="meta")
    head, modules = packer.finish(output, model.output_weight_name())
    model.fast_lm_head = head
    if cached is not None:
        model.model.embed_tokens = cached.embedding()  # tied: the head's own table
        model.native_step = NativeDecodeStep.build(model.model)
    elif native.load() is not None:
        embedding = _stored_embedding(model, packer.stored)
        if embedding is not None:  # the float32 table goes, or was never made (fast_embedding.py)
            model.model.embed_tokens = embedding
        model.native_step = NativeDecodeStep.build(model.model)
    if native.load() is not None:
        _store_per_layer_embedding(model, packer.stored)
    # the loader left the table on meta only where stays_stored said a StoredEmbedding takes its groups
    embed = model.model.embed_tokens
    if isinstance(embed, nn.Embedding) and embed.weight.is_meta:
        raise RuntimeError(f"{EMBEDDING} was left to its stored groups, but no stored embedding took them")
    pieces = []
    every_row = [m for m in modules if m.every_row]  # every row on the stored groups' native kernels
    if every_row:  # the kernels they run, e.g. "int4+int5+int8" for a Q4_K_M file's fallbacks
        forms = {k for m in every_row for k in (m.decode_kernel or "").removeprefix("native ").split("+")}
        kind = "+".join(sorted(forms))
        acts = ", int8 activations" if any(m.int8_activations for m in every_row) else ""
        pieces.append(f"native {kind} ({len(every_row)} of {len(modules)} projections, every row{acts})")
    rest = [m for m in modules if not m.every_row]  # prompt rows on oneDNN, decode rows maybe stored groups
    if rest:
        kinds = sorted({k for m in rest if (k := m.decode_kernel) is not None})
        num_stored = sum(m.has_decode_kernel for m in rest)
        decode = f" + {'/'.join(kinds)} decode ({num_stored} of {len(modules)} projections)" if kinds else ""
        pieces.append(f"onednn float32{decode}")
    step = ", native decode step" if model.native_step is not None else ""
    model.kernels = f"{', '.join(pieces)}, {head.kernel} logits{step}"


EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Gemma 4's per-layer token embeddings (model/gemma4.py add_per_layer_inputs): vocabulary x (layers x
# width), a third of an E2B's parameters; kept as stored and looked up like the token embedding
PER_LAYER_EMBEDDING = "model.embed_tokens_per_layer.weight"


def stays_stored(model: DecoderLM, name: str, groups: StoredGroups | None) -> bool:
    """Whether the embedding table or an untied lm_head (`name`), stored as `groups`, stays those groups
    once the fast kernels are in, so its float32 matrix is never needed (one process, on CPU): exactly
    the groups the native kernels run as they are (fast_linear.runs_stored_only, the rule FastLMHead
    also follows), of the table's shape. A StoredEmbedding then reads them (tied: the head's own bytes)."""
    assert name in (EMBEDDING, LM_HEAD, PER_LAYER_EMBEDDING)
    if groups is None:
        return False
    embed = model.model.embed_tokens if name != PER_LAYER_EMBEDDING else model.model.embed_tokens_per_layer
    if not isinstance(embed, nn.Embedding):
        return False
    return (
        model.tp is None
        and model.model.norm.weight.device.type == "cpu"
        and groups.shape == (embed.num_embeddings, embed.embedding_dim)
        and runs_stored_only(groups)
    )


def _stored_embedding(model: DecoderLM, stored: Mapping[str, StoredGroups]) -> StoredEmbedding | None:
    """The token embedding as the checkpoint's groups, or None: the float32 table stays."""
    groups = stored.get(EMBEDDING)
    if not stays_stored(model, EMBEDDING, groups):
        return None
    if model.lm_head is None:  # tied: look rows up in the logits head's own bytes
        head = model.fast_lm_head
        table = head.table if isinstance(head, FastLMHead) and head.from_stored else None
        return None if table is None else StoredEmbedding(table)
    assert groups is not None
    table = pack_stored(groups)
    return None if table is None else StoredEmbedding(table)


def _store_per_layer_embedding(model: DecoderLM, stored: Mapping[str, StoredGroups]) -> None:
    """Gemma 4's per-layer token embeddings as the checkpoint's groups (a StoredEmbedding), where the
    loader left them unfilled (weights.load_weights: stays_stored); other models have none."""
    groups = stored.get(PER_LAYER_EMBEDDING)
    if not stays_stored(model, PER_LAYER_EMBEDDING, groups):
        return
    assert groups is not None
    table = pack_stored(groups)
    if table is None:  # runs_stored_only promised a layout: the loader left the float32 table unfilled
        raise RuntimeError(f"{PER_LAYER_EMBEDDING} was left to its stored groups, but they could not be packed")
    model.model.embed_tokens_per_layer = StoredEmbedding(table)


@torch.no_grad()
def enable_fast_kernels(model: DecoderLM, stored_weights: Mapping[str, StoredGroups] | None = None) -> str:
    """Swap every projection for a FastLinear (and the logits for a FastLMHead) after a dense
    load_weights (a model built with pack_on_load has them already). `stored_weights` (Hugging Face
    name -> quants.StoredGroups) are the checkpoint's own stored weights; a fused projection
    runs decode rows on stored groups only when every one of its parts has them.

    The small ops are the model's own (DecoderLM.ops): build it with kernels="fast" for the whole fast
    path. Returns what was enabled, for logs and traces. A no-op ("reference") off float32 CPU.
    """
    embed = model.model.embed_tokens  # its float32 table until install() may swap it out
    if (
        model.kernels != "reference"
        or not isinstance(embed, nn.Embedding)
        or not fast_kernels_supported(embed.weight.device, embed.weight.dtype)
    ):
        return model.kernels
    packer = new_packer(model, {} if stored_weights is None else dict(stored_weights))
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
        elif isinstance(module, (SparseMoE, GptOssMoE, DeepseekMoE)):
            total += module.weight_bytes_read(rows)
            moe_prefixes.append(f"{name}.")
    head = model.fast_lm_head
    assert head is None or isinstance(head, FastLMHead)
    for name, param in model.named_parameters():
        if name == "model.embed_tokens.weight" or (head is not None and name == "lm_head.weight"):
            continue
        if not name.startswith(tuple(moe_prefixes)):
            total += param.numel() * param.element_size()
    if head is not None:
        return total + head.weight_bytes_read()
    out = model.output_weight()
    return total + (out.numel() * out.element_size() if model.lm_head is None else 0)
