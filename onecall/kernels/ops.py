"""The one door between the network and the kernels: what a layer may ask of a backend.

model/ imports this module (and kernels/select.py, which picks an implementation) and no kernel
internals. Two objects cross the door (and a third for MoE experts the loader puts on kernels,
ExpertKernels):

    LayerOps           chosen when a model is built (select.layer_ops: device, dtype, the kernels
                       switch) and handed to every RMSNorm, MLP, Attention and GatedDeltaNet: the
                       fused small ops (residual add + RMSNorm, SiLU x up, q/k norms + RoPE + the K/V
                       cache write, a DeltaNet layer's decode rows with its states in place)
    AttentionKernels   chosen per step with the attention backend (select.attention_kernels) and
                       carried in the step's AttentionMetadata: paged decode rows, prefill chunks,
                       or the whole batch in one call

Attention sinks (gpt-oss): every AttentionKernels method takes `sinks`, None or a (num_heads,) float32
tensor of one learned logit per query head that joins each row's softmax denominator and carries no
value: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)), the scores s_j after the scale (and
any soft-cap), over the row's visible keys. A kernel that does not implement them must decline
(return None) when they are given, never attend without them.

Every method may decline (None, or False for rope_store): the caller then runs its own torch code,
which is the reference the kernels are tested against. The classes here are that reference: they
decline everything. kernels/cpu/ops.py (the native C kernels) and kernels/cuda/fused_ops.py (Triton)
override what they run, each deciding for itself which shapes and dtypes it takes.

Where such a method writes in place (add_rms_norm's h, rope_store's qkv and caches) the caller must
own the tensor.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import NamedTuple, Protocol

import torch

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps): Qwen3's per-head norms


class DeltaNetWeights(NamedTuple):
    """A Gated DeltaNet layer's small weights and sizes, as LayerOps.delta_decode_rows reads them (the
    formulas: model/qwen35.py's docstring; the recurrence: model/delta_rule.py)."""

    conv_weight: torch.Tensor  # (conv_dim, 1, kernel): the depthwise causal conv over q, k, v
    A_log: torch.Tensor  # (v_heads,)
    dt_bias: torch.Tensor  # (v_heads,)
    norm_weight: torch.Tensor  # (v_dim,): the gated RMSNorm's scale (a plain weight, no 1 + w)
    norm_eps: float
    l2_eps: float  # inside q and k's l2 norms
    num_k_heads: int
    k_head_dim: int


class LayerOps:
    """The reference layer ops: every fused op declined, so each module runs its torch code."""

    name = "reference"

    def __deepcopy__(self, memo: dict[int, object]) -> LayerOps:
        return self  # stateless (a library handle at most): a copied model shares its kernels

    def add_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """h += residual in place (when given) and RMSNorm(h) * weight, (rows, n); or None."""
        return None

    def silu_mul(self, y: torch.Tensor) -> torch.Tensor | None:
        """(rows, 2 * inter) [gate | up] -> (rows, inter) silu(gate) * up; or None."""
        return None

    def rope_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qk_norm: QKNorm | None,
    ) -> bool:
        """In place on qkv (tokens, (heads + 2 * kv_heads) * head_dim): q/k norms when given, RoPE
        (cos, sin: (tokens, rotated pairs)) on q and k, k and v written to the caches at slot_mapping.
        False, with nothing written, where these kernels do not take the shapes (then the caller
        rotates and stores them itself)."""
        return False

    def delta_decode_rows(
        self,
        proj: torch.Tensor,
        weights: DeltaNetWeights,
        slots: torch.Tensor,
        fresh: torch.Tensor | None,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor | None:
        """A Gated DeltaNet layer's n one-token rows between its input and output projections: proj (n,
        conv_dim + v_heads * v_dim + 2 * v_heads) the rows [qkv | z | b | a] of the input projection, the
        row's states at slots (n,) int64 (distinct) of conv_state (num_slots, conv_dim, kernel - 1) and
        recurrent_state (num_slots, v_heads, k_dim, v_dim), read and written in place; fresh (n,) bool
        or None: rows that start from zero states. -> (n, v_heads * v_dim), the gated RMSNorm's output
        (what the output projection reads); or None, with nothing written."""
        return None


class PagedBatch(Protocol):
    """The whole step as tensors, as a one-call attention kernel reads it (the step's AttentionMetadata
    on the "triton" backend): per sequence its block table, KV length and first query row."""

    @property
    def block_tables(self) -> torch.Tensor | None: ...  # (num_seqs, max_blocks) int32

    @property
    def seq_lens_t(self) -> torch.Tensor | None: ...  # (num_seqs,) int32

    @property
    def query_starts_t(self) -> torch.Tensor | None: ...  # (num_seqs + 1,) int32

    @property
    def max_query_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def seqs(self) -> Sized: ...  # one entry per sequence


class AttentionKernels:
    """The reference attention kernels: none, every sequence attends through torch's SDPA."""

    name = "torch"
    reads_decode_rows = False  # whether decode() may take rows: the metadata then lists them (DecodeRows)
    reads_prefill_chunks = False  # whether prefill() may take chunks

    def __deepcopy__(self, memo: dict[int, object]) -> AttentionKernels:
        return self

    def whole_batch(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedBatch,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Every row of the step in one call, (num_tokens, num_heads, head_dim); or None."""
        return None

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """n one-query sequences, q (n, num_heads, head_dim), KV read in place through the (n,
        max_blocks) int32 block tables; or None."""
        return None

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq_len: int,
        kv_start: int,
        blocks: torch.Tensor | None,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One sequence's chunk q (query_len, num_heads, head_dim), causal over its seq_len keys (its
        KV one run from slot kv_start, or its `blocks`); or None."""
        return None


class ExpertKernels(Protocol):
    """A MoE layer's expert weights held by a kernel in the checkpoint's own form (kernels/cpu/experts.py):
    `which` 0 is an expert's gate_up projection (rows [gate; up]), 1 its down projection."""

    def covers(self, which: int) -> bool:
        """Whether every expert's weight `which` runs here (its float32 copy is then never read)."""
        ...

    def nbytes(self, expert: int, which: int) -> int | None:
        """Bytes that weight streams per call, None where it runs on its float32 copy."""
        ...

    def project(self, rows: torch.Tensor, expert: int, which: int) -> torch.Tensor | None:
        """rows (n, in) through that weight, (n, out); None where it runs on its float32 copy."""
        ...


REFERENCE_OPS = LayerOps()
TORCH_ATTENTION = AttentionKernels()
