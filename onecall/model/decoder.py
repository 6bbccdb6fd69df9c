"""DecoderLM: one pre-norm decoder for Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3/4, gpt-oss and the Qwen3.5
hybrids, over a paged KV cache.

The Llama-shaped families differ only by flags in ModelConfig (q/k/v bias, q/k norm, partial
rotary, a sliding window), so there is one module tree, named like Hugging Face's
(`model.layers.N.self_attn...`) except for the two fused projections, which loading/weights.py's
load_weights fills from the separate q/k/v and gate/up tensors (PROJECTION_PARTS says which).
Gemma 4 (ModelConfig.gemma4) is a DecoderModel whose layers, per-layer embeddings and forward loop are
model/gemma4.py's, with a RoPE table per layer type (Gemma4Rotary). Gemma 2/3 (ModelConfig.gemma)
swap in model/gemma.py's model part (four norms a layer, gelu, per-layer-type RoPE tables) under the
same names, plus an embedding scale and capped logits. gpt-oss (ModelConfig.gpt_oss) is a DecoderModel whose layers are model/gpt_oss.py's (attention sinks, sliding and
full layers, its own MoE) and whose norms keep float32 weights; the loop, RoPE and logits stay these.
The hybrids (ModelConfig.linear_attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) are a DecoderModel whose
layers are model/qwen35.py's (Gated DeltaNet or gated attention, each over its own cache) and whose norms are (1 + w).
DeepSeek-V3 (ModelConfig.deepseek) is a DecoderModel whose layers and loop are model/deepseek.py's (multi-head
latent attention over a latent cache row, the grouped sigmoid router), with a RoPE table of the rope dims.

Per step: embed -> for each layer: h += attn(norm(h)); h += mlp(norm(h)) -> norm.
RoPE cos/sin are looked up once per step (per table) and shared by the layers; the
attention metadata is built once per step by the caller.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Protocol

import torch
from torch import nn

from onecall.errors import UnsupportedModelError
from onecall.kernels.ops import REFERENCE_OPS, LayerOps
from onecall.kernels.select import fast_kernels_supported, layer_ops
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.config import ModelConfig
from onecall.model.deepseek import DEEPSEEK_PROJECTION_PARTS, deepseek_forward, deepseek_layers, rotary_table
from onecall.model.gemma import GemmaDecoderModel, GemmaRMSNorm, GemmaRotary, soft_cap
from onecall.model.gemma4 import (
    GEMMA4_PROJECTION_PARTS,
    Gemma4Rotary,
    add_per_layer_inputs,
    gemma4_forward,
    gemma4_layers,
)
from onecall.model.gpt_oss import gpt_oss_layers
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP, Attention, Linear, RMSNorm, RotaryEmbedding
from onecall.model.moe import SparseMoE
from onecall.model.parallel import TensorParallel
from onecall.model.qwen35 import HYBRID_PROJECTION_PARTS, hybrid_layers, hybrid_part_rows


class WholeStep(Protocol):
    """A whole decode step run as one call (loading/native_step.py's NativeDecodeStep): the forward
    hands it a step it accepts instead of running the layers."""

    def accepts(self, meta: AttentionMetadata, kv_cache: PagedKVCache, num_rows: int) -> bool: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


# Our projections and the checkpoint tensors each is made of, in row order.
PROJECTION_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
    **HYBRID_PROJECTION_PARTS,  # a hybrid's layers: the output gate, DeltaNet's, the shared expert's
    **GEMMA4_PROJECTION_PARTS,  # Gemma 4's layers: q/k/v and gate/up unfused (their shapes vary by layer)
    **DEEPSEEK_PROJECTION_PARTS,  # DeepSeek's: the low-rank query, the latent's, the shared expert's
}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_idx: int = 0,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        self.self_attn = Attention(config, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        moe = config.moe
        self.mlp: MLP | SparseMoE = (
            SparseMoE(
                config.hidden_size,
                moe.moe_intermediate_size,
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.norm_topk_prob,
                dtype,
                device,
            )  # fmt: skip
            if moe is not None and moe.sparse_layers[layer_idx]
            else MLP(config, dtype, device, ops)
        )

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream before the previous layer's MLP output `residual` is added (None in
        layer 0). Returns (h, this layer's MLP output): adding it is the next norm's first step."""
        h, x = self.input_layernorm.add_and_norm(h, residual)
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.self_attn(x, cos, sin, kv_cache, layer_idx, meta)
        )
        return h, self.mlp(x, meta.num_decode)


