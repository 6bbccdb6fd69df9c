"""quants.stored_groups: each GGUF type's stored form (Int4Groups, Int5Groups, Int8Groups, Int4CodeGroups,
KQuantGroups, HalfWeights)
against gguf.quants.dequantize of the same bytes, bit for bit.

The int8 conversions and IQ4's codes are exact by construction, and checked so: IQ4_NL and IQ4_XS are
their codebook's int8 values (at their 4-bit codes) times d (IQ4_XS: d * (s - 32) per 32), MXFP4 its codes into
the e2m1 values doubled (integers) times 2^(e - 128) (half of the block's 2^(e - 127)), Q3_K (q - 4) in -4..3 times d * (s - 32) per 16: every
product is the float32 product ggml's dequantize_row_* forms, so q * scale equals the dequantization
exactly, not within a tolerance. Q6_K, Q3_K and Q2_K are stored as their codes (KQuantGroups: (d * sc) *
(q - z), Q2_K minus dmin * m, per 16); their int8 groups (int8_groups) stay exact too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.formats.quants import (
    HalfWeights,
    Int4CodeGroups,
    Int4Groups,
    Int5Groups,
    Int8Groups,
    KQuantGroups,
    cat_rows,
    dequantize,
    int8_groups,
    stored_groups,
)

T = GGMLQuantizationType

# byte offsets of each type's float16 scale fields (d, and dmin / m where there is one)
_F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
    T.Q6_K: [208], T.Q2_K: [80, 82], T.Q3_K: [108], T.IQ4_NL: [0], T.IQ4_XS: [0],
}  # fmt: skip
# type -> (stored form, its group size): what a kernel runs
_FORMS = {
    T.Q4_0: (Int4Groups, 32), T.Q4_1: (Int4Groups, 32), T.Q4_K: (Int4Groups, 32),
    T.Q5_0: (Int5Groups, 32), T.Q5_1: (Int5Groups, 32), T.Q5_K: (Int5Groups, 32),
    T.Q8_0: (Int8Groups, 32), T.Q6_K: (KQuantGroups, 16), T.Q3_K: (KQuantGroups, 16), T.Q2_K: (KQuantGroups, 16),
    T.IQ4_NL: (Int4CodeGroups, 32), T.IQ4_XS: (Int4CodeGroups, 32), T.MXFP4: (Int4CodeGroups, 32),
}  # fmt: skip


def random_blocks(qtype: T, num_blocks: int, seed: int) -> np.ndarray:
    """Random bytes of `qtype` blocks (num_blocks, type_size) uint8, with finite, moderate scales: the
    float16 fields in +-0.05 (K-quants' d and dmin positive), MXFP4's exponents in 2^-17 .. 2^8."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    for at in _F16_FIELDS.get(qtype, []):
        value = rng.uniform(-0.05, 0.05, num_blocks)
        if qtype in (T.Q4_K, T.Q5_K, T.Q2_K):
            value = np.abs(value)
        raw[:, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)
    if qtype == T.MXFP4:
        raw[:, 0] = rng.integers(110, 136, num_blocks)
    return raw


@pytest.mark.parametrize("qtype", list(_FORMS), ids=lambda t: t.name)
def test_each_stored_form_is_ggufs_dequantization_bit_for_bit(qtype: T) -> None:
    rows, cols = 6, 512
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows * cols // block_size, seed=int(qtype))
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(rows, cols))
    data = torch.from_numpy(raw.reshape(-1).copy())
    groups = stored_groups(data, qtype, (rows, cols))  # type: ignore[arg-type]
    form, group_size = _FORMS[qtype]
    assert isinstance(groups, form) and groups.group_size == group_size and groups.shape == (rows, cols)
    assert torch.equal(groups.dequantize(), want)
    assert torch.equal(dequantize(data, qtype, (rows, cols), torch.float32), want)  # type: ignore[arg-type]
    assert stored_groups(data, qtype, (rows * cols,)) is None  # type: ignore[arg-type]  # 1-D: not a matrix


