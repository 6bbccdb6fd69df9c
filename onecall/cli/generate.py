"""Generating from the terminal: `onecall run` (one call and its anatomy) and `onecall chat` (turn by
turn), and the sampling flags they share.

    onecall run "What is the capital of France?" --trace           # answer + the trace table
    onecall run "..." --trace-level full --trace                   # + each token's logit provenance
    onecall run "..." --temperature 0.8 --save-bundle call.json     # + a replayable bundle
    onecall chat                                                   # multi-turn, cached tokens per turn

`--save-bundle` needs a replayable call: sampling (temperature > 0) without --seed would draw
numbers no one keeps, so run then picks a random seed first (printed on stderr and stored in
the bundle; `onecall replay`, cli/replay.py, re-runs it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from onecall.engine_flags import add_engine_args, engine_kwargs
from onecall.sampling_params import TRACE_LEVELS, SamplingParams


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
    ranks = f" on {a.tensor_parallel_size} tensor-parallel ranks" if a.tensor_parallel_size > 1 else ""
    print(f"loaded {llm.info.model_name}{ranks} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
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


# ---- chat ----------------------------------------------------------------------------------------
def add_chat_command(sub: Any) -> None:
    chat = sub.add_parser("chat", help="interactive multi-turn chat showing cached tokens per turn")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)


def cmd_chat(a: argparse.Namespace) -> int:
    params = sampling_params(a)
    llm = load_llm(a)
    messages: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    print(
        "onecall chat: empty line or Ctrl-D to quit. Each turn re-sends the whole history; "
        "the prefix cache makes that cheap.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        last = None
        for out in llm.chat_stream(messages, params):
            print(out.delta_text, end="", flush=True)
            last = out
        assert last is not None
        t = last.trace
        print(
            f"\n  [{t.num_prompt_tokens} prompt tokens, {t.num_cached_tokens} cached, "
            f"{t.num_prefilled_tokens} prefilled; TTFT {(t.time_to_first_token or 0) * 1e3:.1f} ms; "
            f"{len(last.token_ids)} new tokens]",
            file=sys.stderr,
        )
        messages.append({"role": "assistant", "content": last.text})
    return 0
