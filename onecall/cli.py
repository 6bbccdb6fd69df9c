"""The `onecall` command: run one call and show its anatomy, or chat turn by turn.

    onecall run "What is the capital of France?" --trace     # answer + the trace table
    onecall run "..." --json                                  # answer + trace as JSON
    onecall chat                                              # multi-turn, cached tokens per turn
    onecall serve --port 8000                                 # the OpenAI-compatible HTTP server

Errors a user can cause print one clear line and exit 2; no stack trace.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from typing import Any

from onecall.errors import InvalidParameterError, OnecallError
from onecall.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument(
        "--kernels",
        default="fast",
        choices=["fast", "reference"],
        help="fast: oneDNN and the GGUF's own int4 weights on CPU (default); reference: plain torch ops",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message")


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        stop=tuple(a.stop),
    )


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields every subcommand takes from _add_engine_args' flags."""
    return {
        "model": a.model,
        "dtype": a.dtype,
        "device": a.device,
        "max_model_len": a.max_model_len,
        "kv_cache_gib": a.kv_cache_gib,
        "num_threads": a.num_threads,
        "kernels": a.kernels,
    }


def _llm(a: argparse.Namespace) -> Any:
    from onecall.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(a))
    print(f"loaded {llm.engine.parts.model_name} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return llm


def cmd_run(a: argparse.Namespace) -> int:
    from onecall.trace_view import format_trace

    params = _params(a)
    llm = _llm(a)
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
    if a.json:
        print(
            json.dumps(
                {
                    "text": last.text,
                    "token_ids": last.token_ids,
                    "finish_reason": last.finish_reason,
                    "trace": last.trace.to_dict(),
                }
            )
        )
        return 0
    print()
    if a.trace:
        print()
        print(format_trace(last.trace, llm.tokenizer, color=sys.stdout.isatty()))
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    params = _params(a)
    llm = _llm(a)
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


def cmd_serve(a: argparse.Namespace) -> int:
    """Bind first, load the model in the background (/health is 503 until it is in memory), serve.

    SIGTERM or Ctrl-C: stop accepting, let in-flight requests finish for up to --shutdown-timeout
    seconds, abort the rest, exit 0. A model that fails to load stops the server with exit code 2.
    """
    import uvicorn

    from onecall.config import EngineConfig
    from onecall.engine.engine import Engine
    from onecall.model.loader import resolve_model
    from onecall.server.app import ServerConfig, create_app
    from onecall.server.async_engine import AsyncEngine
    from onecall.server.metrics import Metrics

    # 1. everything a flag can get wrong fails here, before the socket is bound
    engine_config = EngineConfig(
        **_engine_kwargs(a), max_num_seqs=a.max_num_seqs, enable_prefix_caching=not a.no_prefix_caching
    )
    resolve_model(a.model)  # a missing file is a clear error now, not a server that never gets ready
    if a.max_waiting < 1:
        raise InvalidParameterError("max_waiting", f"must be >= 1, got {a.max_waiting}")
    _log_to_stderr()

    # 2. the loader runs in a worker thread once the server is up
    metrics = Metrics()
    load_failed = False

    def load() -> AsyncEngine:
        nonlocal load_failed
        try:
            return AsyncEngine(Engine(engine_config), max_waiting=a.max_waiting, metrics=metrics)
        except BaseException:
            load_failed = True
            server.should_exit = True
            raise

    # 3. serve until a signal
    url = f"http://{a.host}:{a.port}"
    config = ServerConfig(served_model_name=a.served_model_name, api_key=a.api_key, url=url)
    app = create_app(load, config, metrics=metrics)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=a.host, port=a.port, timeout_graceful_shutdown=a.shutdown_timeout, lifespan="on"
        )
    )
    # uvicorn re-raises the signal it caught once it has shut down gracefully; with the default
    # SIGTERM action that would kill the process (exit -15). A no-op handler lets us return 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 2 if load_failed else 0


def _log_to_stderr() -> None:
    """onecall's own log lines ("onecall: serving ...", request errors) on stderr, next to uvicorn's."""
    logger = logging.getLogger("onecall")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onecall", description="Serve a model and see what one call really does."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one call and print the answer (and its trace)")
    run.add_argument("prompt")
    run.add_argument("--trace", action="store_true", help="print the stage-by-stage trace table")
    run.add_argument("--json", action="store_true", help="print answer and trace as one JSON object")
    run.add_argument(
        "--raw", action="store_true", help="complete the prompt as raw text, without the chat template"
    )
    _add_engine_args(run)
    _add_sampling_args(run)
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="interactive multi-turn chat showing cached tokens per turn")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: the model's own)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    serve.add_argument("--max-waiting", type=int, default=256, help="most requests queued; beyond it a 429")
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable the radix prefix cache")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OnecallError as e:
        print(f"onecall: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
