"""Checkpoint tensors (Hugging Face names) -> a DecoderLM's parameters.

The loaders (formats/checkpoint.py: GGUF, safetensors) yield (name, tensor) pairs named like Hugging
Face's checkpoints; `load_weights` copies each into our parameters, stacking the separate q/k/v and
gate/up tensors into the fused projections (DecoderLM.PROJECTION_PARTS, part_rows). On the fast path
(DecoderLM built with pack_on_load) projections go to loading/packing.py's packer instead, as they
arrive, and no dense projection weight is ever allocated; MoE experts a GGUF stored in a native form
are not copied either: their layer runs them from the groups (model/moe.py, _use_stored_experts).

Six rewrites happen on the way in, all to Hugging Face-named tensors, before anything else sees them
(the stored groups of a quantized GGUF, if any, rewritten with them: the fast kernels see one layout):
| checkpoint tensor                          | becomes                                  | why                     |
|--------------------------------------------|------------------------------------------|-------------------------|
| self_attn.qkv_proj, mlp.gate_up_proj (Phi-3)| its q/k/v, gate/up row slices            | one naming downstream   |
| a hybrid's (Qwen3.5, Qwen3-Next) q_proj,   | q and gate_proj rows; in_proj_qkv/_z/_b/ | model/qwen35.py's       |
| in_proj_qkvz / _ba; multimodal prefixes    | _a rows; model.*, vision and mtp skipped | layout (_hybrid_layout) |
| q_proj / k_proj rows, q_norm / k_norm      | each head permuted (rope.partial_rotary_ | partial rotary runs as  |
| (partial rotary models only)               | permutation)                             | full-width RoPE         |
| gpt-oss mlp.experts.gate_up_proj (E, H, 2I)| (E, 2I, H) rows [gate; up] (columns 0::2,| model/gpt_oss.py's      |
| and _bias, down_proj (E, I, H); MXFP4      | 1::2 de-interleaved), (E, H, I); MXFP4   | layout (_gpt_oss_layout)|
| *_blocks + *_scales pairs                  | dequantized exactly (dequantize_mxfp4)   |                         |
| Gemma 4's KV-sharing layers' k/v_proj,     | dropped                                  | those layers compute no |
| k/v_norm                                   |                                          | K/V (_gemma4_unshared)  |
| DeepSeek-V3's MTP layers, model.layers.    | dropped                                  | not run (_deepseek_mtp) |
| {num_hidden_layers and up}.*               |                                          |                         |
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping

import torch
from torch import nn

from onecall.errors import UnsupportedModelError
from onecall.formats.fused import split_fused_weights, stored_rows
from onecall.formats.quants import StoredGroups, cat_rows
from onecall.kernels.cpu import native
from onecall.kernels.cpu.experts import ExpertGroups, for_kernel, native_experts
from onecall.kernels.cpu.fast_linear import runs_stored_only
from onecall.loading.packing import (
    EMBEDDING,
    LM_HEAD,
    PER_LAYER_EMBEDDING,
    Prepacked,
    install,
    new_packer,
    stays_stored,
)
from onecall.model.config import ModelConfig
from onecall.model.decoder import PROJECTION_PARTS, DecoderLM, materialize_weight
from onecall.model.gemma import checkpoint_norm_weight
from onecall.model.moe import Experts
from onecall.model.rope import partial_rotary_permutation


def weight_table(model: DecoderLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Hugging Face name -> (our parameter, or a view of it, first row, end row) it fills."""
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
    table.update(_per_expert_entries(model))
    return table


# A MoE layer's experts are stacked (E, 2I, H) / (E, H, I) as transformers 5 holds them in memory
# (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); files on disk keep one tensor per expert.
# Either fills them: a stacked tensor whole, or expert e's gate / up / down into its slice.


