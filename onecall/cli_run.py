"""`onecall run` and `onecall replay`, and the sampling flags they share with `onecall chat`.

    onecall run "What is the capital of France?" --trace           # answer + the trace table
    onecall run "..." --trace-level full --trace                   # + each token's logit provenance
    onecall run "..." --temperature 0.8 --save-bundle call.json     # + a replayable bundle
    onecall replay call.json                                        # re-run it: did every token match?

`--save-bundle` needs a replayable call: sampling (temperature > 0) without --seed would draw
numbers no one keeps, so run then picks a random seed first (printed on stderr and stored in
the bundle). `replay` loads the bundle's model (its path if it still exists here, else the
embedded default, or --model), with the bundle's dtype, kernels, CPU threads (they can change
how a matmul's sums split) and device unless flags say otherwise, prints one verdict line and
exits 0 when every token matched, 1 otherwise; what differs from the original run (model hash,
dtype, ...) is printed as warnings on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onecall.engine_flags import add_engine_args, engine_kwargs
from onecall.sampling_params import TRACE_LEVELS, SamplingParams

if TYPE_CHECKING:
    from onecall.bundle import Bundle


# ---- sampling flags (run, chat) ------------------------------------------------------------------
def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        stop=tuple(a.stop),
        trace_level=getattr(a, "trace_level", "basic"),
    )


def load_llm(a: argparse.Namespace) -> Any:
    from onecall.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(a))
    print(f"loaded {llm.info.model_name} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return llm


# ---- run -----------------------------------------------------------------------------------------
def add_run_command(sub: Any) -> None:
    run = sub.add_parser("run", help="run one call and print the answer (and its trace)")
    run.add_argument("prompt")
    run.add_argument("--trace", action="store_true", help="print the stage-by-stage trace table")
    run.add_argument(
        "--trace-level",
        default="basic",
        choices=TRACE_LEVELS,
        help="full: record each token's top candidates and rank after every sampler stage",
    )
    run.add_argument("--json", action="store_true", help="print answer and trace as one JSON object")
    run.add_argument(
        "--raw", action="store_true", help="complete the prompt as raw text, without the chat template"
    )
    run.add_argument(
        "--save-bundle",
        metavar="FILE",
        default=None,
        help="write a replayable bundle (prompt ids, params, seed, model hash); sampling without "
        "--seed picks a random seed first so the bundle replays exactly",
    )
    add_engine_args(run)
    add_sampling_args(run)
    run.set_defaults(func=cmd_run)


def cmd_run(a: argparse.Namespace) -> int:
    from onecall.trace_view import format_trace

    # 1. params; a bundle of a sampled call needs a seed to replay, so one is chosen now
    params = sampling_params(a)
    if a.save_bundle and not params.is_greedy and params.seed is None:
        a.seed = random.randrange(2**31)
        params = sampling_params(a)
        print(f"sampling without --seed: using seed {a.seed} so the bundle can replay", file=sys.stderr)
    # 2. the call, streamed
    llm = load_llm(a)
    if a.raw:
        stream = llm.generate_stream(a.prompt, params)
    else:
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}
        ]
        stream = llm.chat_stream(messages, params)
    last = None
    for out in stream:
        if not a.json:
            print(out.delta_text, end="", flush=True)
        last = out
    assert last is not None
    # 3. bundle, then the answer's JSON or trace
    if a.save_bundle:
        from onecall.bundle import save_bundle

        save_bundle(a.save_bundle, last, params, llm)
        print(f"saved bundle {a.save_bundle} ({len(last.token_ids)} tokens)", file=sys.stderr)
    if a.json:
        payload = {
            "text": last.text,
            "token_ids": last.token_ids,
            "finish_reason": last.finish_reason,
            "trace": last.trace.to_dict(),
        }
        print(json.dumps(payload))
        return 0
    print()
    if a.trace:
        print()
        print(format_trace(last.trace, llm.tokenizer, color=sys.stdout.isatty()))
    return 0


# ---- replay ----------------------------------------------------------------------------------------
def add_replay_command(sub: Any) -> None:
    replay = sub.add_parser("replay", help="re-run a saved bundle and report whether every token matched")
    replay.add_argument("bundle", metavar="FILE", help="a file written by `onecall run --save-bundle`")
    add_engine_args(replay)
    # None: take the bundle's own (see _replay_kwargs)
    replay.set_defaults(func=cmd_replay, kernels=None, kv_cache_dtype=None)
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
    file is still here (else the embedded default), dtype, kernels, K/V cache dtype, CPU threads,
    and its device if that exists here."""
    kw = engine_kwargs(a)
    if kw["model"] is None and Path(bundle.model_path).exists():
        kw["model"] = bundle.model_path
    kw["dtype"] = kw["dtype"] or bundle.dtype
    kw["kernels"] = kw["kernels"] or bundle.kernels
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