class DecoderModel(nn.Module):
    """The `model.` part of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        # Built around an explicit (meta) weight: nn.Embedding would otherwise run normal_() on it,
        # and on the meta device that imports torch._dynamo (3 s of cold start) for nothing.
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # the loader may swap in a module over the checkpoint's own groups (no float32 table:
        # kernels/cpu/fast_embedding.py's StoredEmbedding)
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        if config.linear_attention is not None:  # a hybrid: model/qwen35.py's layers, (1 + w) norms
            self.layers = hybrid_layers(config, dtype, device, ops)
            self.norm: RMSNorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device, ops)
            return
        if config.gpt_oss is not None:  # gpt-oss: model/gpt_oss.py's layers, float32-weight norms
            self.layers = gpt_oss_layers(config, config.gpt_oss, dtype, device, ops)
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device, ops)
            return
        if config.deepseek is not None:  # DeepSeek-V3: model/deepseek.py's MLA layers
            self.layers = deepseek_layers(config, config.deepseek, dtype, device, ops)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
            return
        if config.gemma4 is not None:  # Gemma 4: model/gemma4.py's layers and per-layer embeddings
            self.layers = gemma4_layers(config, config.gemma4, dtype, device, ops)
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device, ops)
            add_per_layer_inputs(self, config, config.gemma4, dtype, device)
            return
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, i, ops) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)


class DecoderLM(nn.Module):
    """Causal LM over a paged KV cache: the forward and the logits. Parameters are uninitialised until
    the loader (loading/weights.py's load_weights) fills them; on the fast CPU path it also puts the
    projections on the kernels (loading/packing.py)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        kernels: str = "reference",
        pack_on_load: bool | None = None,
        tp: TensorParallel | None = None,
        int8_activations: bool = False,
        ops: LayerOps | None = None,
    ) -> None:
        """`kernels` (EngineConfig.kernels): "fast" builds every layer on the device's fused ops
        (kernels/select.py: the native C ops on a float32 CPU, Triton's on CUDA), "reference" on
        torch's. `pack_on_load` (default: kernels == "fast"): where the CPU fast path runs (float32 CPU,
        one process), the loader packs each projection for it as it arrives and no dense projection
        weight is ever allocated. `tp`: this rank's slice of a tensor-parallel model
        (model/parallel.py): the modules are built from tp.shard_config(config) (self.config is that),
        loaded through engine_parts.shard_weights; projections stay torch's (the CPU one-call step
        cannot stop for a collective), and on CPU so do the small ops. `int8_activations`: the fast
        kernels' 4-bit projections quantize activations to int8, not int16
        (EngineConfig.int8_activations); the packer reads it. `ops`: the layers' ops, instead of the
        ones `kernels` picks (tests hold one implementation against another this way)."""
        super().__init__()
        self.vocab_size = config.vocab_size  # the whole vocabulary: what compute_logits returns
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        if self.tp is not None and (
            config.linear_attention is not None
            or config.gpt_oss is not None
            or config.gemma4 is not None
            or config.deepseek is not None
        ):
            raise UnsupportedModelError(f"{config.architecture} does not run under tensor parallel")
        if self.tp is not None:
            config = self.tp.shard_config(config)
        self.config = config
        cpu_fast = kernels == "fast" and fast_kernels_supported(device, dtype) and self.tp is None
        on_cuda = torch.device(device).type == "cuda"
        if ops is None:
            ops = layer_ops(device, dtype, kernels) if cpu_fast or on_cuda else REFERENCE_OPS
        self.ops = ops
        self.pack_on_load = cpu_fast and pack_on_load is not False
        # Built on "meta" then materialised uninitialised: no time spent on random init of weights
        # that load_weights overwrites (and refuses to leave unloaded).
        self.model: DecoderModel | GemmaDecoderModel = (
            DecoderModel(config, dtype, "meta", self.ops)
            if config.gemma is None
            else GemmaDecoderModel(config, config.gemma, dtype, "meta", self.ops)
        )
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta"
            )
        # Set by the loader when the CPU fast path is in (loading/packing.py):
        self.fast_lm_head: nn.Module | None = None  # the logits on the kernels (FastLMHead)
        self.native_step: WholeStep | None = None  # all-decode steps as one native call
        self.kernels = "reference"  # what the projections run on, for logs and traces
        self.int8_activations = int8_activations
        # Packed on load, projection weights stay on "meta" (no memory) until their FastLinear replaces
        # them; so do the embedding table and an untied lm_head, until the loader knows whether they stay
        # the checkpoint's groups (kernels/cpu/fast_embedding.py, FastLMHead) or are filled in float32
        # (loading/weights.py's load_weights, loading/packing.py's stays_stored).
        skip = (
            {id(getattr(owner, attr)) for _, _, owner, attr in self.projections()}
            | {id(self.model.embed_tokens), id(self.lm_head)}
            if self.pack_on_load
            else set()
        )
        _materialize(self, torch.device(device), skip_weights_of=skip)
        for layer in self.model.layers if self.tp is not None else ():
            layer.self_attn.tp = layer.mlp.tp = self.tp  # type: ignore[union-attr]
        self.rotary: RotaryEmbedding | GemmaRotary
        if config.gemma is not None:
            self.rotary = GemmaRotary(config, config.gemma, dtype, device)  # a table per layer type
        elif config.gemma4 is not None:
            self.rotary = Gemma4Rotary(config, config.gemma4, dtype, device)  # Gemma 4's two tables
        elif config.deepseek is not None:  # the rope dims' table (qk_rope_head_dim, not head_dim)
            self.rotary = rotary_table(config, config.deepseek, dtype, device)
        else:
            self.rotary = RotaryEmbedding.from_config(config, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) int64 -> hidden states (num_tokens, hidden_size)."""
        if isinstance(self.rotary, Gemma4Rotary):  # Gemma 4: its own loop (per-layer inputs, KV sharing)
            return gemma4_forward(self.model, input_ids, self.rotary(positions), kv_cache, meta)
        if self.config.deepseek is not None:  # DeepSeek-V3: its own loop (no native step, no fused norms)
            assert isinstance(self.rotary, RotaryEmbedding)
            cos, sin = self.rotary(positions)
            return deepseek_forward(self.model, input_ids, cos, sin, kv_cache, meta)
        step = self.native_step
        if (
            step is not None
            and self.tp is None
            and isinstance(self.rotary, RotaryEmbedding)
            and step.accepts(meta, kv_cache, input_ids.shape[0])
        ):  # the same kernels, from C; the embedding and RoPE lookups too
            return step(input_ids, positions, self.rotary.cos, self.rotary.sin, kv_cache, meta)
        if self.tp is None:
            h = self.model.embed_tokens(input_ids)
        else:
            embed = self.model.embed_tokens
            assert isinstance(embed, nn.Embedding), "under tensor parallel the embedding stays float32"
            h = self.tp.embed(embed, input_ids, self.vocab_size)
        if isinstance(self.rotary, GemmaRotary):
            assert isinstance(self.model, GemmaDecoderModel)
            h = h * self.model.embed_scale  # Gemma scales its embeddings by sqrt(hidden_size)
            ropes = self.rotary(positions)  # (cos, sin) per layer: sliding and global layers differ
        else:
            cos, sin = self.rotary(positions)
            ropes = [(cos, sin)] * len(self.model.layers)
        residual: torch.Tensor | None = None
        for layer_idx, layer in enumerate(self.model.layers):
            cos, sin = ropes[layer_idx]
            h, residual = layer(h, residual, cos, sin, kv_cache, layer_idx, meta)
        return self.model.norm.add_and_norm(h, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size) float32 (the whole vocabulary, under tensor parallel too;
        soft-capped where the model caps its logits, Gemma 2)."""
        if self.fast_lm_head is not None:
            logits = self.fast_lm_head(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.output_weight()).float()
            if self.tp is not None:
                logits = self.tp.gather_vocab(logits, self.vocab_size)
        gemma, gemma4 = self.config.gemma, self.config.gemma4
        cap = gemma.final_logit_softcapping if gemma else gemma4.final_logit_softcapping if gemma4 else None
        return soft_cap(logits, cap)

    def output_weight(self) -> torch.Tensor:
        """The logits projection's (vocab_size, hidden_size) weight: the tied embedding or lm_head."""
        if self.lm_head is not None:
            return self.lm_head.weight
        embed = self.model.embed_tokens
        if not isinstance(embed, nn.Embedding):  # the checkpoint's groups, beside a logits head on them
            raise RuntimeError(
                "the tied embedding is kept as the checkpoint's groups (kernels/cpu/fast_embedding.py): there is "
                "no float32 matrix; the logits run on the native head over the same groups"
            )
        return embed.weight

    def output_weight_name(self) -> str:
        """The checkpoint (Hugging Face) name of output_weight(): the loaders key stored groups by it."""
        return "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    def projections(self) -> Iterator[tuple[int, str, nn.Module, str]]:
        """Every projection of every layer: (layer index, our name like "self_attn.qkv_proj", the module
        that owns it, its attribute name there). What the loader fills and the fast kernels replace."""
        for i, layer in enumerate(self.model.layers):
            for ours in PROJECTION_PARTS:
                owner_path, _, attr = ours.rpartition(".")
                owner: nn.Module | None = layer
                for part in filter(None, owner_path.split(".")):  # absent here (a hybrid's other type): None
                    owner = getattr(owner, part, None)
                if owner is None or isinstance(owner, SparseMoE) or getattr(owner, attr, None) is None:
                    continue  # a MoE layer's experts stay dense (model/moe.py), its router too; a Gemma 4
                    # KV-sharing layer has no k/v projections (None)
                yield i, ours, owner, attr

    def part_rows(self) -> dict[str, tuple[int, int]]:
        """Rows of a fused projection that each of its checkpoint parts fills."""
        c = self.config
        if c.gemma4 is not None or c.deepseek is not None:  # unfused projections, each filled whole
            return {}
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return {
            "self_attn.q_proj": (0, q_size),
            "self_attn.k_proj": (q_size, q_size + kv_size),
            "self_attn.v_proj": (q_size + kv_size, q_size + 2 * kv_size),
            "mlp.gate_proj": (0, c.intermediate_size),
            "mlp.up_proj": (c.intermediate_size, 2 * c.intermediate_size),
        } | (hybrid_part_rows(c) if c.linear_attention is not None else {})


def materialize_weight(model: DecoderLM, module: nn.Module) -> nn.Parameter:
    """Allocate a `weight` pack_on_load left on meta (the embedding table, an untied lm_head), on the
    model's device, uninitialised, and return it."""
    w = module.weight
    assert isinstance(w, nn.Parameter) and w.is_meta, "that weight is already real"
    fresh = torch.empty(w.shape, dtype=w.dtype, device=model.model.norm.weight.device)
    module.weight = nn.Parameter(fresh, requires_grad=False)
    return module.weight


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
