"""The lab runner: one loaded model, the selected experiments in order, then the report.

    run_lab(llm, engine_kwargs, out_dir, names)
        for each name: import its module -> run(ctx) -> ExperimentOutcome (result, or the error)
        -> out_dir/results.json   {"meta": {...}, "<name>": result.results, ...}
        -> out_dir/report.md, out_dir/report.html, and the experiments' PNGs

An experiment that raises is recorded as failed (in results.json's meta and in the report, with
its error) and the others still run; LabRun.ok is False then, and `onecall lab` exits with 1.
Progress goes to `progress` one line at a time: `[i/n name +elapsed] message`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import onecall
from onecall.lab.base import ExperimentResult, LabContext
from onecall.lab.experiments import ExperimentUnavailableError, load_experiment
from onecall.lab.report import ExperimentOutcome, report_html, report_markdown

if TYPE_CHECKING:
    from onecall import LLM


@dataclass
class LabRun:
    outcomes: list[ExperimentOutcome]
    meta: dict[str, Any]
    out_dir: Path

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    @property
    def results_path(self) -> Path:
        return self.out_dir / "results.json"


def run_lab(
    llm: LLM,
    engine_kwargs: dict[str, Any],
    out_dir: str | Path,
    names: Sequence[str],
    *,
    calls: int = 20,
    quick: bool = False,
    progress: Callable[[str], None] = print,
) -> LabRun:
    """Run `names` (registry names, in the order given) on the loaded `llm`; write the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, name in enumerate(names, 1):
        outcomes.append(_run_one(llm, engine_kwargs, out, name, calls, quick, f"{i}/{len(names)}", progress))
    meta = lab_meta(llm, engine_kwargs, outcomes, calls=calls, quick=quick)
    run = LabRun(outcomes, meta, out)
    write_outputs(run)
    failed = [o.name for o in outcomes if not o.ok]
    progress(
        f"wrote {out / 'report.md'}, report.html, results.json"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return run


def _run_one(
    llm: LLM,
    engine_kwargs: dict[str, Any],
    out: Path,
    name: str,
    calls: int,
    quick: bool,
    position: str,
    progress: Callable[[str], None],
) -> ExperimentOutcome:
    t0 = time.perf_counter()

    def report(message: str) -> None:
        progress(f"[{position} {name} +{time.perf_counter() - t0:.1f}s] {message}")

    title = name
    try:
        module = load_experiment(name)
        title = module.TITLE
        report(f"start: {title}")
        ctx = LabContext(
            llm=llm, engine_kwargs=dict(engine_kwargs), out_dir=out, calls=calls, quick=quick, progress=report
        )
        result = module.run(ctx)
        if not isinstance(result, ExperimentResult):
            raise TypeError(f"run() returned {type(result).__name__}, not an ExperimentResult")
        _json_safe(result.results)  # fails here, as this experiment's error, if it cannot be written
    except Exception as e:  # one experiment's failure must not cost the others their results
        duration = time.perf_counter() - t0
        error = f"{type(e).__name__}: {e}"
        if not isinstance(e, ExperimentUnavailableError):  # a bug somewhere: where it happened helps
            error += "\n\n" + traceback.format_exc(limit=-6)
        report(f"FAILED after {duration:.1f} s: {type(e).__name__}: {e}")
        return ExperimentOutcome(name, title, duration, error=error)
    duration = time.perf_counter() - t0
    report(f"done in {duration:.1f} s")
    return ExperimentOutcome(name, result.title or title, duration, result=result)


def lab_meta(
    llm: LLM, engine_kwargs: dict[str, Any], outcomes: Sequence[ExperimentOutcome], *, calls: int, quick: bool
) -> dict[str, Any]:
    """results.json's `meta`: what ran where, and each experiment's status, seed rows and plots."""
    info = llm.info
    device = torch.device(info.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "model": info.model_name,
        "device": info.device,
        "dtype": info.dtype,
        "kernels": info.kernels,
        "onecall_version": onecall.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu},
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if v is not None},
        "calls": calls,
        "quick": quick,
        "experiments": {o.name: _outcome_meta(o) for o in outcomes},
    }


def _outcome_meta(o: ExperimentOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "title": o.title,
        "status": "ok" if o.ok else "failed",
        "duration_s": round(o.duration_s, 3),
    }
    if o.result is None:
        entry["error"] = o.error
    else:
        entry["seed_rows"] = [asdict(r) for r in o.result.seed_rows]
        entry["plots"] = [p.name for p in o.result.plots]
    return entry


def write_outputs(run: LabRun) -> None:
    """results.json, report.md and report.html into run.out_dir."""
    results: dict[str, Any] = {"meta": run.meta}
    for o in run.outcomes:
        results[o.name] = o.result.results if o.result else {"status": "failed", "error": o.error}
    run.results_path.write_text(json.dumps(_json_safe(results), indent=2, ensure_ascii=False) + "\n")
    markdown = report_markdown(run.outcomes, run.meta, run.out_dir)
    (run.out_dir / "report.md").write_text(markdown)
    (run.out_dir / "report.html").write_text(report_html(markdown, run.out_dir))


def _json_safe(value: Any) -> Any:
    """A copy JSON can hold strictly: NaN/inf -> None, tuples -> lists, Paths -> str; other types raise."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"results hold a {type(value).__name__}, which results.json cannot store: {value!r:.80}")
