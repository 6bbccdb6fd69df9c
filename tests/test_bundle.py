"""Replayable bundles: save -> load -> replay matches token for token; anything else is reported.

On the tiny random-weight engine, which owns real files (its weights as model.safetensors and its
config as config.json, in a Hugging Face folder of its own): greedy and seeded nucleus sampling
replay exactly (on a fresh engine, so no cached prefix helps); a bundle edited to another token
reports that index and both tokens; a different model hash or an unseeded sampled call is a
warning, not a crash; every malformed field is an InvalidParameterError naming it. Through the
real `onecall` command on the embedded model: run --save-bundle, then replay, exit code 0 (and 1
after an edit). A bundle's model hash is checked against one computed here from the files' bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

import onecall
from onecall.bundle import (
    Bundle,
    load_bundle,
    params_from_dict,
    params_to_dict,
    replay_bundle,
    save_bundle,
)
from onecall.cli import main
from onecall.errors import InvalidParameterError
from onecall.formats.checkpoint import ModelFiles, resolve_model
from onecall.llm import LLM
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.tiny_engine import tiny_engine, tiny_model

ONECALL = str(Path(sys.executable).with_name("onecall"))  # the console script of the venv running the tests
HI = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    """The tiny model's own files: its weights and its config, as a Hugging Face folder holds them."""
    folder = tmp_path_factory.mktemp("tiny-model")
    model = tiny_model()
    # clone: the tied embedding and output matrix share memory, which safetensors refuses to write
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(model.config)))
    return ModelFiles(kind="hf", path=folder, name=folder.name)


def folder_sha256(files: ModelFiles) -> str:
    """The bundle format's model hash, computed here from the bytes: *.safetensors in name order,
    then config.json, each as its name, a NUL, then its bytes."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "config.json"):
        h.update(name.encode() + b"\0" + (files.path / name).read_bytes())
    return h.hexdigest()


def tiny_llm(files: ModelFiles) -> LLM:
    """An LLM on the tiny engine, which claims `files` (and not the embedded GGUF) as its model."""
    return LLM(engine=tiny_engine(files=files))


def saved(
    tmp_path: Path, params: SamplingParams, files: ModelFiles, name: str = "b.json"
) -> tuple[Path, Any]:
    llm = tiny_llm(files)
    out = llm.chat(HI, params)[0]
    path = tmp_path / name
    save_bundle(path, out, params, llm)
    return path, out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16),
    ],
    ids=["greedy", "seeded-top-p"],
)
def test_replay_matches_token_for_token(
    tmp_path: Path, params: SamplingParams, tiny_files: ModelFiles
) -> None:
    path, out = saved(tmp_path, params, tiny_files)
    bundle = load_bundle(path)
    assert bundle.params == params and bundle.params.seed == params.seed
    assert bundle.output_token_ids == out.token_ids and bundle.prompt_token_ids == out.trace.prompt_token_ids
    assert bundle.model_sha256 == folder_sha256(tiny_files) and bundle.replay_exact
    assert bundle.model_path == str(tiny_files.path) and bundle.model_name == tiny_files.name
    assert bundle.onecall_version == onecall.__version__

    report = replay_bundle(bundle, tiny_llm(tiny_files))  # a fresh engine: nothing cached
    assert report.is_exact and report.first_mismatch is None and all(report.matches)
    assert report.replayed_token_ids == out.token_ids and report.replayed_text == out.text
    assert report.model_matches and report.warnings == []
    n = len(out.token_ids)
    assert report.verdict() == f"replay: {n}/{n} tokens matched"


def test_an_edited_token_is_reported_where_it_differs(tmp_path: Path, tiny_files: ModelFiles) -> None:
    path, out = saved(tmp_path, SamplingParams(temperature=0.0, max_tokens=12), tiny_files)
    data = json.loads(path.read_text())
    original = data["output"]["token_ids"][5]
    data["output"]["token_ids"][5] = original + 1
    report = replay_bundle(data, tiny_llm(tiny_files))
    assert not report.is_exact and report.first_mismatch == 5
    assert report.expected_token == original + 1 and report.replayed_token == original
    assert report.matches[:5] == [True] * 5 and report.matches[5] is False
    tok = tiny_llm(tiny_files).tokenizer
    verdict = report.verdict(tok)
    assert (
        verdict.startswith("replay: 5/12 tokens matched; first mismatch at token 5")
        and str(original) in verdict
    )

    # a replay that runs past the saved output's end mismatches where the saved one ended
    data["output"]["token_ids"] = out.token_ids[:7]
    short = replay_bundle(data, tiny_llm(tiny_files))
    assert (
        short.first_mismatch == 7
        and short.expected_token is None
        and short.replayed_token == out.token_ids[7]
    )
    assert "the end of the output" in short.verdict(tok)


def test_other_model_and_unseeded_sampling_are_warnings(tmp_path: Path, tiny_files: ModelFiles) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6)  # sampled, no seed: not replayable exactly
    path, _ = saved(tmp_path, params, tiny_files)
    data = json.loads(path.read_text())
    assert data["replay_exact"] is False and data["sampling_params"]["seed"] is None
    data["model"]["sha256"] = "0" * 64
    data["dtype"] = "bfloat16"
    data["kv_cache_dtype"] = "float16"
    report = replay_bundle(data, tiny_llm(tiny_files))
    assert not report.model_matches
    text = "\n".join(report.warnings)
    assert "different model" in text and "dtype differs" in text and "without a seed" in text
    assert "K/V cache dtype differs (bundle float16, replay float32)" in text


def test_a_bundle_without_kv_cache_dtype_ran_the_model_dtype(tmp_path: Path, tiny_files: ModelFiles) -> None:
    """Bundles written before the field existed still load: their cache held the model's dtype."""
    path, _ = saved(tmp_path, SamplingParams(temperature=0.0, max_tokens=2), tiny_files)
    data = json.loads(path.read_text())
    assert data["kv_cache_dtype"] == data["dtype"] == "float32"
    del data["kv_cache_dtype"]
    path.write_text(json.dumps(data))
    assert load_bundle(path).kv_cache_dtype == "float32"


