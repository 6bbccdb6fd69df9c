"""DecoderLM: one pre-norm decoder for Llama, Qwen2 and Qwen3, running over a paged KV cache.

The families differ only by flags in ModelConfig (q/k/v bias, q/k norm), so
there is one module tree, named like Hugging Face's (`model.layers.N.self_attn...`)
except for the two fused projections, which `load_weights` fills from the
separate q/k/v and gate/up tensors.

Per step: embed -> for each layer: h += attn(norm(h)); h += mlp(norm(h)) -> norm.
RoPE cos/sin are looked up once per step and shared by all layers; the
attention metadata is built once per step by the caller.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
from torch import nn

from onecall.errors import UnsupportedModelError
from onecall.model import native
from onecall.model.attention import AttentionMetadata
from onecall.model.config import ModelConfig
from onecall.model.fast_linear import (
    FastLinear,
    FastLMHead,
    PackSlot,
    StreamingPacker,
    fast_kernels_supported,
)
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP, Attention, Linear, RMSNorm, RotaryEmbedding
from onecall.model.quants import Int4Groups

# Our projections and the checkpoint tensors each is made of, in row order.
_PROJECTION_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream before the previous layer's MLP output `residual` is added (None in
        layer 0). Returns (h, this layer's MLP output): adding it is the next norm's first step."""
        h, x = self.input_layernorm.add_and_norm(h, residual)
        h, x = self.post_attention_layernorm.add_and_norm(h, self.self_attn(x, cos, sin, kv, layer_idx, meta))
        return h, self.mlp(x)


