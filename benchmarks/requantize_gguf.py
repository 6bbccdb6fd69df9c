"""Rewrite a GGUF with its 2-D weights in another quantization type, to benchmark other types' paths.

    python benchmarks/requantize_gguf.py /tmp/smollm2-q8_0.gguf --type Q8_0
    python benchmarks/bench_engine.py --model /tmp/smollm2-q8_0.gguf --only onecall,llamacpp

The source (default: the embedded SmolLM2 Q4_1) is dequantized by onecall's own dequantizer and
quantized again by the gguf package's reference quantizer (llama.cpp's numpy port); every metadata
key (tokenizer, chat template, hyperparameters) is copied as it is. Only the types gguf.quants can
write are offered. Requantizing a 4-bit file does not recover the original model's quality: this is
for measuring speed, not for serving.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from onecall.formats.checkpoint import resolve_model
from onecall.formats.quants import dequantize

_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q8_0", choices=_TYPES)
    ap.add_argument("--model", default=None, help="source GGUF (default: the embedded model)")
    a = ap.parse_args()
    src = resolve_model(a.model).path
    target = GGMLQuantizationType[a.type]
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(a.out), arch)
    # 1. metadata, as stored (the writer adds the architecture and the GGUF.* fields itself)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    # 2. tensors: 2-D weights requantized, the rest (norms) copied
    import torch

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # torch order
        raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8).copy())
        values = dequantize(raw, t.tensor_type, shape, torch.float32).numpy()
        if len(shape) == 2 and shape[1] % 32 == 0:
            writer.add_tensor(t.name, quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.0f} MB, {a.type})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
