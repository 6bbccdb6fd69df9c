"""Int8Embedding: a token embedding kept as the checkpoint stored it, int8 groups (GGUF Q8_0 or Q6_K),
its rows dequantized on lookup by the native kernels (csrc/embedding.c) instead of held as a float32
table.

A float32 copy of the embedding is the largest single tensor of many models: 113 MB of the embedded
SmolLM2-135M's ~750 MB resident, 2.5 GB for a 151,936 x 4,096 vocabulary. When the embedding is tied
(the logits projection is the same matrix) the lookup reads the logits kernel's own q8b bytes, so the
table costs nothing beyond what the logits already hold; an untied one is packed once in the same layout
(a quarter of float32's bytes). A looked-up row is float(q) * scale in float32: the same bits as the
dequantized table (tests/test_fast_embedding.py checks it against the float32 embedding of the same file).

packing.install puts one in place of the model's nn.Embedding on CPU with the native kernels when the
checkpoint stored the embedding as int8 groups (one process, not tensor parallel: packing.
stays_int8); otherwise the float32 nn.Embedding stays. A model packed on load never allocates
the float32 table in that case (weights.load_weights leaves it on meta and fills it only where it cannot
stay int8), so the table costs neither steady-state nor peak memory. The module has no `weight`: code
that needs the float32 matrix (a logits projection without the native head) never meets one, since it
is installed only beside a native int8 logits head or for an untied embedding (DecoderLM.output_weight
says so if asked).
"""

from __future__ import annotations

import torch
from torch import nn

from onecall.model import native


class Int8Embedding(nn.Module):
    """Token ids -> float32 rows of an int8 table in the q8b layout (native.Q8Blocked)."""

    def __init__(self, table: native.Q8Blocked) -> None:
        super().__init__()
        lib = native.load()
        assert lib is not None, "Int8Embedding needs the native kernels"
        self._lib = lib
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def device(self) -> torch.device:
        return self.table.qs.device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return native.q8_blocked_rows(self._lib, self.table, input_ids)

    def extra_repr(self) -> str:
        t = self.table
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 groups of {t.group_size} ({t.nbytes / 1e6:.1f} MB)"
