"""StoredEmbedding (kernels/cpu/fast_embedding.py): a token embedding kept as the checkpoint's int8 or 4-bit
groups, its rows dequantized on lookup in C. Every row must equal the GGUF dequantization of the same
bytes bit for bit (the float32 table it replaces); an id outside the table is an IndexError."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from onecall.formats.checkpoint import load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.formats.quants import Int8Groups, dequantize, int4_groups, int8_groups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import compact_scales
from onecall.loading import packing, weights
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from tests.helpers import stored_models
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf
from tests.kernels.test_fast_linear import _q6_k_blocks, _random_blocks
from tests.kernels.test_native_step import BLOCK, PROMPT_LENS, _decode, _prefill, _scrambled_tables

pytestmark = pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
T = GGMLQuantizationType


@pytest.mark.parametrize(("qtype", "cols"), [(T.Q8_0, 96), (T.Q6_K, 512)], ids=["Q8_0", "Q6_K"])
def test_rows_are_the_dequantized_table_bit_for_bit(qtype: T, cols: int) -> None:
    rows = 45  # not a whole number of 16-row units: the layout's padding rows are never read
    if qtype == T.Q8_0:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.05
        raw = torch.from_numpy(quantize(w.numpy(), qtype)).view(torch.uint8).reshape(-1)
    else:  # gguf's quantize has no Q6_K: random blocks, as test_fast_linear makes them
        raw = _q6_k_blocks(rows * cols // 256, np.random.default_rng(0))
    groups = int8_groups(raw, qtype, (rows, cols))
    assert groups is not None and groups.group_size == (16 if qtype == T.Q6_K else 32)
    table = dequantize(raw, qtype, (rows, cols), torch.float32)
    embed = StoredEmbedding(native.pack_q8_blocked(groups.q, groups.scale, groups.group_size))
    assert torch.equal(embed(torch.arange(rows)), table)
    ids = torch.tensor([[44, 0, 7], [7, 16, 15]])  # any shape, repeats, the edges of a unit
    assert torch.equal(embed(ids), table[ids])
    for bad in (-1, rows):
        with pytest.raises(IndexError, match=f"{rows} rows"):
            embed(torch.tensor([3, bad]))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_4bit_rows_are_the_dequantized_table_bit_for_bit(qtype: T) -> None:
    rows, cols = 37, 256
    block_cols = 256 if qtype == T.Q4_K else 32
    raw = _random_blocks(qtype, rows * cols // block_cols, np.random.default_rng(1))
    groups = int4_groups(raw, qtype, (rows, cols))
    assert groups is not None and groups.group_size == 32
    table = dequantize(raw, qtype, (rows, cols), torch.float32)
    # the scales as the logits head packs them (float16 where that is exact), then float32
    for scale, offset in (compact_scales(groups.scale, groups.offset), (groups.scale, groups.offset)):
        embed = StoredEmbedding(native.pack_q4(groups.q, scale, offset))
        assert torch.equal(embed(torch.arange(rows)), table)
        ids = torch.tensor([[36, 0], [5, 5]])
        assert torch.equal(embed(ids), table[ids])
        with pytest.raises(IndexError, match=f"{rows} rows"):
            embed(torch.tensor([rows]))



@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_a_gguf_keeps_its_embedding_as_stored(
    qtype: T, tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tied: the lookup reads the logits head's own bytes (q8b for int8 groups, q4 for 4-bit ones).
    Untied: a packed copy of the embedding's groups; the head keeps the output matrix's (and that
    float32 matrix is never made either). No float32 table is ever allocated, the rows are the float32
    model's, and the native decode step gives the per-op path's bits."""
    config = tiny_hf_config("qwen3", tie_word_embeddings=tied)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=2), config, weight_type=qtype)
    ref = stored_models.load(path, fast=False)
    bare = DecoderLM(model_config_from_hf(load_hf_config_dict(resolve_model(path))), kernels="fast")
    assert bare.model.embed_tokens.weight.is_meta  # built without the table: the loader decides
    with monkeypatch.context() as m:
        m.setattr(weights, "materialize_weight", _never)
        fast = stored_models.load(path, fast=True)
    embed, head = fast.model.embed_tokens, fast.fast_lm_head
    assert isinstance(embed, StoredEmbedding) and head is not None
    assert isinstance(embed.table, native.Q8Blocked if qtype == T.Q8_0 else native.Q4Packed)
    assert head.from_stored and (embed.table is (head.q8 or head.q4)) == tied
    assert head.kernel == ("native q8" if qtype == T.Q8_0 else "native q4")
    if not tied:  # the untied head's groups are the head: no float32 matrix either
        assert fast.lm_head is not None and fast.lm_head.weight.is_meta
    assert "model.embed_tokens.weight" not in dict(fast.named_parameters())
    ids = torch.arange(config["vocab_size"])
    ref_embed = ref.model.embed_tokens
    assert isinstance(ref_embed, torch.nn.Embedding)
    assert torch.equal(embed(ids), ref_embed(ids))
    if tied:
        with pytest.raises(RuntimeError, match="checkpoint's groups"):
            fast.output_weight()
    # the native decode step gathers from the same table in C
    step = fast.native_step
    assert step is not None
    c = fast.config
    cache = PagedKVCache(
        c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
    )
    cache.k.zero_(), cache.v.zero_()
    tables = _scrambled_tables(40)
    _prefill(fast, cache, tables)
    lens = [n + 1 for n in PROMPT_LENS]
    per_op_cache = copy.deepcopy(cache)
    got = _decode(fast, cache, tables, lens)
    fast.native_step = None
    want = _decode(fast, per_op_cache, tables, lens)
    assert torch.equal(got, want)


