"""`onecall replay FILE`: re-run a bundle written by `onecall run --save-bundle` and say whether every
token matched.

replay loads the bundle's model (its path if it still exists here, else the embedded default, or
--model), with the bundle's dtype, kernels, CPU threads (they can change how a matmul's sums
split) and device unless flags say otherwise, prints one verdict line and exits 0 when every
token matched, 1 otherwise; what differs from the original run (model hash, dtype, ...) is
printed as warnings on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onecall.engine_flags import add_engine_args, engine_kwargs

if TYPE_CHECKING:
    from onecall.bundle import Bundle


def add_replay_command(sub: Any) -> None:
    replay = sub.add_parser("replay", help="re-run a saved bundle and report whether every token matched")
    replay.add_argument("bundle", metavar="FILE", help="a file written by `onecall run --save-bundle`")
    add_engine_args(replay)
    # None: take the bundle's own (see _replay_kwargs)
    replay.set_defaults(func=cmd_replay, kernels=None, kv_cache_dtype=None, int8_activations=None)
    replay.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_replay(a: argparse.Namespace) -> int:
    from onecall.bundle import load_bundle, replay_bundle
    from onecall.llm import LLM

    bundle = load_bundle(a.bundle)
    t0 = time.perf_counter()
    llm = LLM(**_replay_kwargs(a, bundle))
    print(f"loaded {llm.info.model_name} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    report = replay_bundle(bundle, llm)
    for warning in report.warnings:
        print(f"onecall: warning: {warning}", file=sys.stderr)
    if a.json:
        print(json.dumps({"exact": report.is_exact, **asdict(report)}))
    else:
        print(report.verdict(llm.tokenizer))
    return 0 if report.is_exact else 1


def _replay_kwargs(a: argparse.Namespace, bundle: Bundle) -> dict[str, Any]:
    """Engine flags, with what the bundle ran on filling in those not given: its model if the
    file is still here (else the embedded default), dtype, kernels (and their activation rounding),
    K/V cache dtype, CPU threads,
    and its device if that exists here."""
    kw = engine_kwargs(a)
    if kw["model"] is None and Path(bundle.model_path).exists():
        kw["model"] = bundle.model_path
    kw["dtype"] = kw["dtype"] or bundle.dtype
    kw["kernels"] = kw["kernels"] or bundle.kernels
    if kw["int8_activations"] is None:
        kw["int8_activations"] = bundle.int8_activations
    kw["kv_cache_dtype"] = kw["kv_cache_dtype"] or bundle.kv_cache_dtype
    kw["num_threads"] = kw["num_threads"] or bundle.num_threads
    if kw["device"] is None and _device_exists(bundle.device):
        kw["device"] = bundle.device
    return kw


def _device_exists(device: str) -> bool:
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if d.type == "cuda":
        return torch.cuda.is_available() and (d.index is None or d.index < torch.cuda.device_count())
    return d.type == "cpu"
