"""Tensor parallelism for the decoder: which slice of each weight a rank holds, and the collectives.

With N ranks (torch.distributed, NCCL on GPUs, gloo on CPU; the caller initialises the group), rank r
holds 1/N of every layer (Megatron's split, as vLLM and SGLang do it):

    | weight (Hugging Face name)      | split                   | after the matmul                  |
    |---------------------------------|-------------------------|-----------------------------------|
    | q_proj, k_proj, v_proj (+ bias) | rows: heads r*H/N ...   | attention runs on the local heads |
    | o_proj                          | columns: the same heads | all-reduce (sum of partial sums)  |
    | o_proj bias                     | rank 0 only (else zero) | added once by the all-reduce      |
    | gate_proj, up_proj              | rows: r*I/N ...         | local activation                  |
    | down_proj                       | columns: r*I/N ...      | all-reduce                        |
    | embed_tokens, lm_head           | rows: vocab r*V/N ...   | embedding: all-reduce of the rows |
    |                                 | (padded to N equal)     | this rank owns; logits: gathered  |
    | norms, q_norm/k_norm            | replicated              |                                   |

So each rank's model is an ordinary DecoderLM built from `shard_config` (H/N query heads, KVH/N KV
heads, I/N intermediate, ceil(V/N) vocabulary rows), loaded from `shard_weights` (engine/engine_parts.py) over the checkpoint's
tensors (or, from safetensors, by reading only `shard_slice` of each: engine_parts.iter_rank_weights),
and its forward adds three collectives per layer pair at most: after o_proj, after down_proj,
and once for the embedding; compute_logits gathers the vocabulary shards. Each rank's KV cache holds
its own KV heads. Models whose heads or intermediate size do not divide by N are refused by name
(KV heads are not replicated across ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from onecall.errors import UnsupportedModelError
from onecall.model.config import ModelConfig

_FUSED = (".self_attn.qkv_proj.", ".mlp.gate_up_proj.")  # formats/fused.py splits these


def is_fused(name: str) -> bool:
    """A checkpoint tensor holding several projections (Phi-3's qkv_proj, gate_up_proj)."""
    return any(f in name for f in _FUSED)


@dataclass(frozen=True)
class ShardSlice:
    """A rank's part of a checkpoint tensor: [start, stop) along `dim` (0: rows, 1: columns), then
    `pad` zero rows (the last rank's vocabulary padding; o_proj's bias on ranks > 0 is 0 rows + all
    padding)."""

    dim: int
    start: int
    stop: int
    pad: int = 0

    def pad_rows(self, part: torch.Tensor) -> torch.Tensor:
        """`part` (the [start, stop) slice, as read) with the padding rows; contiguous."""
        if self.pad:
            zeros = torch.zeros(self.pad, *part.shape[1:], dtype=part.dtype, device=part.device)
            part = torch.cat((part, zeros))
        return part.contiguous()


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group that the caller has initialised."""

    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)

    # ---- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(n, ceil(V / N)) logits of this rank's vocabulary rows -> (n, V), every rank's, in order."""
        if self.world_size == 1:
            return local_logits[:, :vocab_size]
        parts = [torch.empty_like(local_logits) for _ in range(self.world_size)]
        dist.all_gather(parts, local_logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ---- sharding -------------------------------------------------------------------------------
    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """[start, start + size) of the vocabulary this rank holds; size = ceil(V / N) on every rank
        (the last rank's rows past V are zero padding)."""
        size = -(-vocab_size // self.world_size)
        return self.rank * size, size

    def check_divides(self, config: ModelConfig) -> None:
        """Refuse (UnsupportedModelError, naming what) a model this group cannot split evenly."""
        n = self.world_size
        if config.moe is not None:
            raise UnsupportedModelError(
                f"tensor parallel for mixture-of-experts models ({config.architecture}) is not supported yet"
            )
        bad = [
            f"{name} ({value})"
            for name, value in (
                ("num_attention_heads", config.num_attention_heads),
                ("num_key_value_heads", config.num_key_value_heads),
                ("intermediate_size", config.intermediate_size),
            )
            if value % n
        ]
        if bad:
            raise UnsupportedModelError(
                f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; "
                "use a size that divides them"
            )

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The ModelConfig of this rank's slice of the model (see the module docstring)."""
        self.check_divides(config)
        n = self.world_size
        return dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // n,
            num_key_value_heads=config.num_key_value_heads // n,
            intermediate_size=config.intermediate_size // n,
            vocab_size=self.vocab_shard(config.vocab_size)[1],
        )

    def shard(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's slice of one checkpoint tensor, by its Hugging Face name."""
        part = self.shard_slice(name, config)
        if part is None:
            return tensor
        return part.pad_rows(tensor.narrow(part.dim, part.start, part.stop - part.start))

    def shard_slice(self, name: str, config: ModelConfig) -> ShardSlice | None:
        """Which part of the checkpoint tensor `name` this rank holds (None: all of it). A loader can
        read just that part (safetensors' get_slice) instead of the whole tensor. Fused projections
        (is_fused) must be split into their parts first."""
        r, n, d = self.rank, self.world_size, config.head_dim
        if n == 1:
            return None
        assert not is_fused(name), f"{name}: split fused projections before sharding"
        q_rows = config.num_attention_heads // n * d
        kv_rows = config.num_key_value_heads // n * d
        inter = config.intermediate_size // n
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if part == "q_proj":
            return ShardSlice(0, r * q_rows, (r + 1) * q_rows)
        if part in ("k_proj", "v_proj"):
            return ShardSlice(0, r * kv_rows, (r + 1) * kv_rows)
        if part in ("gate_proj", "up_proj"):
            return ShardSlice(0, r * inter, (r + 1) * inter)
        if part == "o_proj":
            if name.endswith(".bias"):  # added once, by rank 0: zeros elsewhere
                return None if r == 0 else ShardSlice(0, 0, 0, pad=config.hidden_size)
            return ShardSlice(1, r * q_rows, (r + 1) * q_rows)
        if part == "down_proj":
            return ShardSlice(1, r * inter, (r + 1) * inter)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, size = self.vocab_shard(config.vocab_size)
            stop = min(start + size, config.vocab_size)  # the last rank: padded to the common size
            return ShardSlice(0, start, stop, pad=start + size - stop)
        return None  # norms (incl. q_norm/k_norm): replicated

    def embed(self, embedding: torch.nn.Embedding, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank looks up the ids it owns (zeros elsewhere), then the
        all-reduce sums the one non-zero row per token into place."""
        start, size = self.vocab_shard(vocab_size)
        local = input_ids - start
        owned = (local >= 0) & (local < size)
        h = embedding(torch.where(owned, local, torch.zeros_like(local)))
        h = h * owned.unsqueeze(-1).to(h.dtype)
        return self.all_reduce(h)