@pytest.mark.parametrize(
    ("qtype", "values"),
    [
        (T.IQ4_NL, [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]),
        (T.IQ4_XS, [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]),
        (T.MXFP4, [-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12]),
        (T.Q3_K, [-4, -3, -2, -1, 0, 1, 2, 3]),
    ],
    ids=lambda v: v.name if isinstance(v, T) else "",
)
def test_int8_conversions_hold_the_types_own_integers(qtype: T, values: list[int]) -> None:
    """Each int8 form holds exactly its type's value set (doubled e2m1, q - 4), and IQ4's codes index
    exactly its codebook, so the q8b and iq4 kernels run the file's values and nothing rounded."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4096 // block_size, seed=1)
    data = torch.from_numpy(raw.reshape(-1).copy())
    groups = (int8_groups if qtype == T.Q3_K else stored_groups)(data, qtype, (16, 256))  # type: ignore[arg-type]
    if qtype in (T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        assert isinstance(groups, Int4CodeGroups) and groups.q.dtype == torch.uint8
        assert groups.codebook == ("mxfp4" if qtype == T.MXFP4 else "iq4nl")
        assert sorted(groups.q.unique().tolist()) == list(range(16))
        assert sorted(groups.values[groups.q.long()].unique().tolist()) == values
        return
    assert isinstance(groups, Int8Groups) and groups.q.dtype == torch.int8
    assert sorted(groups.q.unique().tolist()) == values


def test_mxfp4_from_ggufs_quantizer_and_its_tiny_exponents() -> None:
    """MXFP4 written by gguf's own quantizer (gpt-oss's experts), and the exponents whose scale is a
    subnormal float32 (e < 2: 2^(e - 128) below 2^-126): still exact."""
    w = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 0.3).numpy()
    raw = gguf_quantize(w, T.MXFP4)
    raw[0, 0], raw[1, 0] = 0, 1  # row 0 and 1's first block: e = 0, 1
    data = torch.from_numpy(raw.reshape(-1).copy())
    groups = stored_groups(data, T.MXFP4, (8, 256))  # type: ignore[arg-type]
    assert isinstance(groups, Int4CodeGroups) and groups.codebook == "mxfp4"
    assert torch.equal(groups.dequantize(), torch.from_numpy(gguf_dequantize(raw, T.MXFP4).reshape(8, 256)))
    assert float(groups.scale[0, 0]) == 2.0**-128 and float(groups.scale[1, 0]) == 2.0**-127


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_16bit_weights_are_kept_as_a_view_of_the_file(qtype: T) -> None:
    w = (torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 0.1).numpy()
    raw = torch.from_numpy(gguf_quantize(w, qtype).reshape(-1).copy()).view(torch.uint8)
    halves = stored_groups(raw, qtype, (5, 40))  # type: ignore[arg-type]
    assert isinstance(halves, HalfWeights) and halves.values.data_ptr() == raw.data_ptr()  # no copy
    want = torch.from_numpy(gguf_dequantize(gguf_quantize(w, qtype), qtype).reshape(5, 40))
    assert torch.equal(halves.dequantize(), want)


@pytest.mark.parametrize(
    ("qtype", "bits"), [(T.Q6_K, 6), (T.Q3_K, 3), (T.Q2_K, 2)], ids=["Q6_K", "Q3_K", "Q2_K"]
)
def test_k_quant_codes_are_the_files_own_and_int8_groups_stay_exact(qtype: T, bits: int) -> None:
    """KQuantGroups hold every code of `bits` bits (nothing widened) and the int8 sub-scales; Q6_K's and
    Q3_K's int8 groups of 16 (int8_groups: q - z, d * sc) are the same weight bit for bit."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 8192 // block_size, seed=3)
    data = torch.from_numpy(raw.reshape(-1).copy())
    groups = stored_groups(data, qtype, (16, 512))  # type: ignore[arg-type]
    assert isinstance(groups, KQuantGroups) and groups.bits == bits
    assert groups.q.dtype == torch.uint8 and sorted(groups.q.unique().tolist()) == list(range(2**bits))
    assert groups.sub_scale.shape == (16, 32) and groups.d.shape == (16, 2)
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(16, 512))
    assert torch.equal(groups.dequantize(), want)
    assert torch.equal(groups.select_rows(slice(3, 9)).dequantize(), want[3:9])
    if qtype != T.Q2_K:
        as_int8 = int8_groups(data, qtype, (16, 512))  # type: ignore[arg-type]
        assert isinstance(as_int8, Int8Groups) and torch.equal(as_int8.dequantize(), want)


def test_rows_of_one_form_stack_and_of_two_forms_do_not() -> None:
    """cat_rows (fused q/k/v, gate/up): one form stacks to exactly the stacked dequantizations; two forms
    (another container, group size or dtype) are None: those run part by part."""
    a = stored_groups(torch.from_numpy(random_blocks(T.Q5_0, 16, 3).reshape(-1).copy()), T.Q5_0, (4, 128))  # type: ignore[arg-type]
    b = stored_groups(torch.from_numpy(random_blocks(T.Q5_K, 2, 4).reshape(-1).copy()), T.Q5_K, (2, 256))  # type: ignore[arg-type]
    c = stored_groups(torch.from_numpy(random_blocks(T.Q6_K, 1, 5).reshape(-1).copy()), T.Q6_K, (1, 256))  # type: ignore[arg-type]
    d = stored_groups(torch.from_numpy(random_blocks(T.Q8_0, 8, 6).reshape(-1).copy()), T.Q8_0, (1, 256))  # type: ignore[arg-type]
    assert a is not None and b is not None and c is not None and d is not None
    both = cat_rows([a, a.select_rows(torch.tensor([3, 0]))])
    assert isinstance(both, Int5Groups)
    assert torch.equal(both.dequantize(), torch.cat((a.dequantize(), a.dequantize()[[3, 0]])))
    assert cat_rows([c, d]) is None  # int8 groups of 16 beside groups of 32
    assert cat_rows([b, c]) is None
    q3 = stored_groups(torch.from_numpy(random_blocks(T.Q3_K, 1, 7).reshape(-1).copy()), T.Q3_K, (1, 256))  # type: ignore[arg-type]
    assert q3 is not None and cat_rows([c, q3]) is None  # 6-bit codes beside 3-bit ones
    sixes = cat_rows([c, c])
    assert isinstance(sixes, KQuantGroups) and torch.equal(sixes.dequantize(), c.dequantize().repeat(2, 1))
    f16 = HalfWeights(torch.ones(2, 8, dtype=torch.float16))
    assert cat_rows([f16, HalfWeights(torch.ones(2, 8, dtype=torch.bfloat16))]) is None
    assert isinstance(cat_rows([f16, f16]), HalfWeights)