def _per_expert_entries(model: DecoderLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Per-expert checkpoint names -> their slices of the stacked expert parameters."""
    entries: dict[str, tuple[torch.Tensor, int, int]] = {}
    for stacked, parts in _expert_alternatives(model).items():
        param = model.get_parameter(stacked)
        for name, (e, start, end) in parts.items():
            entries[name] = (param[e], start, end)
    return entries


def _expert_alternatives(model: DecoderLM) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Stacked expert parameter name -> {per-expert checkpoint name: (expert, first row, end row)}:
    loading every one of those fills the stacked parameter as well as its own name would."""
    moe = model.config.moe
    if moe is None:
        return {}
    inter = moe.moe_intermediate_size
    out: dict[str, dict[str, tuple[int, int, int]]] = {}
    for name, param in model.named_parameters():
        base, _, leaf = name.rpartition(".")
        if not base.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            continue
        parts: dict[str, tuple[int, int, int]] = {}
        for e in range(moe.num_experts):
            if leaf == "gate_up_proj":
                parts[f"{base}.{e}.gate_proj.weight"] = (e, 0, inter)
                parts[f"{base}.{e}.up_proj.weight"] = (e, inter, 2 * inter)
            else:
                parts[f"{base}.{e}.down_proj.weight"] = (e, 0, param.shape[1])
        out[name] = parts
    return out


# Mixtral's checkpoint names -> ours (Qwen3-MoE's already are)
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                  (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))  # fmt: skip


def _moe_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            for theirs, ours in _MIXTRAL_NAMES:
                name = name.replace(theirs, ours)
        yield name, tensor


@torch.no_grad()
def load_weights(
    model: DecoderLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    stored_weights: MutableMapping[str, StoredGroups] | None = None,
    cached: Prepacked | None = None,
) -> None:
    """Copy Hugging Face-named tensors into the model's (partly fused) parameters, casting dtype and
    device. With pack_on_load, projections go to the fast kernels instead (with `stored_weights`, which
    the weight iterator may fill as it goes: see GGUFFile.iter_tensors). `cached` (pack_on_load only):
    every projection, the logits head and the embedding packed already (loading/pack_cache.py, a hit):
    `weights` need not hold them (PackCache.iter_weights leaves them out), and any that come are dropped.

    Raises UnsupportedModelError naming the tensor for an unexpected name, a shape mismatch,
    or (at the end) any parameter left unloaded.
    """
    table = weight_table(model)
    weights = split_fused_weights(weights, model.config, stored_weights)
    if model.config.linear_attention is not None:
        weights = _hybrid_layout(weights, model.config, stored_weights)
    if model.config.moe is not None:
        weights = _moe_names(weights)
    if model.config.rotary_dim != model.config.head_dim:
        weights = _partial_rotary_layout(weights, model.config, stored_weights)
    if model.config.gpt_oss is not None:
        weights = _gpt_oss_layout(weights, _expert_dtype(model), stored_weights)
    if model.config.gemma4 is not None:
        weights = _gemma4_unshared(weights, model.config)
    if model.config.deepseek is not None:
        weights = _deepseek_mtp(weights, model.config.num_hidden_layers)
    tied = model.lm_head is None
    # a Hugging Face Gemma or Qwen3.5 checkpoint stores w, we hold 1 + w (not Qwen3.5's gated norm)
    fold_norms = model.config.gemma is not None or model.config.linear_attention is not None
    packer = None
    if model.pack_on_load and model.kernels == "reference":
        # not `stored_weights or {}`: the dict the weight iterator fills is still empty here
        packer = new_packer(model, {} if stored_weights is None else stored_weights, cached)
    assert cached is None or packer is not None, "a pack cache hit is for a model packed on load"
    loaded: set[str] = set()
    if packer is not None and cached is not None:  # the hit holds them (Prepacked)
        loaded |= {name for slot in packer.slots for name in slot.parts} | {EMBEDDING, LM_HEAD}
    # a GGUF's quantized experts, packed for their native kernel as they arrive instead of copied
    experts = None
    if packer is not None and stored_weights is not None and model.config.moe is not None and native.load():
        experts = _ExpertGroups(stored_weights, model.int8_activations)
    try:
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # transformers' RoPE buffer; we compute our own tables
            if tied and name == "lm_head.weight":
                # Tied checkpoints may still carry lm_head; the embedding is the one we use.
                embed = model.model.embed_tokens
                assert isinstance(embed, nn.Embedding), "the loader swaps the table out only at the end"
                _check_shape(name, tensor, torch.Size((embed.num_embeddings, embed.embedding_dim)))
                continue
            if cached is not None and name in (EMBEDDING, LM_HEAD):
                continue  # the hit's tables, installed by install()
            owner = {EMBEDDING: model.model.embed_tokens, LM_HEAD: model.lm_head}.get(name)
            if owner is not None and owner.weight.is_meta:  # left on meta by pack_on_load
                groups = stored_weights.get(name) if tensor.is_meta and stored_weights is not None else None
                if packer is not None and stays_stored(model, name, groups):
                    loaded.add(name)  # stays the stored groups: install() takes them from there
                    continue
                table[name] = (materialize_weight(model, owner), 0, tensor.shape[0])
            per_layer = name == PER_LAYER_EMBEDDING and packer is not None and tensor.is_meta
            if per_layer and stored_weights and stays_stored(model, name, stored_weights.get(name)):
                loaded.add(name)  # install() puts a StoredEmbedding on its groups
                continue
            if name not in table:
                raise UnsupportedModelError(
                    f"unexpected tensor {name!r} in checkpoint for {model.config.architecture}"
                )
            param, start, end = table[name]
            _check_shape(name, tensor, param[start:end].shape)
            if tensor.is_meta:  # a tensor the loader did not expand: its stored groups are the data
                if packer is not None and packer.accept(name, tensor):
                    loaded.add(name)
                    continue
                assert stored_weights is not None, "a meta tensor comes with its stored groups"
                tensor = stored_weights[name].dequantize().to(param.dtype)
            if fold_norms and name.endswith("norm.weight") and not name.endswith(_GATED_NORM):
                tensor = checkpoint_norm_weight(tensor)  # (1 + w) norms, folded (model/gemma.py, qwen35.py)
            if experts is not None and experts.take(name):
                pass  # its float32 slice is left unfilled (never read: model/moe.py)
            elif packer is None or not packer.accept(name, tensor.float()):
                param[start:end].copy_(tensor)
            loaded.add(name)
        # a stacked expert parameter counts as loaded when all its per-expert parts were
        alternatives = _expert_alternatives(model)
        per_expert = {n for parts in alternatives.values() for n in parts}
        missing = [
            name
            for name in table
            if name not in loaded
            and name not in per_expert
            and not (name in alternatives and all(n in loaded for n in alternatives[name]))
        ]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise UnsupportedModelError(f"checkpoint is missing tensors: {shown}")
        if packer is not None:
            install(model, packer)
            packed = {} if experts is None else experts.finish(table)
            stored = {} if stored_weights is None else stored_weights
            if kinds := _use_stored_experts(model, stored, packed):
                model.kernels += f", experts {kinds}"
    finally:
        if packer is not None:
            packer.close()