def _never(model: DecoderLM, module: torch.nn.Module) -> None:
    raise AssertionError(f"a float32 weight was allocated: {module}")


def test_an_embedding_in_other_types_stays_float32(tmp_path: Path) -> None:
    """An F32 embedding has no stored form (quants.stored_groups): the loader fills the float32 table."""
    config = tiny_hf_config("qwen3", tie_word_embeddings=True)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=2), config, weight_type=T.F32)
    fast, ref = stored_models.load(path, fast=True), stored_models.load(path, fast=False)
    embed, ref_embed = fast.model.embed_tokens, ref.model.embed_tokens
    assert isinstance(embed, torch.nn.Embedding) and isinstance(ref_embed, torch.nn.Embedding)
    assert torch.equal(embed.weight, ref_embed.weight)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.BF16], ids=lambda t: t.name)
def test_a_5bit_or_16bit_embedding_is_kept_as_stored(tmp_path: Path, qtype: T) -> None:
    """A Q5_0 (5-bit groups) or BF16 (16-bit floats) tied embedding is looked up in the logits head's
    own bytes, each row the float32 table's bit for bit, and the native decode step (which looks these
    tables up before its one call) gives the per-op path's bits."""
    config = tiny_hf_config("qwen3", tie_word_embeddings=True)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=2), config, weight_type=qtype)
    fast, ref = stored_models.load(path, fast=True), stored_models.load(path, fast=False)
    embed, head = fast.model.embed_tokens, fast.fast_lm_head
    assert isinstance(embed, StoredEmbedding) and head is not None and embed.table is head.table
    ids = torch.arange(config["vocab_size"])
    assert torch.equal(embed(ids), ref.model.embed_tokens(ids))
    assert fast.native_step is not None, fast.kernels
    c = fast.config
    cache = PagedKVCache(c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    cache.k.zero_(), cache.v.zero_()
    tables = _scrambled_tables(40)
    _prefill(fast, cache, tables)
    lens = [n + 1 for n in PROMPT_LENS]
    per_op_cache = copy.deepcopy(cache)
    got = _decode(fast, cache, tables, lens)
    fast.native_step = None
    assert torch.equal(got, _decode(fast, per_op_cache, tables, lens))
    assert torch.equal(cache.k, per_op_cache.k) and torch.equal(cache.v, per_op_cache.v)


def test_groups_no_stored_embedding_takes_are_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader leaves the table on meta only for groups a StoredEmbedding takes (one rule:
    packing.stays_stored over fast_linear.runs_stored_only). Should that ever break, install raises
    rather than leaving a model without an embedding."""
    config = tiny_hf_config("qwen3", tie_word_embeddings=True)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=2), config, weight_type=T.Q8_0)
    monkeypatch.setattr(packing, "_stored_embedding", lambda model, stored: None)
    with pytest.raises(RuntimeError, match="embed_tokens"):
        stored_models.load(path, fast=True)


def test_a_meta_output_weight_needs_groups_the_kernels_run() -> None:
    """FastLMHead over a weight the loader never made (meta) must take the stored groups as they are;
    groups it cannot run are a clear error, not a failure deep inside a meta tensor."""
    from onecall.kernels.cpu.fast_linear import FastLMHead

    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    head = FastLMHead(torch.empty(64, 64, device="meta"), _int8(w, 32))
    assert head.from_stored and head.q8 is not None
    with pytest.raises(ValueError, match="stored groups"):  # groups of 64: no native kernel runs them
        FastLMHead(torch.empty(64, 64, device="meta"), _int8(w, 64))


def _int8(w: torch.Tensor, group: int) -> Int8Groups:
    groups = w.view(w.shape[0], -1, group)
    scale = groups.abs().amax(-1) / 127
    q = torch.round(groups / scale.unsqueeze(-1)).to(torch.int8).view_as(w)
    return Int8Groups(q, scale, group_size=group)
