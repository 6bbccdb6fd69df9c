"""`onecall serve`: the OpenAI-compatible HTTP server (server/app.py) under uvicorn.

    onecall serve --port 8000 [--model path/to/model.gguf] [--api-key KEY]
                  [--kv-events-endpoint tcp://127.0.0.1:5557]   # for vllm-router's kv_aware policy

The socket is bound before the model loads (/health answers "loading" meanwhile); SIGTERM drains.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from onecall.engine_flags import add_engine_args, engine_kwargs
from onecall.errors import InvalidParameterError

if TYPE_CHECKING:
    from onecall.server.kv_events import KVEventPublisher


def add_serve_command(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
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
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds one engine step may run before the server declares the engine hung: every request "
        "gets an error, /health turns 503 (0 = no watchdog)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    serve.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish the prefix cache's block inserts and evictions as vLLM's KV events on this ZMQ "
        "address (e.g. tcp://127.0.0.1:5557), for vllm-router --policy kv_aware (server/kv_events.py; "
        "needs the fleet extra)",
    )
    serve.add_argument(
        "--kv-events-block-size",
        type=int,
        default=16,
        help="tokens per block in those events; the router's --kv-event-block-size must match",
    )
    serve.set_defaults(func=cmd_serve)


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
        **engine_kwargs(a), max_num_seqs=a.max_num_seqs, enable_prefix_caching=not a.no_prefix_caching
    )
    resolve_model(a.model)  # a missing file is a clear error now, not a server that never gets ready
    if a.max_waiting < 1:
        raise InvalidParameterError("max_waiting", f"must be >= 1, got {a.max_waiting}")
    if a.step_timeout < 0:
        raise InvalidParameterError(
            "step_timeout", f"must be >= 0 seconds (0: no watchdog), got {a.step_timeout}"
        )
    kv_events = _kv_event_publisher(a)  # binds its ZMQ socket now: a taken port fails before serving
    _log_to_stderr()

    # 2. the loader runs in a worker thread once the server is up
    metrics = Metrics()
    load_failed = False

    def load() -> AsyncEngine:
        nonlocal load_failed
        try:
            engine = Engine(engine_config)
            if kv_events is not None:  # set before the engine thread starts, never changed after
                engine.block_manager.tree.listener = kv_events
            return AsyncEngine(
                engine,
                max_waiting=a.max_waiting,
                metrics=metrics,
                step_timeout=a.step_timeout or None,
            )
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
    try:
        server.run()
    finally:
        if kv_events is not None:
            kv_events.close()
    return 2 if load_failed else 0


def _kv_event_publisher(a: argparse.Namespace) -> KVEventPublisher | None:
    if a.kv_events_endpoint is None:
        return None
    if a.kv_events_block_size < 1:
        raise InvalidParameterError("kv_events_block_size", f"must be >= 1, got {a.kv_events_block_size}")
    try:
        from onecall.server.kv_events import KVEventPublisher
    except ImportError as e:
        raise InvalidParameterError(
            "kv_events_endpoint", f"needs pyzmq and msgpack ({e}): pip install -e '.[fleet]'"
        ) from None
    try:
        return KVEventPublisher(a.kv_events_endpoint, block_size=a.kv_events_block_size)
    except Exception as e:  # zmq.ZMQError: a bad address or a port in use
        raise InvalidParameterError(
            "kv_events_endpoint", f"cannot bind {a.kv_events_endpoint!r}: {e}"
        ) from None


def _log_to_stderr() -> None:
    """onecall's own log lines ("onecall: serving ...", request errors) on stderr, next to uvicorn's."""
    logger = logging.getLogger("onecall")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