class _ExpertGroups:
    """A GGUF's quantized expert weights as they stream in (any stored form the native kernels run:
    fast_linear.runs_stored_only),
    taken from the stored groups and packed for the native kernels as soon as an expert's weight is
    whole (down at once, gate_up when both halves are in), so no more than a layer's unpacked halves are
    ever held, and never copied into the float32 parameters: model/moe.py runs every row of a packed
    weight on its kernel, and frees a weight kind whose every expert is packed. A half whose partner
    was stored in another form is filled in float32 by finish() (the partner's then too)."""

    def __init__(self, stored: MutableMapping[str, StoredGroups], act8: bool = False) -> None:
        self.stored = stored
        self.act8 = act8  # 4-bit groups for the int8-activation kernel (DecoderLM.int8_activations)
        # (".../experts.{e}", 0 gate_up / 1 down) -> the packed weight
        self.packed: dict[tuple[str, int], ExpertGroups] = {}
        self.halves: dict[str, StoredGroups] = {}  # gate or up waiting for the other

    def take(self, name: str) -> bool:
        """Whether `name` (a checkpoint tensor) is a quantized expert weight taken here, not to be copied."""
        groups = self.stored.get(name) if ".mlp.experts." in name else None
        if groups is None or not runs_stored_only(groups):
            return False
        base, _, part = name.removesuffix(".weight").rpartition(".")  # ".../experts.{e}", "gate_proj"
        if part == "down_proj":
            del self.stored[name]  # ours now: its unpacked groups live only until packed
            self.packed[(base, 1)] = self._pack(groups)
            return True
        partner = f"{base}.{'up_proj' if part == 'gate_proj' else 'gate_proj'}.weight"
        other = self.halves.get(partner)
        if other is None:
            del self.stored[name]
            self.halves[name] = groups
            return True
        gate, up = (groups, other) if part == "gate_proj" else (other, groups)
        both = cat_rows([gate, up])
        if both is None:
            return False  # stored in two forms: this half is copied, the waiting one filled by finish()
        del self.stored[name], self.halves[partner]
        self.packed[(base, 0)] = self._pack(both)
        return True

    def _pack(self, groups: StoredGroups) -> ExpertGroups:
        packed = for_kernel(groups, groups.shape, self.act8)
        assert packed is not None, "runs_stored_only said a native kernel takes these groups"
        return packed

    def finish(self, table: dict[str, tuple[torch.Tensor, int, int]]) -> dict[tuple[str, int], ExpertGroups]:
        """Fill the float32 slice of every half whose partner was stored in another form; the packed
        weights."""
        for name, groups in self.halves.items():
            param, start, end = table[name]
            param[start:end].copy_(groups.dequantize())
        self.halves.clear()
        return self.packed