def test_int8_activations_are_recorded_and_replay_takes_them(tmp_path: Path, tiny_files: ModelFiles) -> None:
    """A bundle keeps the activation rounding it ran with; replay runs it unless a flag overrides it;
    bundles written before the field existed ran int16 activations."""
    from onecall.cli import build_parser
    from onecall.cli.replay import _replay_kwargs

    path, _ = saved(tmp_path, SamplingParams(temperature=0.0, max_tokens=2), tiny_files)
    data = json.loads(path.read_text())
    assert data["int8_activations"] is False
    data["int8_activations"] = True
    path.write_text(json.dumps(data))
    bundle = load_bundle(path)
    assert bundle.int8_activations is True
    assert (
        _replay_kwargs(build_parser().parse_args(["replay", str(path)]), bundle)["int8_activations"] is True
    )
    del data["int8_activations"]
    path.write_text(json.dumps(data))
    old = load_bundle(path)
    assert old.int8_activations is False
    flagged = build_parser().parse_args(["replay", str(path), "--int8-activations"])
    assert _replay_kwargs(flagged, old)["int8_activations"] is True
    # and a bundle that ran int8 activations can be replayed on int16 ones
    off = build_parser().parse_args(["replay", str(path), "--no-int8-activations"])
    assert _replay_kwargs(off, bundle)["int8_activations"] is False


def test_sampling_params_round_trip_every_field() -> None:
    params = SamplingParams(
        max_tokens=9,
        temperature=0.6,
        top_p=0.8,
        top_k=7,
        min_p=0.1,
        seed=-3,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=-0.3,
        logit_bias={5: 1.5, 70: -100.0},
        logprobs=3,
        stop=("\n\n", "END"),
        stop_token_ids=(4,),
        ignore_eos=True,
        min_tokens=2,
        skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(choice=["a", "b"], reasoning_end="</think>"),
        trace_level="full",
    )
    d = json.loads(json.dumps(params_to_dict(params)))
    assert params_from_dict(d) == params
    so = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert params_from_dict(json.loads(json.dumps(params_to_dict(so)))) == so


