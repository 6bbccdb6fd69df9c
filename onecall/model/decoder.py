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

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from onecall.errors import UnsupportedModelError
from onecall.model.attention import AttentionMetadata
from onecall.model.config import ModelConfig
from onecall.model.fast_linear import FastLinear, FastLMHead, onednn_available
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from onecall.model.quants import Int4Groups


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
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, layer_idx, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        # Built on "meta" then materialised uninitialised: no time spent on random init of weights
        # that load_weights overwrites (and refuses to leave unloaded).
        self.model = DecoderModel(config, dtype, "meta")
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta"
            )
        self.fast_lm_head: FastLMHead | None = None
        _materialize(self, torch.device(device))
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) int64 -> hidden states (num_tokens, hidden_size)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer_idx, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv, layer_idx, meta)
        return self.model.norm(h)

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
            if name != "model.embed_tokens.weight":
                total += param.numel() * param.element_size()
        out = self._output_weight()
        return total + (out.numel() * out.element_size() if self.lm_head is None else 0)

    @torch.no_grad()
    def enable_fast_kernels(self, int4_weights: Mapping[str, Int4Groups] | None = None) -> str:
        """Swap every projection for a FastLinear (and the logits for a FastLMHead); call after
        load_weights. `int4_weights` (Hugging Face name -> Int4Groups) are the checkpoint's own 4-bit
        weights; a fused projection gets an int4 copy only when all of its parts have one.

        Returns what was enabled, for logs and traces. A no-op ("reference") off float32 CPU.
        """
        weight = self.model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_available():
            return "reference"
        int4_weights = int4_weights or {}
        parts = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",),
        }
        jobs: list[tuple[nn.Module, str, nn.Linear, Int4Groups | None]] = []
        for i, layer in enumerate(self.model.layers):
            for ours, theirs in parts.items():
                owner_name, attr = ours.split(".")
                owner = getattr(layer, owner_name)
                groups = [int4_weights.get(f"model.layers.{i}.{name}.weight") for name in theirs]
                fused = _cat_groups(groups) if all(g is not None for g in groups) else None
                jobs.append((owner, attr, getattr(owner, attr), fused))
        # Packing is cold-start time; torch's packing ops release the GIL, so a thread per core
        # packs in parallel (the module tree is only modified below, in this thread).
        with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
            head = pool.submit(FastLMHead, self._output_weight())
            fast = list(pool.map(lambda job: FastLinear(job[2], job[3]), jobs))
            self.fast_lm_head = head.result()
        for (owner, attr, _, _), module in zip(jobs, fast, strict=True):
            setattr(owner, attr, module)
        num_int4, num_total = sum(m.has_int4 for m in fast), len(fast)
        return f"onednn float32 + int4 decode ({num_int4} of {num_total} projections)" if num_int4 else "onednn float32"

    def _weight_table(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face name -> (our parameter, first row, end row) it fills."""
        c = self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shards = {
            "self_attn.qkv_proj": {
                "self_attn.q_proj": (0, q_size),
                "self_attn.k_proj": (q_size, q_size + kv_size),
                "self_attn.v_proj": (q_size + kv_size, q_size + 2 * kv_size),
            },
            "mlp.gate_up_proj": {
                "mlp.gate_proj": (0, c.intermediate_size),
                "mlp.up_proj": (c.intermediate_size, 2 * c.intermediate_size),
            },
        }
        table: dict[str, tuple[torch.Tensor, int, int]] = {}
        for name, param in self.named_parameters():
            fused = next((f for f in shards if f"{f}." in name), None)
            if fused is None:
                table[name] = (param, 0, param.shape[0])
                continue
            for hf_part, (start, end) in shards[fused].items():
                table[name.replace(fused, hf_part)] = (param, start, end)
        return table

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters, casting dtype and device.

        Raises UnsupportedModelError naming the tensor for an unexpected name, a shape mismatch,
        or (at the end) any parameter left unloaded.
        """
        table = self._weight_table()
        tied = self.lm_head is None
        loaded: set[str] = set()
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
            target = param[start:end]
            _check_shape(name, tensor, target.shape)
            target.copy_(tensor)
            loaded.add(name)
        missing = [name for name in table if name not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise UnsupportedModelError(f"checkpoint is missing tensors: {shown}")


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise UnsupportedModelError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
        )


def _cat_groups(groups: list[Int4Groups | None]) -> Int4Groups:
    """Stack the row blocks of separately stored projections (q, k, v / gate, up) like our fused weight."""
    gs = [g for g in groups if g is not None]
    assert len(gs) == len(groups) and len({g.group_size for g in gs}) == 1
    if len(gs) == 1:
        return gs[0]
    return Int4Groups(
        torch.cat([g.q for g in gs]),
        torch.cat([g.scale for g in gs]),
        torch.cat([g.offset for g in gs]),
        gs[0].group_size,
    )


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Replace every meta-device parameter with an uninitialised one on `device` (no grad).

    Module.to_empty does the same through torch's Python reference ops, whose first use imports
    sympy and friends (~0.8 s of cold start); plain torch.empty is immediate.
    """
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(sub, name, nn.Parameter(fresh, requires_grad=False))
