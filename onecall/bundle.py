"""Replayable bundles: one finished call saved as JSON, and re-run to check every token.

    save_bundle(path, output, params, llm)   -> the dict it wrote
    load_bundle(path)                        -> Bundle (InvalidParameterError naming the bad field)
    replay_bundle(bundle, llm)               -> ReplayReport (per-token match, first mismatch)

A bundle (format "onecall-bundle", version 1) holds what decides the tokens: the prompt token
ids (after the chat template), every SamplingParams field (seed and structured_outputs
included), the model's identity (name, path, and a sha256 of its weights: the GGUF file, or
for a Hugging Face folder its *.safetensors files and config.json, each name then its bytes,
in name order), dtype, device, kernels (the switch and what it enabled), CPU threads, the
onecall version, and what came out (token ids, text, finish reason).

Exactness: a greedy call replays exactly on the same model, dtype, device and kernels. A
sampled call replays exactly only with a seed: the request's generator is rebuilt from it, and
the sampler draws exactly one number per step from it. A bundle of a sampled call without a seed
records `replay_exact: false` (its draws are gone); `onecall run --save-bundle` avoids that by
choosing a seed before it runs. Replaying on a different model, dtype, device or onecall version
is allowed: the report says so in `warnings` rather than failing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from onecall import __version__
from onecall.errors import InvalidParameterError
from onecall.llm import LLM
from onecall.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from onecall.engine.engine import Engine, RequestOutput
    from onecall.formats.checkpoint import ModelFiles
    from onecall.text.tokenizer import Tokenizer

BUNDLE_FORMAT = "onecall-bundle"
FORMAT_VERSION = 1
_CHUNK = 8 * 2**20  # bytes per read while hashing


# ---- model identity ----------------------------------------------------------------------------
def model_sha256(files: ModelFiles) -> str:
    """sha256 of the weights that define the model (see the module docstring), read in 8 MiB chunks.
    Cached per file list, size and modification time, so a replay does not hash a file twice."""
    path = Path(files.path)
    paths = [path] if files.kind == "gguf" else [*sorted(path.glob("*.safetensors")), path / "config.json"]
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
    return _hash_files(stamp, files.kind == "hf")


@functools.lru_cache(maxsize=8)
def _hash_files(stamp: tuple[tuple[str, int, int], ...], with_names: bool) -> str:
    h = hashlib.sha256()
    for name, _, _ in stamp:
        if with_names:
            h.update(os.path.basename(name).encode() + b"\0")
        with open(name, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


# ---- sampling params <-> JSON --------------------------------------------------------------------
def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """Every field of `params` as JSON values (logit_bias keys become strings, as in JSON)."""
    d: dict[str, Any] = {}
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        elif isinstance(value, StructuredOutputsParams):  # only the fields it sets: from_dict's input
            value = {
                g.name: list(v) if isinstance(v, tuple) else v
                for g in fields(StructuredOutputsParams)
                if (v := getattr(value, g.name)) != g.default
            }
        d[f.name] = value
    try:
        json.dumps(d["extra"])
    except (TypeError, ValueError):
        raise InvalidParameterError("sampling_params.extra", "holds values JSON cannot store") from None
    return d


def params_from_dict(d: Any) -> SamplingParams:
    """The inverse of params_to_dict; every problem names its field as sampling_params.<field>."""
    if not isinstance(d, dict):
        raise InvalidParameterError("sampling_params", f"must be an object, got {type(d).__name__}")
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InvalidParameterError("sampling_params", f"unknown field(s) {unknown}")
    d = dict(d)
    bias = d.get("logit_bias")
    if isinstance(bias, dict):
        try:
            d["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise InvalidParameterError("sampling_params.logit_bias", "keys must be token ids") from None
    try:
        return SamplingParams(**d)
    except InvalidParameterError as e:
        raise InvalidParameterError(
            f"sampling_params.{e.param}", str(e).removeprefix(f"{e.param}: ")
        ) from None
    except (TypeError, ValueError) as e:
        raise InvalidParameterError("sampling_params", str(e)) from None


# ---- save / load -----------------------------------------------------------------------------------
def save_bundle(
    path: str | os.PathLike[str], output: RequestOutput, params: SamplingParams, engine: Engine | LLM
) -> dict[str, Any]:
    """Write the finished `output` of a request made with `params` on `engine` (an Engine or an
    LLM) to `path` as JSON; returns what was written."""
    if not output.finished:
        raise InvalidParameterError("output", "is not finished: save the request's last output")
    eng = engine.engine if isinstance(engine, LLM) else engine
    parts = eng.parts
    exact = params.is_greedy or params.seed is not None
    bundle: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "format_version": FORMAT_VERSION,
        "onecall_version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": {
            "name": parts.model_name,
            "path": str(parts.files.path),
            "kind": parts.files.kind,
            "sha256": model_sha256(parts.files),
        },
        "dtype": str(parts.dtype).removeprefix("torch."),
        "device": str(parts.device),
        "kernels": eng.config.kernels,  # the switch: "fast" or "reference"
        "kernels_detail": parts.kernels,  # what the switch enabled on this device
        "int8_activations": eng.config.int8_activations,  # 4-bit projections' activation rounding
        "kv_cache_dtype": str(parts.kv_cache.k.dtype).removeprefix("torch."),  # what the K/V cache held
        "num_threads": torch.get_num_threads(),  # on CPU, matmul sums may split differently with more
        "prompt_token_ids": list(output.trace.prompt_token_ids),
        "sampling_params": params_to_dict(params),
        "output": {
            "token_ids": list(output.token_ids),
            "text": output.text,
            "finish_reason": output.finish_reason,
        },
        # a sampled request without a seed drew numbers no one kept: replay cannot repeat them
        "replay_exact": exact,
    }
    # one top-level field per line, each value compact (a token list stays on its line)
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in bundle.items())
    Path(path).write_text("{\n" + body + "\n}\n", encoding="utf-8")
    return bundle


@dataclass(frozen=True)
class Bundle:
    """A validated bundle (see the module docstring for what each field means)."""

    onecall_version: str
    model_name: str
    model_path: str
    model_sha256: str
    dtype: str
    device: str
    kernels: str  # EngineConfig.kernels
    kernels_detail: str  # what ran (LoadedEngineParts.kernels)
    int8_activations: bool  # EngineConfig.int8_activations
    kv_cache_dtype: str  # the K/V cache's dtype when it ran
    num_threads: int  # torch's CPU threads when it ran
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None
    replay_exact: bool

    @classmethod
    def from_dict(cls, d: Any) -> Bundle:
        """Validate a parsed bundle; InvalidParameterError names the first bad field."""
        if not isinstance(d, dict) or d.get("format") != BUNDLE_FORMAT:
            raise InvalidParameterError("format", f'is not "{BUNDLE_FORMAT}": not a onecall bundle')
        version = _get(d, "format_version", int)
        if version != FORMAT_VERSION:
            raise InvalidParameterError(
                "format_version", f"{version} is not supported (this onecall reads {FORMAT_VERSION})"
            )
        model, out = _get(d, "model", dict), _get(d, "output", dict)
        return cls(
            onecall_version=_get(d, "onecall_version", str),
            model_name=_get(model, "name", str, "model."),
            model_path=_get(model, "path", str, "model."),
            model_sha256=_get(model, "sha256", str, "model."),
            dtype=_get(d, "dtype", str),
            device=_get(d, "device", str),
            kernels=_get(d, "kernels", str),
            kernels_detail=_get(d, "kernels_detail", str),
            # bundles written before the field existed ran int16 activations
            int8_activations=_get(d, "int8_activations", bool) if "int8_activations" in d else False,
            # bundles written before the field existed ran the model's own dtype (kv_cache_dtype "auto")
            kv_cache_dtype=_get(d, "kv_cache_dtype", str) if "kv_cache_dtype" in d else _get(d, "dtype", str),
            num_threads=_get(d, "num_threads", int),
            prompt_token_ids=_token_ids(d, "prompt_token_ids", "", allow_empty=False),
            params=params_from_dict(_get(d, "sampling_params", dict)),
            output_token_ids=_token_ids(out, "token_ids", "output."),
            output_text=_get(out, "text", str, "output."),
            finish_reason=_get(out, "finish_reason", (str, type(None)), "output."),
            replay_exact=_get(d, "replay_exact", bool),
        )


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], prefix: str = "") -> Any:
    if key not in d:
        raise InvalidParameterError(prefix + key, "is missing")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidParameterError(prefix + key, f"has the wrong type ({type(value).__name__})")
    return value


def _token_ids(d: dict[str, Any], key: str, prefix: str, *, allow_empty: bool = True) -> list[int]:
    ids = _get(d, key, list, prefix)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidParameterError(prefix + key, "must be a list of token ids (integers >= 0)")
    if not ids and not allow_empty:
        raise InvalidParameterError(prefix + key, "is empty")
    return list(ids)


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read and validate a bundle file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidParameterError("bundle", f"cannot read {str(path)!r}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InvalidParameterError("bundle", f"{str(path)!r} is not valid JSON: {e}") from None
    return Bundle.from_dict(data)


# ---- replay ------------------------------------------------------------------------------------------
@dataclass
class ReplayReport:
    """The saved tokens against the replayed ones, position by position (asdict() is JSON-ready)."""

    expected_token_ids: list[int]
    replayed_token_ids: list[int]
    replayed_text: str
    model_matches: bool  # the replaying model's sha256 equals the bundle's
    warnings: list[str] = field(default_factory=list)
    # derived in __post_init__:
    matches: list[bool] = field(init=False)  # per saved token: the replay has the same id there
    first_mismatch: int | None = field(init=False)  # first position that differs (or where one ended)
    expected_token: int | None = field(init=False)  # the saved id there (None: the saved output ended)
    replayed_token: int | None = field(init=False)  # the replayed id there (None: the replay ended)

    def __post_init__(self) -> None:
        a, b = self.expected_token_ids, self.replayed_token_ids
        self.matches = [i < len(b) and b[i] == t for i, t in enumerate(a)]
        differs = (i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i])
        i = self.first_mismatch = next(differs, None)
        self.expected_token = a[i] if i is not None and i < len(a) else None
        self.replayed_token = b[i] if i is not None and i < len(b) else None

    @property
    def is_exact(self) -> bool:
        return self.first_mismatch is None

    def verdict(self, tokenizer: Tokenizer | None = None) -> str:
        """One line: "replay: 32/32 tokens matched", or where and how the first mismatch happened."""
        n, i = len(self.expected_token_ids), self.first_mismatch
        if i is None:
            return f"replay: {n}/{n} tokens matched"

        def show(t: int | None) -> str:
            if t is None:
                return "the end of the output"
            return f"{t} {tokenizer.decode([t], skip_special_tokens=False)!r}" if tokenizer else str(t)

        return (
            f"replay: {i}/{n} tokens matched; first mismatch at token {i}: "
            f"expected {show(self.expected_token)}, got {show(self.replayed_token)}"
        )


def replay_bundle(bundle: Bundle | dict[str, Any], llm: LLM) -> ReplayReport:
    """Re-run the bundle's prompt ids with its params on `llm` (a seeded request gets a fresh
    generator from the saved seed) and compare every token."""
    b = bundle if isinstance(bundle, Bundle) else Bundle.from_dict(bundle)
    parts = llm.engine.parts
    sha = model_sha256(parts.files)
    out = llm.generate([b.prompt_token_ids], b.params)[0]
    report = ReplayReport(list(b.output_token_ids), list(out.token_ids), out.text, sha == b.model_sha256)
    if not report.model_matches:
        report.warnings.append(
            f"different model: the bundle was made with {b.model_name} (sha256 {b.model_sha256[:12]}), "
            f"this replay ran {parts.model_name} (sha256 {sha[:12]}); its tokens are not expected to match"
        )
    setting = {  # name: (the bundle's, this replay's)
        "dtype": (b.dtype, str(parts.dtype).removeprefix("torch.")),
        "device": (b.device, str(parts.device)),
        "kernels": (b.kernels_detail, parts.kernels),
        "K/V cache dtype": (b.kv_cache_dtype, str(parts.kv_cache.k.dtype).removeprefix("torch.")),
    }
    if parts.device.type == "cpu":
        setting["CPU threads"] = (str(b.num_threads), str(torch.get_num_threads()))
    for name, (then, now) in setting.items():
        if then != now:
            report.warnings.append(
                f"{name} differs (bundle {then}, replay {now}): float results may differ and flip a close choice"
            )
    if b.onecall_version != __version__:
        report.warnings.append(f"made with onecall {b.onecall_version}, replayed with {__version__}")
    if not b.replay_exact:
        report.warnings.append(
            f"the call sampled (temperature {b.params.temperature}) without a seed: its draws were not "
            "kept, so the replay cannot be exact"
        )
    return report
