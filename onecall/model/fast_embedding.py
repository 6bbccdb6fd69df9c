"""StoredEmbedding: a token embedding kept as the checkpoint stored it, int8 groups (GGUF Q8_0, Q6_K) or
4-bit groups of 32 (Q4_0, Q4_1, Q4_K), its rows dequantized on lookup by the native kernels
(csrc/embedding.c) instead of held as a float32 table.

A float32 copy of the embedding is the largest single tensor of many models: 113 MB of the embedded
SmolLM2-135M's ~750 MB resident, 2.5 GB for a 151,936 x 4,096 vocabulary. When the embedding is tied
(the logits projection is the same matrix) and int8, the lookup reads the logits kernel's own q8b bytes,
so the table costs nothing beyond what the logits already hold; an untied one is packed once (int8: the
q8b layout, a quarter of float32's bytes; 4-bit: row by row, two columns a byte, under a fifth). A
looked-up row is the float32 value the GGUF dequantization gives, to the bit (float(q) * scale, or
float(q) * scale + offset): tests/test_fast_embedding.py checks it against the dequantized table.

packing.install puts one in place of the model's nn.Embedding on CPU with the native kernels when the
checkpoint stored the embedding in such groups (one process, not tensor parallel; a tied 4-bit
embedding stays float32, since its logits head needs the float32 matrix: packing.stays_stored);
otherwise the float32 nn.Embedding stays. A model packed on load never allocates the float32 table in
that case (weights.load_weights leaves it on meta and fills it only where it cannot stay stored), so the
table costs neither steady-state nor peak memory. The module has no `weight`: code that needs the
float32 matrix (a logits projection without the native head) never meets one, since it is installed
only beside a native int8 logits head or for an untied embedding (DecoderLM.output_weight says so if
asked).
"""

from __future__ import annotations

import torch
from torch import nn

from onecall.model import native


class StoredEmbedding(nn.Module):
    """Token ids -> float32 rows of a table kept as stored: int8 groups in the q8b layout
    (native.Q8Blocked) or 4-bit rows (native.Int4Rows)."""

    def __init__(self, table: native.Q8Blocked | native.Int4Rows) -> None:
        super().__init__()
        lib = native.load()
        assert lib is not None, "StoredEmbedding needs the native kernels"
        self._lib = lib
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def device(self) -> torch.device:
        return self.table.qs.device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, native.Int4Rows):
            return native.q4_rows(self._lib, self.table, input_ids)
        return native.q8_blocked_rows(self._lib, self.table, input_ids)

    def extra_repr(self) -> str:
        t = self.table
        kind = f"int8 groups of {t.group_size}" if isinstance(t, native.Q8Blocked) else "4-bit groups of 32"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} ({t.nbytes / 1e6:.1f} MB)"