class DecoderModel(nn.Module):
    """The `model.` part of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        # Built around an explicit (meta) weight: nn.Embedding would otherwise run normal_() on it,
        # and on the meta device that imports torch._dynamo (3 s of cold start) for nothing.
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class DecoderLM(nn.Module):
    """Causal LM over a paged KV cache. Parameters are uninitialised until `load_weights`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        pack_on_load: bool = False,
    ) -> None:
        """`pack_on_load`: where the fast kernels exist (float32 CPU), load_weights packs each
        projection for them as it arrives and no dense projection weight is ever allocated."""
        super().__init__()
        self.config = config
        # Built on "meta" then materialised uninitialised: no time spent on random init of weights
        # that load_weights overwrites (and refuses to leave unloaded).
        self.model = DecoderModel(config, dtype, "meta")
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta"
            )
        self.fast_lm_head: FastLMHead | None = None
        self.kernels = "reference"  # what the projections run on, for logs and traces
        self.pack_on_load = pack_on_load and fast_kernels_supported(device, dtype)
        # Packed on load, projection weights stay on "meta" (no memory) until their FastLinear replaces them.
        skip = {id(getattr(s.owner, s.attr)) for s in self._pack_slots()} if self.pack_on_load else set()
        _materialize(self, torch.device(device), skip_weights_of=skip)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) int64 -> hidden states (num_tokens, hidden_size)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        residual: torch.Tensor | None = None
        for layer_idx, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, cos, sin, kv, layer_idx, meta)
        return self.model.norm.add_and_norm(h, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size) float32."""
        if self.fast_lm_head is not None:
            return self.fast_lm_head(hidden)
        return torch.nn.functional.linear(hidden, self._output_weight()).float()

    def _output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def weight_bytes_read(self, rows: int = 1) -> int:
        """Bytes of weights one forward over `rows` tokens streams from memory, then the logits of those
        rows: what decode's bandwidth figure divides by. Every projection in the form its kernel reads
        (FastLinear: int4 or float32), norms, and the output matrix (a tied embedding counts once, as
        the lm_head; an untied embedding table is only gathered from, so it does not count)."""
        total = 0
        for module in self.modules():
            if isinstance(module, FastLinear):
                total += module.weight_bytes_read(rows)
        for name, param in self.named_parameters():
            if name != "model.embed_tokens.weight" and not (self.fast_lm_head and name == "lm_head.weight"):
                total += param.numel() * param.element_size()
        if self.fast_lm_head is not None:
            return total + self.fast_lm_head.weight_bytes_read()
        out = self._output_weight()
        return total + (out.numel() * out.element_size() if self.lm_head is None else 0)

    @torch.no_grad()
    def enable_fast_kernels(self, int4_weights: Mapping[str, Int4Groups] | None = None) -> str:
        """Swap every projection for a FastLinear (and the logits for a FastLMHead) after a dense
        load_weights (a model built with pack_on_load has them already). `int4_weights` (Hugging Face
        name -> Int4Groups) are the checkpoint's own 4-bit weights; a fused projection gets an int4
        copy only when all of its parts have one.

        Returns what was enabled, for logs and traces. A no-op ("reference") off float32 CPU.
        """
        weight = self.model.embed_tokens.weight
        if self.kernels != "reference" or not fast_kernels_supported(weight.device, weight.dtype):
            return self.kernels
        int4 = {} if int4_weights is None else int4_weights
        packer = StreamingPacker(self._pack_slots(), int4, torch.get_num_threads())
        for slot in packer.slots:
            packer.submit(slot, getattr(slot.owner, slot.attr).weight.detach())
        self._install(packer)
        return self.kernels

    def _pack_slots(self) -> list[PackSlot]:
        """Every projection of every layer, with the checkpoint names and rows that fill it."""
        rows = self._part_rows()
        slots = []
        for i, layer in enumerate(self.model.layers):
            for ours, theirs in _PROJECTION_PARTS.items():
                owner_name, attr = ours.split(".")
                owner = getattr(layer, owner_name)
                linear: nn.Linear = getattr(owner, attr)
                shape = (linear.out_features, linear.in_features)
                parts = {f"model.layers.{i}.{t}.weight": rows.get(t, (0, shape[0])) for t in theirs}
                slots.append(PackSlot(owner, attr, shape, parts, linear.bias))
        return slots

    def _install(self, packer: StreamingPacker) -> None:
        """Wait for the packer, then record what the projections now run on."""
        self.fast_lm_head, modules = packer.finish(self._output_weight())
        lib = native.load()
        if lib is not None:  # small ops fused into native passes (model/native.py)
            for module in self.modules():
                if (
                    isinstance(module, (RMSNorm, MLP))
                    or isinstance(module, Attention)
                    and module.q_norm is None
                ):
                    module.native = lib
        kinds = sorted({k for m in modules if (k := m.int4_kernel) is not None})
        num_int4 = sum(m.has_int4 for m in modules)
        decode = (
            f" + {'/'.join(kinds)} int4 decode ({num_int4} of {len(modules)} projections)" if kinds else ""
        )
        self.kernels = f"onednn float32{decode}, {self.fast_lm_head.kernel} logits"

    def _part_rows(self) -> dict[str, tuple[int, int]]:
        """Rows of a fused projection that each of its checkpoint parts fills."""
        c = self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return {
            "self_attn.q_proj": (0, q_size),
            "self_attn.k_proj": (q_size, q_size + kv_size),
            "self_attn.v_proj": (q_size + kv_size, q_size + 2 * kv_size),
            "mlp.gate_proj": (0, c.intermediate_size),
            "mlp.up_proj": (c.intermediate_size, 2 * c.intermediate_size),
        }

    def _weight_table(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face name -> (our parameter, first row, end row) it fills."""
        rows = self._part_rows()
        fused = {ours: theirs for ours, theirs in _PROJECTION_PARTS.items() if len(theirs) > 1}
        table: dict[str, tuple[torch.Tensor, int, int]] = {}
        for name, param in self.named_parameters():
            ours = next((f for f in fused if f"{f}." in name), None)
            if ours is None:
                table[name] = (param, 0, param.shape[0])
                continue
            for hf_part in fused[ours]:
                table[name.replace(ours, hf_part)] = (param, *rows[hf_part])
        return table

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        int4_weights: Mapping[str, Int4Groups] | None = None,
    ) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters, casting dtype and device.
        With pack_on_load, projections go to the fast kernels instead (with `int4_weights`, which the
        weight iterator may fill as it goes: see GGUFFile.iter_tensors).

        Raises UnsupportedModelError naming the tensor for an unexpected name, a shape mismatch,
        or (at the end) any parameter left unloaded.
        """
        table = self._weight_table()
        tied = self.lm_head is None
        packer = None
        if self.pack_on_load and self.kernels == "reference":
            # not `int4_weights or {}`: the dict the weight iterator fills is still empty here
            int4 = {} if int4_weights is None else int4_weights
            packer = StreamingPacker(self._pack_slots(), int4, torch.get_num_threads())
        loaded: set[str] = set()
        try:
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # transformers' RoPE buffer; we compute our own tables
                if tied and name == "lm_head.weight":
                    # Tied checkpoints may still carry lm_head; the embedding is the one we use.
                    _check_shape(name, tensor, self.model.embed_tokens.weight.shape)
                    continue
                if name not in table:
                    raise UnsupportedModelError(
                        f"unexpected tensor {name!r} in checkpoint for {self.config.architecture}"
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
                self._install(packer)
        finally:
            if packer is not None:
                packer.close()


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise UnsupportedModelError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
        )


def _materialize(module: nn.Module, device: torch.device, skip_weights_of: Collection[int] = ()) -> None:
    """Replace every meta-device parameter with an uninitialised one on `device` (no grad), except
    the `weight` of modules whose id is in `skip_weights_of` (left on meta: never allocated).

    Module.to_empty does the same through torch's Python reference ops, whose first use imports
    sympy and friends (~0.8 s of cold start); plain torch.empty is immediate.
    """
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if name == "weight" and id(sub) in skip_weights_of:
                continue
            fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(sub, name, nn.Parameter(fresh, requires_grad=False))
