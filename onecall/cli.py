"""The `onecall` command: run one call and show its anatomy, or chat turn by turn.

    onecall run "What is the capital of France?" --trace     # answer + the trace table
    onecall run "..." --json                                  # answer + trace as JSON
    onecall run "..." --save-bundle call.json                 # + a replayable bundle
    onecall replay call.json                                  # re-run it: did every token match?
    onecall chat                                              # multi-turn, cached tokens per turn
    onecall serve --port 8000                                 # the OpenAI-compatible HTTP server
    onecall lab --out lab-report                              # every experiment, report with plots

run and replay (and the sampling flags chat shares) live in cli_run.py; the engine flags every
command takes (--model, --dtype, ...), the lab's included, in engine_flags.py.

Errors a user can cause print one clear line and exit 2; no stack trace.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from onecall.cli_run import add_replay_command, add_run_command
from onecall.cli_run import add_sampling_args as _add_sampling_args
from onecall.cli_run import load_llm as _llm
from onecall.cli_run import sampling_params as _params
from onecall.engine_flags import add_engine_args as _add_engine_args
from onecall.engine_flags import engine_kwargs as _engine_kwargs
from onecall.errors import InvalidParameterError, OnecallError


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
    from onecall.model.checkpoint import resolve_model
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
    add_run_command(sub)
    add_replay_command(sub)
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
    _add_lab_command(sub)
    return parser


def _add_lab_command(sub: Any) -> None:
    """`onecall lab`: its flags and command live in onecall/lab/cli.py (imported here, so it keeps
    its own heavy imports inside cmd_lab); the subcommand is left out while that module is missing."""
    try:
        from onecall.lab.cli import add_lab_arguments, cmd_lab
    except ModuleNotFoundError as e:
        if e.name in ("onecall.lab", "onecall.lab.cli"):
            return
        raise
    p_lab = sub.add_parser("lab", help="reproduce the anatomy of one call on this model: a report with plots")
    add_lab_arguments(p_lab)
    p_lab.set_defaults(func=cmd_lab)


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