def _use_stored_experts(
    model: DecoderLM, stored: Mapping[str, StoredGroups], packed: Mapping[tuple[str, int], ExpertGroups]
) -> str:
    """Hand every MoE layer its experts' own groups (kernels/cpu/experts.py): the ones packed as they
    streamed in, else the stored ones (gate and up stacked as the parameter is, when stored in one form),
    per expert and weight. Returns what that gave, for DecoderLM.kernels ("native int4 (3 of 3 MoE layers)"), or "".
    A MoE layer is any whose `mlp.experts` is a moe.Experts (SparseMoE's, gpt-oss's with biases,
    DeepSeek-V3's routed experts)."""
    moe_layers, used, kinds = 0, 0, set()
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, Experts):
            continue
        moe_layers += 1
        gate_up: list[StoredGroups | ExpertGroups | None] = []
        down: list[StoredGroups | ExpertGroups | None] = []
        for e in range(experts.num_experts):
            base = f"model.layers.{i}.mlp.experts.{e}"
            gate, up = stored.get(f"{base}.gate_proj.weight"), stored.get(f"{base}.up_proj.weight")
            both = cat_rows([gate, up]) if gate is not None and up is not None else None
            gate_up.append(packed.get((base, 0), both))
            down.append(packed.get((base, 1), stored.get(f"{base}.down_proj.weight")))
        held = native_experts(gate_up, down, experts.weight_shapes, model.int8_activations)
        if held is not None and experts.use_stored(held):
            used += 1
            kinds |= held.kinds()
    return f"native {'+'.join(sorted(kinds))} ({used} of {moe_layers} MoE layers)" if used else ""


# A hybrid checkpoint's (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) tensors that are not the text model's: the
# multimodal class's vision tower and the multi-token-prediction head (neither runs here).
_HYBRID_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_GATED_NORM = "linear_attn.norm.weight"  # a hybrid's one norm whose weight is the scale itself (no 1 + w)


