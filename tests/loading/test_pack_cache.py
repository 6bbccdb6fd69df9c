"""loading/pack_cache.py: a GGUF's packed weights written after a first load, mapped back on the next.

Each test loads a tiny quantized GGUF the way the engine does (engine_parts.load_model_cached) with
ONECALL_PACK_CACHE_DIR in tmp_path, and holds a load from the cache against one that packed: the same
logits to the bit (the same kernels on the same bytes: tolerance 0; for the hybrids, every
projection's, the head's and the embedding's output), and against the float64 reference forward of
the dequantized file (loose, as the int16-activation kernels round: 5e-2 of the largest logit).
A second load must not decode a weight matrix or pack anything (both are made to fail the test), a
damaged or foreign cache file must be ignored with a PackCacheWarning and rewritten, and a file with
other bytes must miss.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

from onecall.config import EngineConfig
from onecall.engine.engine_parts import load_model_cached
from onecall.formats import gguf
from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_linear import FastLinear
from onecall.loading import pack_cache
from onecall.loading.pack_cache import PackCacheWarning
from onecall.loading.weights import load_weights
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf
from tests.kernels.test_native_step import BLOCK, PROMPT_LENS, _decode, _prefill, _scrambled_tables

pytestmark = pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
T = GGMLQuantizationType


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ONECALL_PACK_CACHE_DIR", str(tmp_path / "packed"))
    monkeypatch.setenv("ONECALL_PACK_CACHE", "1")
    monkeypatch.delenv("ONECALL_PACK_CACHE_GIB", raising=False)
    # The tests hold what is cached, not how full this machine's disk is (a CI runner's may keep
    # under the headroom the cache leaves): a roomy disk here, a nearly full one in its own test.
    roomy = SimpleNamespace(total=100 * 2**30, used=10 * 2**30, free=90 * 2**30)
    monkeypatch.setattr(pack_cache.shutil, "disk_usage", lambda _: roomy)
    return tmp_path / "packed"


def _gguf(
    tmp_path: Path, arch: str, qtype: T, seed: int = 2, name: str = "m.gguf", **overrides: object
) -> Path:
    config = tiny_hf_config(arch, **overrides)
    return write_tiny_gguf(tmp_path / name, random_state_dict(config, seed=seed), config, weight_type=qtype)


def _load(path: Path, act8: bool = False) -> tuple[DecoderLM, str]:
    files = resolve_model(path)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", int8_activations=act8)
    mc = model_config_from_hf(load_hf_config_dict(files))
    return load_model_cached(config, files, mc, torch.float32, torch.device("cpu"))


def _logits(model: DecoderLM, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A prefill of three sequences then one decode step of each, through the model's own layers."""
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, dtype, "cpu")
    cache.k.zero_(), cache.v.zero_()
    tables = _scrambled_tables(40)
    _prefill(model, cache, tables)
    hidden = _decode(model, cache, tables, [n + 1 for n in PROMPT_LENS])
    with torch.inference_mode():
        return model.compute_logits(hidden)


def _reference_logits(path: Path) -> torch.Tensor:
    """The same step on torch's reference layers over the file's dequantized weights, in float64."""
    files = resolve_model(path)
    config = model_config_from_hf(load_hf_config_dict(files))
    model = DecoderLM(config, dtype=torch.float64, kernels="reference")
    load_weights(model, iter_weights(files, torch.float64))
    return _logits(model.eval(), torch.float64).float()


