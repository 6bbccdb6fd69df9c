"""LinearStateCache: what a hybrid model's linear-attention layers carry from one token to the next.

A hybrid model (Qwen3.5 / Qwen3-Next: three Gated DeltaNet layers to one full-attention layer) keeps
a paged KV cache for its full-attention layers only; its linear-attention layers keep, per sequence,
a fixed-size state instead of a per-token KV:

    conv        (layers, slots, conv_dim, conv_width)   the causal depthwise conv1d's last
                                                         conv_width = kernel - 1 inputs (model dtype)
    recurrent   (layers, slots, v_heads, k_dim, v_dim)   the delta rule's state matrix per value head
                                                         (float32, as transformers keeps it)

A sequence owns one slot for its life (the engine hands slots out and takes them back; a step's
AttentionMetadata.state_slots says which slot each sequence of the step uses). A layer reads a
sequence's slot as its initial state, except when the sequence's first new position is 0 (then the
state is zero, whatever the slot holds), and writes the state after the sequence's last new token
back. A prefix snapshot is just another slot, holding the state after a known token: resuming a
cached prefix copies it into the sequence's own slot (`copy`) before the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearStateShape:
    """The per-slot state of one model's linear-attention layers."""

    num_layers: int  # how many layers are linear attention
    conv_dim: int  # the conv's channels: 2 * key_dim + value_dim (q, k and v pass through it)
    conv_width: int  # kernel size - 1: the inputs the conv needs from before a step
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        """Memory one slot takes across all linear layers (the recurrent state in float32)."""
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=conv_dtype).element_size()
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_layers * (conv + recurrent)


class LinearStateCache:
    """The conv and recurrent states of every linear-attention layer, one slot per sequence or snapshot."""

    def __init__(
        self, shape: LinearStateShape, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        assert shape.num_layers > 0 and num_slots > 0, "state cache dimensions must be positive"
        self.shape = shape
        self.num_slots = num_slots
        s = shape
        self.conv = torch.zeros(s.num_layers, num_slots, s.conv_dim, s.conv_width, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            s.num_layers, num_slots, s.num_v_heads, s.k_head_dim, s.v_head_dim, dtype=torch.float32, device=device
        )

    def copy_layer(self, layer: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """copy() for one layer only (a layer writing a snapshot as it runs)."""
        for a, b in zip(src, dst, strict=True):
            self.conv[layer, b] = self.conv[layer, a]
            self.recurrent[layer, b] = self.recurrent[layer, a]

    def copy(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Slot src[i]'s state into slot dst[i], every layer (a snapshot taken, or resumed)."""
        assert len(src) == len(dst), "copy needs as many destinations as sources"
        if not len(src):
            return
        src_t = torch.as_tensor(src, dtype=torch.int64, device=self.conv.device)
        dst_t = torch.as_tensor(dst, dtype=torch.int64, device=self.conv.device)
        self.conv[:, dst_t] = self.conv[:, src_t]
        self.recurrent[:, dst_t] = self.recurrent[:, src_t]
