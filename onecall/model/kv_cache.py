"""PagedKVCache: the K and V tensors of every layer, carved into fixed-size blocks.

The cache is a flat array of slots per layer; slot s = block * block_size + offset
holds the K (and V) of one token position of one sequence. Which blocks belong
to which sequence is the engine's bookkeeping (block tables); this class only
owns the memory and the two tensor operations on it (write happens in
`paged_attention`, copy-on-write in `copy_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from onecall.model.state_cache import LinearStateCache


class PagedKVCache:
    """K and V for every layer in fixed-size blocks. Slot s = block * block_size + offset."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        assert num_layers > 0 and num_blocks > 0 and block_size > 0, "cache dimensions must be positive"
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # Uninitialised, except slot 0. Invariant: attention only reads slots a sequence has
        # written (its own positions, or copied/shared prefix slots) plus slot 0, which batched
        # decode uses as padding under a mask. A masked NaN would still poison the output
        # (0 * NaN), so slot 0 must hold finite values; it is zeroed here. Zeroing the whole
        # pool instead cost 0.5 s of cold start per GiB.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (layers, slots, kv_heads, head_dim)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()
        # A hybrid model's linear-attention layers' states (model/state_cache.py); its full-attention
        # layers alone have K and V here (num_layers counts those)
        self.state: LinearStateCache | None = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers, K and V together."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of slot src[i] to slot dst[i] in every layer (copy-on-write of a shared block)."""
        assert len(src) == len(dst), "copy_slots needs as many destinations as sources"
        if not len(src):
            return
        src_t = torch.as_tensor(src, dtype=torch.int64, device=self.k.device)
        dst_t = torch.as_tensor(dst, dtype=torch.int64, device=self.k.device)
        # The right-hand side is gathered into a new tensor first, so overlapping src/dst is safe.
        self.k[:, dst_t] = self.k[:, src_t]
        self.v[:, dst_t] = self.v[:, src_t]
