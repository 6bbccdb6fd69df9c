"""`onecall lab`: its flags and command. onecall/cli/__init__.py adds them as the `lab` subcommand;
`python -m onecall.lab` runs them on their own.

    onecall lab [--model M] [--out DIR] [--only NAME,...] [--calls N] [--quick]

This module is imported when the `onecall` parser is built, so it imports nothing heavy at the top:
the model, torch and matplotlib load inside cmd_lab.
"""

from __future__ import annotations

import argparse
import sys
import time

from onecall.engine_flags import add_engine_args
from onecall.engine_flags import engine_kwargs as engine_kwargs_of
from onecall.lab.experiments import EXPERIMENT_NAMES, select_experiments


def add_lab_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)  # --model, --dtype, --device, --kernels, --num-threads, ... as for every command
    p.add_argument(
        "--out", default="lab-report", help="folder for report.md, report.html, results.json, plots"
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="NAME,...",
        help=f"run only these experiments, in the usual order; names: {', '.join(EXPERIMENT_NAMES)}",
    )
    p.add_argument(
        "--calls", type=int, default=20, help="calls per variant in the sampled experiments (seed: 80)"
    )
    p.add_argument(
        "--quick", action="store_true", help="the reduced form the tests run: fewer turns and calls"
    )


def cmd_lab(a: argparse.Namespace) -> int:
    """Load the model once, run the experiments, write the report. 0 if all succeeded, 1 if any
    failed (the others still ran and are in the report); bad flags raise InvalidParameterError."""
    from onecall import InvalidParameterError

    names = select_experiments(a.only)  # before loading anything: a typo fails in a second
    if a.calls < 1:
        raise InvalidParameterError("calls", f"must be >= 1, got {a.calls}")
    from onecall import LLM
    from onecall.lab.runner import run_lab

    engine_kwargs = {k: v for k, v in engine_kwargs_of(a).items() if v is not None}
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    info = llm.info
    print(
        f"lab: loaded {info.model_name} on {info.device} ({info.kernels}) in "
        f"{time.perf_counter() - t0:.1f} s; running {', '.join(names)}",
        file=sys.stderr,
    )
    run = run_lab(
        llm,
        engine_kwargs,
        a.out,
        names,
        calls=a.calls,
        quick=a.quick,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return 0 if run.ok else 1