def _hybrid_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    stored_weights: MutableMapping[str, StoredGroups] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A hybrid checkpoint in the names and row orders model/qwen35.py loads:

    | checkpoint tensor                               | becomes                                           |
    |-------------------------------------------------|---------------------------------------------------|
    | model.language_model.* (the multimodal class's) | model.*                                           |
    | model.visual.*, mtp.*                           | skipped                                           |
    | self_attn.q_proj, rows [q_h; gate_h] per head   | self_attn.q_proj (the q rows), self_attn.gate_proj |
    | linear_attn.in_proj_qkvz (Qwen3-Next), rows     | linear_attn.in_proj_qkv [q; k; v], in_proj_z      |
    | [q_g; k_g; v_g; z_g] per key head g             |                                                   |
    | linear_attn.in_proj_ba (Qwen3-Next), [b_g; a_g] | linear_attn.in_proj_b, linear_attn.in_proj_a      |

    Row picks are views or index copies; a stored (quantized) copy is split with its rows, as
    formats/fused.py splits Phi-3's fused projections."""
    spec = config.linear_attention
    assert spec is not None
    d, heads = config.head_dim, config.num_attention_heads
    per_head = torch.arange(2 * heads * d).reshape(heads, 2, d)
    q_gate = {"self_attn.q_proj": per_head[:, 0].flatten(), "self_attn.gate_proj": per_head[:, 1].flatten()}
    # Qwen3-Next groups each key head with the r value heads it serves: rows (key heads, its rows)
    k_heads, r = spec.linear_num_key_heads, spec.linear_num_value_heads // spec.linear_num_key_heads
    dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
    q, k, v, z = (
        torch.arange(k_heads * (2 * dk + 2 * r * dv)).reshape(k_heads, -1).split([dk, dk, r * dv, r * dv], 1)
    )
    qkvz = {
        "linear_attn.in_proj_qkv": torch.cat((q.flatten(), k.flatten(), v.flatten())),
        "linear_attn.in_proj_z": z.flatten(),
    }
    b, a = torch.arange(k_heads * 2 * r).reshape(k_heads, 2 * r).split([r, r], 1)
    ba = {"linear_attn.in_proj_b": b.flatten(), "linear_attn.in_proj_a": a.flatten()}
    fused_tensors = (
        ("self_attn.q_proj", q_gate),
        ("linear_attn.in_proj_qkvz", qkvz),
        ("linear_attn.in_proj_ba", ba),
    )
    for name, tensor in weights:
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        if name.startswith(_HYBRID_SKIPPED):
            continue
        for fused, parts in fused_tensors:
            if f".{fused}." in name and (fused != "self_attn.q_proj" or config.attn_output_gate):
                yield from _pick_rows(name, tensor, fused, parts, stored_weights)
                break
        else:
            yield name, tensor


def _pick_rows(
    name: str,
    tensor: torch.Tensor,
    fused: str,
    parts: dict[str, torch.Tensor],
    stored_weights: MutableMapping[str, StoredGroups] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each part of a fused checkpoint tensor: (its name, the tensor's rows that part index picks); a
    stored copy of the tensor split the same way."""
    expected = sum(len(rows) for rows in parts.values())
    if tensor.shape[0] != expected:
        raise UnsupportedModelError(f"tensor {name!r} has {tensor.shape[0]} rows, expected {expected}")
    groups = stored_weights.get(name) if stored_weights is not None else None
    for part, rows in parts.items():
        part_name = name.replace(fused, part)
        if groups is not None and stored_weights is not None:
            stored_weights[part_name] = stored_rows(groups, rows)
        yield part_name, tensor[rows]


_ROTATED = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.q_norm.", ".self_attn.k_norm.")


def _partial_rotary_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    stored_weights: MutableMapping[str, StoredGroups] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Permute every head of q and k (weights, biases, q/k norms) into the layout under which the
    partial rotary head is plain full-width RoPE (rope.partial_rotary_permutation); a stored copy of
    those rows (a quantized Phi-4-mini GGUF) is permuted with them, so the fast kernels see one layout."""
    perm = partial_rotary_permutation(config.head_dim, config.rotary_dim)
    for name, tensor in weights:
        if any(part in name for part in _ROTATED):
            if tensor.shape[0] % config.head_dim:
                raise UnsupportedModelError(
                    f"tensor {name!r} has {tensor.shape[0]} rows, not whole heads of {config.head_dim}"
                )
            heads = tensor.reshape(-1, config.head_dim, *tensor.shape[1:])
            tensor = heads[:, perm].reshape(tensor.shape)
            if stored_weights is not None and name in stored_weights:
                rows = torch.arange(tensor.shape[0]).reshape(-1, config.head_dim)[:, perm].flatten()
                stored_weights[name] = stored_rows(stored_weights[name], rows)
        yield name, tensor


# ---- gpt-oss: its experts' layout, and MXFP4 -------------------------------------------------------------
# MXFP4 (OCP Microscaling, the released gpt-oss checkpoints' expert weights): groups of 32 FP4 E2M1 values
# sharing one E8M0 scale. An E2M1 nibble is sign (bit 3), exponent (bits 2-1), mantissa (bit 0): these are
# its 16 values. `*_blocks` (..., G, 16) uint8 holds a row's G groups, two values a byte, value 2j in the low
# nibble of byte j and 2j + 1 in the high one; `*_scales` (..., G) uint8 the exponents e: 2^(e - 127).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_ROWS_PER_CHUNK = 1 << 16  # groups dequantized at once (~8 MB of float32): bounded temporaries


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) `dtype`: value 32g + 2j
    + h of a row is E2M1(nibble h of byte j of group g) * 2^(e_g - 127).

    Exact: the scale is built from its float32 bits (e << 23; e = 0 is the subnormal 2^-127, e = 255 is
    NaN as the MX spec defines it), and every E2M1 value times a power of two is a float32 (subnormal
    ones included) unless it passes float32's range (inf, as transformers' ldexp gives); the one
    rounding is the cast to `dtype`, none for float32 and bfloat16 (which keep float32's exponents)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise UnsupportedModelError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise UnsupportedModelError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not (..., G, 16), (..., G)"
        )
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, 16), scales.reshape(-1).to(torch.int32)
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype)
    for r0 in range(0, flat_blocks.shape[0], _MXFP4_ROWS_PER_CHUNK):
        b = flat_blocks[r0 : r0 + _MXFP4_ROWS_PER_CHUNK]
        e = flat_scales[r0 : r0 + _MXFP4_ROWS_PER_CHUNK]
        bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
        scale = torch.where(e == 255, torch.nan, bits.view(torch.float32))
        values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(1)  # (rows, 32)
        out[r0 : r0 + _MXFP4_ROWS_PER_CHUNK] = values * scale[:, None]
    return out.view(*scales.shape[:-1], scales.shape[-1] * 32)


