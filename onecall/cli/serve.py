"""`onecall serve`: the OpenAI-compatible HTTP server (server/app.py) under uvicorn.

    onecall serve --port 8000 [--model path/to/model.gguf] [--api-key KEY | --api-keys-file PATH]
                  [--shared-prefix-cache] [--open-metrics]
                  [--kv-events-endpoint tcp://127.0.0.1:5557]   # for vllm-router's kv_aware policy
                  [--otlp-traces-endpoint http://localhost:4318/v1/traces]   # OTLP spans (otel extra)

The socket is bound before the model loads (/health answers "loading" meanwhile); SIGTERM drains.
Keys and tenants: server/tenants.py (an empty key, a bad keys file, a KV-events endpoint beyond
loopback without --kv-events-allow-remote are refused before anything binds).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from onecall.engine_flags import add_engine_args, engine_kwargs
from onecall.errors import InvalidParameterError

if TYPE_CHECKING:
    from onecall.server.kv_events import KVEventPublisher
    from onecall.server.state import ServerConfig

logger = logging.getLogger("onecall.serve")


def add_serve_command(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /, /health, /openapi.json, /docs: "
        'one tenant, named "default" (an empty key is refused)',
    )
    serve.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="one tenant per line, 'name key' (# comments); each tenant's prompts are cached in its "
        "own namespace, so no tenant reads, times or sees in the trace another's (keeps keys off "
        "the command line; with --api-key, 'default' is one more tenant)",
    )
    serve.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="tenants share one prefix cache (hits on a common system prompt across tenants; a "
        "tenant can then tell from cached_tokens and timing what another cached; the trace still "
        "hides another's tokens)",
    )
    serve.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without a key (by default it needs one whenever keys are set)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: the model's own)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    serve.add_argument(
        "--state-snapshots", type=int, default=None,
        help="a hybrid (linear-attention) model: prefix snapshots of its state to keep (default: --max-num-seqs)",
    )  # fmt: skip
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
        "--max-restarts",
        type=int,
        default=3,
        help="times a stopped engine is rebuilt in place (same weights, empty prefix cache; requests in "
        "flight get a retryable 503) within --restart-window seconds; past that it stays dead (0 = never)",
    )
    serve.add_argument("--restart-window", type=float, default=300.0, metavar="SECONDS")
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
    serve.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="let --kv-events-endpoint bind beyond loopback (*, 0.0.0.0, an interface or a host): "
        "the events carry every cached prompt's token ids, unauthenticated",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send each HTTP request's trace as OpenTelemetry spans (OTLP over HTTP/protobuf, e.g. "
        "http://localhost:4318/v1/traces); a W3C traceparent header makes them part of the caller's "
        "trace (server/otel.py; needs the otel extra)",
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
    from onecall.formats.checkpoint import resolve_model
    from onecall.server.app import create_app
    from onecall.server.async_engine import AsyncEngine
    from onecall.server.metrics import Metrics

    # 1. everything a flag can get wrong fails here, before the socket is bound
    url = f"http://{a.host}:{a.port}"
    config = _server_config(a, url)  # keys and tenants: an empty key or a bad keys file stops here
    engine_config = EngineConfig(
        **engine_kwargs(a),
        max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=not a.no_prefix_caching,
        state_snapshots=a.state_snapshots,
    )
    resolve_model(a.model)  # a missing file is a clear error now, not a server that never gets ready
    if config.otlp_traces_endpoint is not None:
        from onecall.server.otel import require_sdk

        require_sdk()  # the otel extra is missing: say so now
    if a.max_waiting < 1:
        raise InvalidParameterError("max_waiting", f"must be >= 1, got {a.max_waiting}")
    if a.step_timeout < 0:
        raise InvalidParameterError(
            "step_timeout", f"must be >= 0 seconds (0: no watchdog), got {a.step_timeout}"
        )
    kv_events = _kv_event_publisher(a, config)  # binds its ZMQ socket now: a taken port fails here
    _log_to_stderr()
    for warning in _warnings(a, config):
        logger.warning("onecall: warning: %s", warning)

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
                max_restarts=a.max_restarts,
                restart_window=a.restart_window,
            )
        except BaseException:
            load_failed = True
            server.should_exit = True
            raise

    # 3. serve until a signal
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


def _server_config(a: argparse.Namespace, url: str) -> ServerConfig:
    """--api-key, --api-keys-file and the sharing flags as a ServerConfig (which checks the keys)."""
    from onecall.server.state import ServerConfig
    from onecall.server.tenants import load_keys_file

    tenants = () if a.api_keys_file is None else tuple(load_keys_file(a.api_keys_file))
    return ServerConfig(
        served_model_name=a.served_model_name,
        api_key=a.api_key,
        tenants=tenants,
        shared_prefix_cache=a.shared_prefix_cache,
        open_metrics=a.open_metrics,
        url=url,
        otlp_traces_endpoint=a.otlp_traces_endpoint,
    )


def _kv_event_publisher(a: argparse.Namespace, config: ServerConfig) -> KVEventPublisher | None:
    if a.kv_events_endpoint is None:
        return None
    if a.kv_events_block_size < 1:
        raise InvalidParameterError("kv_events_block_size", f"must be >= 1, got {a.kv_events_block_size}")
    try:
        from onecall.server.kv_events import KVEventPublisher, is_loopback_endpoint
    except ImportError as e:
        raise InvalidParameterError(
            "kv_events_endpoint", f"needs pyzmq and msgpack ({e}): pip install -e '.[fleet]'"
        ) from None
    if not a.kv_events_allow_remote and not is_loopback_endpoint(a.kv_events_endpoint):
        raise InvalidParameterError(
            "kv_events_endpoint",
            f"{a.kv_events_endpoint!r} binds beyond loopback, and the events carry every cached "
            "prompt's token ids to anyone who connects (ZMQ, no authentication): bind "
            "tcp://127.0.0.1:PORT or ipc://PATH, or pass --kv-events-allow-remote",
        )
    try:
        return KVEventPublisher(
            a.kv_events_endpoint,
            block_size=a.kv_events_block_size,
            salt=config.auth.published_cache_salt,
            allow_remote=a.kv_events_allow_remote,
        )
    except Exception as e:  # zmq.ZMQError: a bad address or a port in use
        raise InvalidParameterError(
            "kv_events_endpoint", f"cannot bind {a.kv_events_endpoint!r}: {e}"
        ) from None


def _warnings(a: argparse.Namespace, config: ServerConfig) -> list[str]:
    """What the flags allow but an operator should hear about, once, at startup."""
    from onecall.server.tenants import is_readable_by_others

    auth, out = config.auth, []
    if auth.is_open and not _is_loopback_host(a.host):
        out.append(
            f"{a.host} is reachable from other machines and no key is set: anyone who reaches it "
            "can use it, and everyone's requests share one cache and see each other's cached "
            "tokens in the trace (--api-key / --api-keys-file)"
        )
    if a.api_keys_file is not None and is_readable_by_others(a.api_keys_file):
        out.append(f"{a.api_keys_file} holds API keys and other users can read it: chmod 600 it")
    if a.shared_prefix_cache and not auth.is_shared:
        out.append("--shared-prefix-cache does nothing with fewer than two tenants")
    if a.kv_events_endpoint is not None:
        from onecall.server.kv_events import is_loopback_endpoint  # it was imported to publish

        if not is_loopback_endpoint(a.kv_events_endpoint):
            out.append(
                f"KV events on {a.kv_events_endpoint} (--kv-events-allow-remote): every cached "
                "prompt's token ids go to anyone who connects"
            )
        if len(auth.tenants) > 1 and not auth.is_shared:
            out.append(
                "KV events describe the shared namespace only, and each tenant has its own: none of "
                "their prompts is published (--shared-prefix-cache shares one, and publishes it)"
            )
    return out


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def _log_to_stderr() -> None:
    """onecall's own log lines ("onecall: serving ...", request errors) on stderr, next to uvicorn's."""
    logger = logging.getLogger("onecall")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
