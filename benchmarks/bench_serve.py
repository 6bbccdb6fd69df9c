"""Serving benchmark: `onecall serve` through the official openai async client.

    python benchmarks/bench_serve.py --spawn                    # starts the servers itself, full sizes
    python benchmarks/bench_serve.py --spawn --quick            # a short smoke run
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 [--url-no-cache URL | --spawn-no-cache]

Three measurements, all streaming chat completions at temperature 0:

  load          concurrency 1, 4, 16 and 32, fixed prompts, fixed max_tokens (ignore_eos, so every
                request makes exactly that many tokens): time to first token p50/p99 (request sent ->
                first content chunk), inter-token latency p50/p99 (between content chunks of one
                stream) and output tokens/s (completion tokens of the level / its wall time)
  10-turn chat  the seed's experiment: the client re-sends the whole transcript every turn. Per turn:
                prompt tokens sent, tokens served by the prefix cache and tokens actually prefilled
                (the response's `trace` extension), and the TTFT, on this server and on one started
                with --no-prefix-caching (--spawn starts both, one after the other)
  HTTP cost     TTFT through the server against the Python API (onecall.LLM in a child process with
                the same engine flags) at concurrency 1, on the same conversations, alternating
                one and the other so both see the same machine load; goal: within 10% or 5 ms

Every prompt carries a per-run tag so a long-running server's prefix cache holds none of them.
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]
TOPICS = (
    "a lighthouse keeper", "the moon landing", "a lost umbrella", "bread baking", "a chess match",
    "winter in Oslo", "a robot gardener", "the history of paper", "a jazz trumpet", "deep sea fish",
    "a mountain train", "learning to swim", "an old library", "volcanoes", "a desert caravan", "bees",
)  # fmt: skip
HTTP_COST_GOAL = (0.10, 0.005)  # within 10% or 5 ms of the Python API's TTFT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--url", default="http://127.0.0.1:8000/v1", help="a running server (ignored with --spawn)"
    )
    ap.add_argument("--spawn", action="store_true", help="start `onecall serve` (and a no-cache one) here")
    ap.add_argument("--spawn-no-cache", action="store_true", help="start only the --no-prefix-caching server")
    ap.add_argument("--url-no-cache", default=None, help="a running server started with --no-prefix-caching")
    ap.add_argument("--skip-no-cache", action="store_true", help="no cache-disabled comparison")
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--model", default=None, help="for spawned servers and the Python API (default: embedded)"
    )
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request in the load test")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--http-requests", type=int, default=16, help="requests for the HTTP-cost comparison")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a server to get ready")
    ap.add_argument("--llm-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.quick:
        args.levels, args.max_tokens = [c for c in args.levels if c <= 4] or [1], min(args.max_tokens, 16)
        args.turns, args.http_requests = min(args.turns, 4), min(args.http_requests, 4)
    args.tag = f"run {random.Random().randrange(10**6):06d}"  # keeps a warm server's cache out of it
    return args


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def num(value: int | None) -> str:
    return "-" if value is None else str(value)


# ---- servers ------------------------------------------------------------------------------------
def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("model", "dtype", "device", "num_threads"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


class SpawnedServer:
    """`onecall serve` on a free loopback port, its log in a temp file; stop() sends SIGTERM."""

    def __init__(self, args: argparse.Namespace, *, no_cache: bool) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "onecall.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += engine_flags(args) + (["--no-prefix-caching"] if no_cache else [])
        cmd += ["--api-key", args.api_key] if args.api_key else []
        fd, name = tempfile.mkstemp(prefix="bench_serve_", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}/v1"
        self._wait_ready(f"http://127.0.0.1:{port}/health", args.start_timeout)

    def _wait_ready(self, health: str, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(health, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SystemExit(f"the server was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM, then the exit code (the server should exit 0); SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


# ---- one streamed request -----------------------------------------------------------------------
async def stream_chat(client: Any, model: str, messages: Messages, max_tokens: int) -> dict[str, Any]:
    """Send one streaming chat completion; timings as the client sees them, plus usage and trace."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "trace": True},
    )
    first = last = None
    itl: list[float] = []
    text: list[str] = []
    usage, trace = None, None
    async for chunk in stream:
        now = time.perf_counter()
        trace = (chunk.model_extra or {}).get("trace") or trace
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                if last is not None:
                    itl.append(now - last)
                first = first if first is not None else now
                last = now
                text.append(choice.delta.content)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft": None if first is None else first - t0,
        "itl": itl,
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else len(text),
        "cached_tokens": getattr(details, "cached_tokens", None),
        "prefilled_tokens": trace.get("num_prefilled_tokens") if isinstance(trace, dict) else None,
        "engine_ttft": trace.get("time_to_first_token") if isinstance(trace, dict) else None,
    }


def prompt(args: argparse.Namespace, label: str, i: int) -> Messages:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"({args.tag}, {label}.{i}) Write a short story about {topic}."}]