def _no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any packing or stored-group decoding from here on fails the test."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("packed or decoded although the cache had it")

    def no_matrices(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> object:
        assert len(shape) == 1, "a weight matrix was decoded although the cache had it"
        return decode(raw, qtype, shape)  # a norm or a bias: the cache does not hold those

    for fn in ("pack_q4", "pack_q5", "pack_q8_blocked", "pack_iq4", "pack_half"):
        monkeypatch.setattr(native, fn, never)
    decode = gguf.stored_groups
    monkeypatch.setattr(gguf, "stored_groups", no_matrices)


@pytest.mark.parametrize(
    ("arch", "qtype", "act8"),
    [
        ("qwen2", T.Q4_0, False),  # tied: the embedding reads the head's table; q/k/v biases
        ("llama", T.Q8_0, False),  # untied: the embedding's own table; q/k rows un-permuted
        ("qwen3", T.Q5_0, False),  # 5-bit groups, q/k norms
        ("qwen2", T.Q4_1, True),  # 4-bit groups in the int8-activation layout
        ("qwen3", T.MXFP4, False),  # 4-bit codes that record their codebook (MXFP4's, not IQ4's)
    ],
)
def test_second_load_maps_the_cache_and_gives_the_same_logits(
    arch: str, qtype: T, act8: bool, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gguf(tmp_path, arch, qtype)
    first, status = _load(path, act8)
    assert status == "written"
    assert len(list(cache_dir.glob("*.ocpack"))) == 1
    want = _logits(first)
    with monkeypatch.context() as m:
        _no_packing(m)
        second, status = _load(path, act8)
    assert status == "hit"
    assert second.kernels == first.kernels
    assert second.native_step is not None
    got = _logits(second)
    assert torch.equal(got, want)  # the same kernels on the same bytes
    ref = _reference_logits(path)
    assert (got - ref).abs().max() <= 5e-2 * ref.abs().max()


def test_a_corrupt_or_foreign_cache_file_is_ignored(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gguf(tmp_path, "qwen2", T.Q4_0)
    first, _ = _load(path)
    want = _logits(first)
    (cached,) = cache_dir.glob("*.ocpack")
    good = cached.read_bytes()
    other = _gguf(tmp_path, "qwen2", T.Q8_0, name="other.gguf")
    _load(other)
    (foreign,) = set(cache_dir.glob("*.ocpack")) - {cached}
    damaged = {
        "truncated": good[: len(good) - 100],
        "another file's key": foreign.read_bytes(),
        "zeroed data": good[: len(good) // 2] + bytes(len(good) - len(good) // 2),
        "not a cache file": b"garbage" * 10,
    }
    for what, data in damaged.items():
        cached.write_bytes(data)
        with pytest.warns(PackCacheWarning, match="ignoring the pack cache file"):
            model, status = _load(path)
        assert status == "written", what  # packed again, and the file rewritten
        assert torch.equal(_logits(model), want), what
        assert cached.read_bytes() == good, what


def test_a_changed_file_misses(tmp_path: Path, cache_dir: Path) -> None:
    path = _gguf(tmp_path, "qwen2", T.Q4_0, seed=2)
    _load(path)
    path.write_bytes(_gguf(tmp_path, "qwen2", T.Q4_0, seed=3, name="next.gguf").read_bytes())
    model, status = _load(path)
    assert status == "written"  # other bytes (same size), another key
    assert len(list(cache_dir.glob("*.ocpack"))) == 2
    assert torch.equal(_logits(model), _logits(_load(tmp_path / "next.gguf")[0]))


def test_off_or_uncacheable_writes_nothing(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gguf(tmp_path, "qwen2", T.Q4_0)
    monkeypatch.setenv("ONECALL_PACK_CACHE", "0")
    assert _load(path)[1] == "off"
    monkeypatch.setenv("ONECALL_PACK_CACHE", "1")
    f32 = _gguf(tmp_path, "qwen2", T.F32, name="f32.gguf")  # float32 projections: oneDNN, opaque
    status = _load(f32)[1]
    assert status.startswith("not cached: ")
    assert not cache_dir.exists() or not list(cache_dir.glob("*.ocpack"))


def test_the_folder_keeps_to_its_bound(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _gguf(tmp_path, "qwen2", T.Q4_0, name="a.gguf")
    _load(first)
    (old,) = cache_dir.glob("*.ocpack")
    monkeypatch.setenv("ONECALL_PACK_CACHE_GIB", str(old.stat().st_size * 1.5 / 2**30))
    _load(_gguf(tmp_path, "qwen2", T.Q8_0, name="b.gguf"))
    (kept,) = cache_dir.glob("*.ocpack")  # the older one went, the one just written stays
    assert kept != old


def _same_packs(first: DecoderLM, second: DecoderLM) -> None:
    """Every projection and the logits head give the same bits on the same random rows."""
    x = torch.randn(5, first.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pairs = [
        (a, b) for a, b in zip(first.modules(), second.modules(), strict=True) if isinstance(a, FastLinear)
    ]
    assert pairs
    with torch.inference_mode():
        for a, b in pairs:
            assert isinstance(b, FastLinear) and b.in_features == a.in_features
            rows = torch.randn(5, a.in_features, generator=torch.Generator().manual_seed(1))
            assert torch.equal(a(rows), b(rows))
        assert first.fast_lm_head is not None and second.fast_lm_head is not None
        assert torch.equal(first.fast_lm_head(x), second.fast_lm_head(x))
        ids = torch.arange(first.config.vocab_size)
        assert torch.equal(first.model.embed_tokens(ids), second.model.embed_tokens(ids))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_a_hybrid_gguf_maps_its_cache(
    family: str, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid's projections are split and re-ordered on the way in (weights._hybrid_layout); its MoE
    experts are not cached (they come from the file at every start)."""
    from tests.formats.test_gguf_hybrid import _QUANTIZED, hybrid, state_of
    from tests.helpers.make_models import write_converted_hybrid_gguf

    hf = hybrid(family, seed=1, **_QUANTIZED[T.Q8_0])
    path = write_converted_hybrid_gguf(
        tmp_path / "h.gguf", state_of(hf), hf.config.to_dict(), weight_type=T.Q8_0
    )
    first, status = _load(path)
    assert status == "written"
    second, status = _load(path)
    assert status == "hit"
    assert second.kernels == first.kernels
    _same_packs(first, second)


def test_a_folder_it_cannot_write_is_a_warning(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gguf(tmp_path, "qwen2", T.Q4_0)
    want = _logits(_load(path)[0])
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("ONECALL_PACK_CACHE_DIR", str(blocked))
    with pytest.warns(PackCacheWarning, match="could not write"):
        model, status = _load(path)
    assert status.startswith("not written: ")
    assert torch.equal(_logits(model), want)


def test_a_nearly_full_disk_is_left_alone(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gguf(tmp_path, "qwen2", T.Q4_0)
    full = SimpleNamespace(total=50 * 2**30, used=45.5 * 2**30, free=4.5 * 2**30)  # 9% free: under 5 GiB
    monkeypatch.setattr(pack_cache.shutil, "disk_usage", lambda _: full)
    assert _load(path)[1] == "not written: the disk would keep less than 5.0 GiB free"
    assert not list(cache_dir.glob("*.ocpack"))
    # a large disk keeps 10 GiB, not 10%: 25 of 250 GB free (this machine's disk, 9.9% free) takes a write
    large = SimpleNamespace(total=250 * 2**30, used=225 * 2**30, free=25 * 2**30)
    monkeypatch.setattr(pack_cache.shutil, "disk_usage", lambda _: large)
    assert _load(path)[1] == "written"
    # a small one keeps 2 GiB, not 10%
    small = SimpleNamespace(total=16 * 2**30, used=14.5 * 2**30, free=1.5 * 2**30)
    monkeypatch.setattr(pack_cache.shutil, "disk_usage", lambda _: small)
    path.touch()  # another mtime: another key, a miss
    assert _load(path)[1] == "not written: the disk would keep less than 2.0 GiB free"