@pytest.mark.parametrize(
    "edit, param",
    [
        (lambda d: d.pop("prompt_token_ids"), "prompt_token_ids"),
        (lambda d: d.__setitem__("prompt_token_ids", []), "prompt_token_ids"),
        (lambda d: d.__setitem__("prompt_token_ids", [1, "two"]), "prompt_token_ids"),
        (lambda d: d["output"].__setitem__("token_ids", "123"), "output.token_ids"),
        (lambda d: d["model"].pop("sha256"), "model.sha256"),
        (lambda d: d.__setitem__("format_version", 99), "format_version"),
        (lambda d: d.__setitem__("format_version", True), "format_version"),
        (lambda d: d.__setitem__("format", "something-else"), "format"),
        (lambda d: d["sampling_params"].__setitem__("temperature", "hot"), "sampling_params.temperature"),
        (lambda d: d["sampling_params"].__setitem__("top_p", 2.0), "sampling_params.top_p"),
        (lambda d: d["sampling_params"].__setitem__("warmth", 1), "sampling_params"),
        (lambda d: d["sampling_params"].__setitem__("logit_bias", {"x": 1.0}), "sampling_params.logit_bias"),
        (lambda d: d.__setitem__("replay_exact", "yes"), "replay_exact"),
        (lambda d: d.__setitem__("kv_cache_dtype", 16), "kv_cache_dtype"),
        (lambda d: d.__setitem__("int8_activations", "yes"), "int8_activations"),
    ],
)
def test_malformed_bundles_name_the_field(
    tmp_path: Path, edit: Any, param: str, tiny_files: ModelFiles
) -> None:
    path, _ = saved(tmp_path, SamplingParams(temperature=0.0, max_tokens=2), tiny_files)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidParameterError) as e:
        load_bundle(path)
    assert e.value.param == param, str(e.value)


def test_unreadable_bundles(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    for name in ("bad.json", "missing.json"):
        with pytest.raises(InvalidParameterError) as e:
            load_bundle(tmp_path / name)
        assert e.value.param == "bundle" and name in str(e.value)
    with pytest.raises(InvalidParameterError):
        Bundle.from_dict([1, 2, 3])


@pytest.mark.slow
def test_cli_run_save_bundle_then_replay(tmp_path: Path) -> None:
    bundle = tmp_path / "call.json"
    run = subprocess.run(
        # one thread: the machine's 2 cores are shared, and a second thread mostly waits
        [
            ONECALL,
            "run",
            "Name a colour.",
            "--max-tokens",
            "8",
            "--temperature",
            "0.8",
            "--top-p",
            "0.95",
            "--num-threads",
            "1",
            "--save-bundle",
            str(bundle),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "using seed" in run.stderr  # sampled without --seed: run chose one so the bundle replays
    data = json.loads(bundle.read_text())
    assert isinstance(data["sampling_params"]["seed"], int) and data["replay_exact"] is True
    assert data["num_threads"] == 1  # replay takes it from the bundle
    gguf = resolve_model(None).path  # a GGUF's hash is its file's: computed here from the bytes
    assert data["model"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert data["model"]["path"] == str(gguf)

    replay = subprocess.run([ONECALL, "replay", str(bundle)], capture_output=True, text=True, timeout=120)
    n = len(data["output"]["token_ids"])
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.strip() == f"replay: {n}/{n} tokens matched"
    assert "warning" not in replay.stderr


def test_cli_replay_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, tiny_files: ModelFiles
) -> None:
    """`onecall replay` in-process, its LLM swapped for the tiny engine (the command builds it)."""
    path, out = saved(tmp_path, SamplingParams(temperature=0.7, seed=3, max_tokens=10), tiny_files)
    built: list[dict[str, Any]] = []

    def fake_llm(**kwargs: Any) -> LLM:
        built.append(kwargs)
        return tiny_llm(tiny_files)

    monkeypatch.setattr("onecall.llm.LLM", fake_llm)
    assert main(["replay", str(path)]) == 0
    assert (
        capsys.readouterr().out.strip() == f"replay: {len(out.token_ids)}/{len(out.token_ids)} tokens matched"
    )
    # the bundle's model (its own folder, not the default), dtype and kernels switch fill in what the
    # flags leave out
    assert built[0]["model"] == str(tiny_files.path) and built[0]["dtype"] == "float32"
    assert built[0]["kernels"] == "fast" and built[0]["device"] == "cpu" and built[0]["num_threads"] >= 1

    data = json.loads(path.read_text())
    data["output"]["token_ids"][2] += 1
    path.write_text(json.dumps(data))
    assert main(["replay", str(path), "--json", "--kernels", "reference"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["exact"] is False and report["first_mismatch"] == 2 and report["model_matches"] is True
    assert built[1]["kernels"] == "reference"


def test_lab_subcommand_is_wired_to_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """`onecall lab` takes its flags and command from onecall.lab.cli (a stand-in here)."""
    import argparse
    import sys
    import types

    from onecall.cli import build_parser

    def add_lab_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--calls", type=int, default=20)

    def cmd_lab(a: argparse.Namespace) -> int:
        return 0

    fake = types.ModuleType("onecall.lab.cli")
    fake.add_lab_arguments = add_lab_arguments  # type: ignore[attr-defined]
    fake.cmd_lab = cmd_lab  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onecall.lab.cli", fake)
    args = build_parser().parse_args(["lab", "--calls", "3"])
    assert args.func is cmd_lab and args.calls == 3