# ---- the three measurements ---------------------------------------------------------------------
async def load_level(client: Any, model: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    """`concurrency` workers share max(8, 2 x concurrency) requests (quick: 2 x concurrency)."""
    num_requests = 2 * concurrency if args.quick else max(8, 2 * concurrency)
    todo = list(range(num_requests))
    results: list[dict[str, Any]] = []
    errors: list[str] = []

    async def worker() -> None:
        while todo:
            i = todo.pop()
            try:
                results.append(
                    await stream_chat(client, model, prompt(args, f"c{concurrency}", i), args.max_tokens)
                )
            except Exception as e:  # noqa: BLE001 - counted and shown; the run goes on
                errors.append(repr(e))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [x for r in results for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": percentile(itls, 0.5),
        "itl_p99": percentile(itls, 0.99),
        "output_tokens_per_s": sum(r["completion_tokens"] or 0 for r in results) / wall,
        "wall_s": wall,
    }


async def ten_turn_chat(client: Any, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The client re-sends the transcript each turn; the server's prefix cache should serve it."""
    messages: Messages = [{"role": "system", "content": f"You are terse. ({args.tag})"}]
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Question number {turn}: what is {turn} + {turn}?"})
        r = await stream_chat(client, model, messages, 32 if not args.quick else 8)
        messages.append({"role": "assistant", "content": r["text"]})
        turns.append(
            {k: r[k] for k in ("prompt_tokens", "cached_tokens", "prefilled_tokens", "ttft", "engine_ttft")}
        )
    return turns


class PythonAPIChild:
    """onecall.LLM in a child process with the server's engine flags: one conversation per stdin line,
    one JSON line back ({"ttft", "engine_ttft"}). It stays idle while the server works."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--llm-child", "--max-tokens", str(args.max_tokens)] + engine_flags(
            args
        )
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ttft(self, messages: Messages) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(messages) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the Python API child exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def llm_child(args: argparse.Namespace) -> None:
    from onecall import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.num_threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(8):  # a fresh engine's first requests run slow (seen on CPU): warm it like the server
        for _ in llm.chat_stream(prompt(args, "child-warmup", i), params):
            pass
    for line in sys.stdin:
        t0 = time.perf_counter()
        first = None
        for out in llm.chat_stream(json.loads(line), params):
            if first is None and out.delta_text:
                first = time.perf_counter() - t0
        print(json.dumps({"ttft": first, "engine_ttft": out.trace.time_to_first_token}), flush=True)


async def http_cost_pairs(client: Any, model: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """The same conversations, alternating: one through the server, one through the Python API, so
    both see the same machine load. Two warm-up pairs are left out of the numbers."""
    child = await asyncio.to_thread(PythonAPIChild, args)
    pairs: dict[str, list[float]] = {"server": [], "server_engine": [], "api": [], "api_engine": []}
    try:
        for i in range(2 + args.http_requests):
            messages = prompt(args, "http", i)
            server = await stream_chat(client, model, messages, args.max_tokens)
            api = await asyncio.to_thread(child.ttft, messages)
            if i >= 2:
                for key, value in (("server", server["ttft"]), ("server_engine", server["engine_ttft"]),
                                   ("api", api["ttft"]), ("api_engine", api["engine_ttft"])):  # fmt: skip
                    if value is not None:
                        pairs[key].append(value)
    finally:
        child.close()
    return pairs


# ---- driver -------------------------------------------------------------------------------------
async def run_server(url: str, args: argparse.Namespace, *, full: bool) -> dict[str, Any]:
    """Everything measured against one server; `full=False` is the no-cache server: the chat only."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=args.api_key or "unused", max_retries=0, timeout=600.0)
    model = (await client.models.list()).data[0].id
    for i in range(2):  # warm-up: first-request allocations stay out of the numbers
        await stream_chat(client, model, prompt(args, "warmup", i), 4)
    out: dict[str, Any] = {"url": url, "model": model}
    if full:
        out["load"] = []
        for c in args.levels:
            print(f"  load at concurrency {c} ...", file=sys.stderr, flush=True)
            out["load"].append(await load_level(client, model, args, c))
    print("  10-turn chat ...", file=sys.stderr, flush=True)
    out["chat"] = await ten_turn_chat(client, model, args)
    if full:
        print("  HTTP cost ...", file=sys.stderr, flush=True)
        out["http"] = await http_cost_pairs(client, model, args)
    await client.close()
    return out


def server_plan(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(name, url) of the servers to measure, in order; url None: spawn one. "cache" gets every
    measurement, "no_cache" (started with --no-prefix-caching) the 10-turn chat only."""
    plan: list[tuple[str, str | None]] = [("cache", None if args.spawn else args.url)]
    if args.skip_no_cache:
        return plan
    if args.spawn_no_cache or args.spawn:
        plan.append(("no_cache", None))
    elif args.url_no_cache:
        plan.append(("no_cache", args.url_no_cache))
    return plan


def measure_servers(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One server at a time (a spawned one is stopped with SIGTERM before the next starts)."""
    results: dict[str, dict[str, Any]] = {}
    for name, url in server_plan(args):
        print(f"{name} server: {url or 'spawning'} ...", file=sys.stderr, flush=True)
        server = SpawnedServer(args, no_cache=name == "no_cache") if url is None else None
        try:
            result = asyncio.run(run_server(server.url if server else str(url), args, full=name == "cache"))
        finally:
            exit_code = server.stop() if server else None
        result["sigterm_exit_code"] = exit_code
        results[name] = result
    return results


# ---- report -------------------------------------------------------------------------------------
def print_load(load: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nload: streaming chat, max_tokens={args.max_tokens}, temperature 0, ignore_eos")
    header = (
        f"{'concurrency':>11}{'requests':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    )
    header += f"{'out tok/s':>11}{'errors':>8}"
    print(header + "   (times in ms)\n" + "-" * len(header))
    for r in load:
        print(
            f"{r['concurrency']:>11}{r['requests']:>10}{ms(r['ttft_p50']):>10}{ms(r['ttft_p99']):>10}"
            f"{ms(r['itl_p50']):>9}{ms(r['itl_p99']):>9}{r['output_tokens_per_s']:>11.1f}{r['errors']:>8}"
        )
        if r["first_error"]:
            print(f"    first error: {r['first_error']}")


def chat_totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> int | None:
        values = [t[key] for t in turns]
        return None if any(v is None for v in values) else sum(values)

    return {k: total(k) for k in ("prompt_tokens", "cached_tokens", "prefilled_tokens")}


def print_chat(cache: list[dict[str, Any]], no_cache: list[dict[str, Any]] | None) -> None:
    print(f"\n{len(cache)}-turn chat, the client re-sending the transcript (TTFT in ms)")
    header = f"{'turn':>4}{'sent':>7}{'cached':>8}{'prefilled':>11}{'TTFT':>8}"
    header += f"  | no cache:{'prefilled':>10}{'TTFT':>8}" if no_cache else ""
    print(header + "\n" + "-" * len(header))
    for turn, c in enumerate(cache):
        line = f"{turn:>4}{num(c['prompt_tokens']):>7}{num(c['cached_tokens']):>8}"
        line += f"{num(c['prefilled_tokens']):>11}{ms(c['ttft']):>8}"
        if no_cache:
            n = no_cache[turn]
            line += f"  | {'':>9}{num(n['prefilled_tokens']):>10}{ms(n['ttft']):>8}"
        print(line)
    t = chat_totals(cache)
    tail = f" (without the cache: {chat_totals(no_cache)['prefilled_tokens']})" if no_cache else ""
    print(
        f"total: {t['prompt_tokens']} prompt tokens sent, {t['cached_tokens']} served by the cache, "
        f"{t['prefilled_tokens']} prefilled{tail}"
    )


def http_cost(pairs: dict[str, list[float]]) -> dict[str, Any]:
    p50 = {key: percentile(values, 0.5) for key, values in pairs.items()}
    out: dict[str, Any] = {f"{key}_ttft_p50": value for key, value in p50.items()}
    s50, a50 = p50["server"], p50["api"]
    if s50 is None or a50 is None:
        return out | {"goal_met": None}
    rel, abs_ = HTTP_COST_GOAL
    out |= {"overhead_s": s50 - a50, "overhead_pct": 100 * (s50 - a50) / a50}
    out["goal_met"] = s50 - a50 <= max(rel * a50, abs_)
    print(f"\nHTTP layer, concurrency 1, {len(pairs['server'])} requests each way, alternating (TTFT p50):")
    print(f"  through the server  {ms(s50):>8} ms  (engine-side {ms(p50['server_engine'])} ms)")
    print(f"  Python API          {ms(a50):>8} ms  (engine-side {ms(p50['api_engine'])} ms)")
    print(
        f"  HTTP cost {ms(s50 - a50)} ms ({out['overhead_pct']:+.1f}%); goal within 10% or 5 ms: "
        f"{'met' if out['goal_met'] else 'MISSED'}"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.llm_child:
        llm_child(args)
        return
    servers = measure_servers(args)
    cache, no_cache = servers["cache"], servers.get("no_cache")
    print_load(cache["load"], args)
    print_chat(cache["chat"], no_cache["chat"] if no_cache else None)
    cost = http_cost(cache["http"])
    for name, result in servers.items():
        if result["sigterm_exit_code"] is not None:
            print(f"{name} server: exit code {result['sigterm_exit_code']} after SIGTERM")
    config = {k: getattr(args, k) for k in ("model", "dtype", "device", "num_threads", "levels", "max_tokens",
                                             "turns", "http_requests", "quick", "tag")}  # fmt: skip
    summary = {
        "cache": chat_totals(cache["chat"]),
        "no_cache": chat_totals(no_cache["chat"]) if no_cache else None,
    }
    print(json.dumps({"bench": "bench_serve", "config": config, "servers": servers,
                      "chat_totals": summary, "http_cost": cost}))  # fmt: skip


if __name__ == "__main__":
    main()