def _expert_dtype(model: DecoderLM) -> torch.dtype:
    """The dtype the model holds its experts in (what MXFP4 weights are dequantized to)."""
    for name, param in model.named_parameters():
        if name.endswith(".mlp.experts.gate_up_proj"):
            return param.dtype
    return torch.float32


def _gpt_oss_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
    expert_dtype: torch.dtype,
    stored_weights: MutableMapping[str, StoredGroups] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss checkpoint in model/gpt_oss.py's expert layout:

    | checkpoint tensor (per layer, mlp.experts.)         | becomes                                     |
    |-----------------------------------------------------|---------------------------------------------|
    | gate_up_proj (E, H, 2I), columns gate 0::2, up 1::2 | gate_up_proj (E, 2I, H), rows [gate; up]    |
    | gate_up_proj_bias (E, 2I), interleaved the same way | gate_up_proj_bias (E, 2I), [gate; up]       |
    | down_proj (E, I, H)                                 | down_proj (E, H, I)                         |
    | X_blocks (E, out, in / 32, 16) + X_scales (MXFP4,   | X (E, out, in) dequantized to the experts'  |
    | the (out, in) orientation; either may come first)   | dtype, gate_up's rows de-interleaved        |

    transformers holds (and save_pretrained writes) the first three; the released checkpoints store
    the weights as MXFP4 pairs (transformers' Mxfp4Dequantize gives its layout back from them). With
    `stored_weights` (the fast path), an MXFP4 pair comes per expert instead (_mxfp4_per_expert): its
    own 4-bit codes kept there for the native kernel (the mxfp4 codebook), as a GGUF's MXFP4 experts are."""
    pending: dict[str, torch.Tensor] = {}  # a *_blocks or *_scales tensor waiting for its partner
    for name, tensor in weights:
        if ".mlp.experts." in name and name.endswith(("_proj_blocks", "_proj_scales")):
            base, _, kind = name.rpartition("_")
            partner = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            other = pending.pop(partner, None)
            if other is None:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
            if stored_weights is not None and not bool((scales == 255).any()):
                yield from _mxfp4_per_expert(base, blocks, scales, expert_dtype, stored_weights)
                continue
            weight = dequantize_mxfp4(blocks, scales, expert_dtype)  # (E, out, in)
            yield base, _gate_up_rows(base, weight) if base.endswith("gate_up_proj") else weight
        elif ".mlp.experts." in name and name.endswith(("gate_up_proj", "down_proj")):
            if tensor.dim() != 3:
                raise UnsupportedModelError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected 3 dims"
                )
            weight = tensor.transpose(1, 2)  # (E, in, out) -> (E, out, in)
            yield name, _gate_up_rows(name, weight) if name.endswith("gate_up_proj") else weight
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            yield name, _gate_up_rows(name, tensor)
        else:
            yield name, tensor
    if pending:
        unpaired = sorted(pending)
        raise UnsupportedModelError(f"MXFP4 tensors without their blocks or scales: {', '.join(unpaired)}")


