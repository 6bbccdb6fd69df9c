"""Plain Q6_K, Q3_K and Q2_K quantizers (the `gguf` package has none): valid blocks of given weights in
ggml's byte layouts (ggml-common.h's block_q6_K, block_q3_K, block_q2_K), for tests that write GGUF files
of those types. Not llama.cpp's search for the best scales: one absmax (Q2_K: min and range) per 16
values, the sub-scales rounded to the super-block's d. `quantize` is make_models.quantize's signature
(gguf.quants.quantize for every other type), so a test can monkeypatch it in.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

T = GGMLQuantizationType


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 and back (what a block's d holds)."""
    return x.astype(np.float16).astype(np.float32)


def _d_and_sub(step: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block (n, 16) steps -> (d (n, 1) float16 values, sub-scales (n, 16) ints in -top..top)
    with d * sub close to step."""
    d = _f16(np.maximum(np.abs(step).max(-1, keepdims=True) / top, 1e-8))
    return d, np.clip(np.round(step / d), -top, top)


def _codes(x: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(x / scale) per 16 in lo..hi (0 where the scale is 0)."""
    safe = np.where(scale == 0, 1, scale)
    return np.where(scale == 0, 0, np.clip(np.round(x / safe), lo, hi)).astype(np.int32)


def q6_k(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, 210 * cols / 256) uint8: w ~ d * sc * (q - 32) per 16."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    d, sc = _d_and_sub(np.abs(x).max(-1) / 31, 127)
    q = (_codes(x, (d * sc)[..., None], -32, 31) + 32).reshape(-1, 2, 4, 32)  # (n, half, k, l)
    ql = np.concatenate([q[:, :, 0] | (q[:, :, 2] << 4), q[:, :, 1] | (q[:, :, 3] << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8),
         sc.astype(np.int8).view(np.uint8), d.astype(np.float16).view(np.uint8)], axis=1,
    )  # fmt: skip
    return blocks.reshape(rows, -1)


def q3_k(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, 110 * cols / 256) uint8: w ~ d * (s - 32) * (q - 4) per 16."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    d, sub = _d_and_sub(np.abs(x).max(-1) / 3, 31)
    q = (_codes(x, (d * sub)[..., None], -4, 3) + 4).reshape(-1, 256)
    s = (sub + 32).astype(np.int32)  # 6 bits
    e = np.arange(256)
    hmask = np.zeros((q.shape[0], 32), dtype=np.int32)  # bit e // 32 of hmask[e % 32]: q's bit 2
    qs = np.zeros((q.shape[0], 64), dtype=np.int32)  # element 128h + 32s + l: bits 2s of qs[32h + l]
    for i in e:
        hmask[:, i % 32] |= (q[:, i] >> 2) << (i // 32)
        qs[:, 32 * (i // 128) + i % 32] |= (q[:, i] & 3) << (2 * ((i % 128) // 32))
    scales = np.zeros((q.shape[0], 12), dtype=np.int32)
    scales[:, :8] = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    for i in range(16):  # scale i's top 2 bits: bits 2 (i // 4) of byte 8 + i % 4
        scales[:, 8 + i % 4] |= (s[:, i] >> 4) << (2 * (i // 4))
    blocks = np.concatenate(
        [
            hmask.astype(np.uint8),
            qs.astype(np.uint8),
            scales.astype(np.uint8),
            d.astype(np.float16).view(np.uint8),
        ],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def q2_k(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, 84 * cols / 256) uint8: w ~ d * sc * q - dmin * m per 16, q 0..3."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    lo = np.minimum(x.min(-1), 0)
    d = _f16(np.maximum((x.max(-1) - lo).max(-1, keepdims=True) / 3 / 15, 1e-8))
    dmin = _f16(np.maximum(-lo.min(-1, keepdims=True) / 15, 1e-8))
    sc = np.clip(np.ceil((x.max(-1) - lo) / 3 / d), 0, 15).astype(np.int32)
    m = np.clip(np.round(-lo / dmin), 0, 15).astype(np.int32)
    q = _codes(x + (dmin * m)[..., None], (d * sc)[..., None], 0, 3).reshape(-1, 256)
    qs = np.zeros((q.shape[0], 64), dtype=np.int32)
    for i in range(256):  # element 128h + 32s + l: bits 2s of qs[32h + l]
        qs[:, 32 * (i // 128) + i % 32] |= q[:, i] << (2 * ((i % 128) // 32))
    blocks = np.concatenate(
        [(sc | (m << 4)).astype(np.uint8), qs.astype(np.uint8), d.astype(np.float16).view(np.uint8),
         dmin.astype(np.float16).view(np.uint8)], axis=1,
    )  # fmt: skip
    return blocks.reshape(rows, -1)


_K = {T.Q6_K: q6_k, T.Q3_K: q3_k, T.Q2_K: q2_k}


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """gguf.quants.quantize, with the plain quantizers above for Q6_K, Q3_K and Q2_K."""
    return _K[qtype](w) if qtype in _K else gguf_quantize(w, qtype)
