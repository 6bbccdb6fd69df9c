"""StoredEmbedding: a token embedding kept as the checkpoint stored it (any form of quants.py's table:
4-bit or 5-bit groups, int8 groups, IQ4 codes, K-quant codes, 16-bit floats), its rows dequantized on lookup by the
native kernels (csrc/embedding.c, gemm_q5.c, gemm_kq.c; a widening gather for 16-bit floats) instead of held as a float32 table,
in the layout the logits kernels read.

A float32 copy of the embedding is the largest single tensor of many models: 113 MB of the embedded
SmolLM2-135M's ~750 MB resident, 2.5 GB for a 151,936 x 4,096 vocabulary. When the embedding is tied
(the logits projection is the same matrix) the lookup reads the logits head's own bytes (FastLMHead:
the q8b layout for int8 groups, the q4 / q5 layouts for 4-bit / 5-bit ones, h16 for 16-bit floats), so
the table costs nothing beyond what the logits already hold; an untied one is packed once in the same
layouts (int8: under a third of float32's bytes; 4-bit: under a fifth). A looked-up row is the float32
value the GGUF dequantization gives, to the bit (float(q) * scale, or float(q) * scale + offset, or the
16-bit value widened): tests/kernels/test_fast_embedding.py and test_quant_kernels.py check it against
the dequantized table.

packing.install puts one in place of the model's nn.Embedding on CPU with the native kernels when the
checkpoint stored the embedding in such groups (one process, not tensor parallel:
packing.stays_stored); otherwise the float32 nn.Embedding stays. A model packed on load never allocates the float32 table in
that case (weights.load_weights leaves it on meta and fills it only where it cannot stay stored), so the
table costs neither steady-state nor peak memory. The module has no `weight`: code that needs the
float32 matrix (a logits projection without the native head) never meets one, since a tied one is
installed only beside a native logits head on the same groups (DecoderLM.output_weight says so if
asked).
"""

from __future__ import annotations

import torch
from torch import nn

from onecall.kernels.cpu import native


class StoredEmbedding(nn.Module):
    """Token ids -> float32 rows of a table kept as stored, in its kernel's layout (native.Packed: int8
    groups in q8b's, 4-bit groups in q4's, 5-bit in q5's, 16-bit floats in h16's)."""

    def __init__(self, table: native.Packed) -> None:
        super().__init__()
        lib = native.load()
        assert lib is not None, "StoredEmbedding needs the native kernels"
        assert not (isinstance(table, native.Q4Packed) and table.act8), "rows are read from the q4 layout"
        self._lib = lib
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the native kernels' tables live in CPU memory

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return native.rows(self._lib, self.table, input_ids)

    def extra_repr(self) -> str:
        t = self.table
        kind = f"int8 groups of {t.group_size}" if isinstance(t, native.Q8Blocked) else native.kind(t)
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} ({t.nbytes / 1e6:.1f} MB)"