def _mxfp4_per_expert(
    base: str,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    expert_dtype: torch.dtype,
    stored_weights: MutableMapping[str, StoredGroups],
) -> Iterator[tuple[str, torch.Tensor]]:
    """One MXFP4 expert weight (`base` ".../mlp.experts.gate_up_proj" or "down_proj", blocks (E, out,
    in / 32, 16), scales (E, out, in / 32), no scale 255) per expert e under the per-expert names the
    loader fills slices of (".../mlp.experts.{e}.gate_proj.weight", up_proj, down_proj): each one's codes
    (quants.mxfp4_code_groups: dequantize_mxfp4's values exactly) kept in `stored_weights`, and
    yielded expanded, one expert at a time (what the loader copies where no native kernel takes them).
    gate_up's interleaved rows split: gate 0::2, up 1::2."""
    from onecall.formats.quants import mxfp4_code_groups  # here: only the gpt-oss section uses it

    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise UnsupportedModelError(
            f"MXFP4 {base!r}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
            "(E, out, G, 16), (E, out, G)"
        )
    prefix = base.rpartition(".")[0]  # ".../mlp.experts"
    is_gate_up = base.endswith("gate_up_proj")
    if is_gate_up and blocks.shape[1] % 2:
        raise UnsupportedModelError(f"MXFP4 {base!r} has {blocks.shape[1]} rows: no gate/up pairs")
    parts = (("gate_proj", 0), ("up_proj", 1)) if is_gate_up else (("down_proj", None),)
    for e in range(blocks.shape[0]):
        for part, first in parts:
            rows = slice(None) if first is None else slice(first, None, 2)
            groups = mxfp4_code_groups(blocks[e, rows], scales[e, rows])
            assert groups is not None, "the caller kept scales of 255 on the float path"
            name = f"{prefix}.{e}.{part}.weight"
            stored_weights[name] = groups
            yield name, groups.dequantize().to(expert_dtype)


def _gemma4_unshared(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop the K/V projections and norms a Gemma 4 checkpoint may still hold for its KV-sharing layers
    (model/gemma4.py: those layers compute no K/V; transformers ignores the same tensors on load)."""
    spec = config.gemma4
    assert spec is not None
    shared = {f"model.layers.{i}.self_attn.{m}." for i in range(spec.num_kv_layers, config.num_hidden_layers)
              for m in ("k_proj", "v_proj", "k_norm", "v_norm")}  # fmt: skip
    for name, tensor in weights:
        if name[: name.rfind(".") + 1] not in shared:
            yield name, tensor


def _deepseek_mtp(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop DeepSeek-V3's multi-token-prediction layers (model.layers.{num_layers and up}.*): onecall
    does not run them, and transformers ignores the same tensors on load."""
    for name, tensor in weights:
        if name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            if index.isdigit() and int(index) >= num_layers:
                continue
        yield name, tensor


def _gate_up_rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Dim 1 of (E, 2I, ...) interleaved [g0, u0, g1, u1, ...] -> [g0, g1, ...; u0, u1, ...]."""
    if tensor.dim() < 2 or tensor.shape[1] % 2:
        raise UnsupportedModelError(f"tensor {name!r} of shape {tuple(tensor.shape)} has no gate/up pairs")
    return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise UnsupportedModelError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
        )
