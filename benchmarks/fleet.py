"""Replicas behind a cache-aware router: N `onecall serve` processes and vllm-router in front.

    pip install -e '.[fleet]'          # vllm-router (a Rust wheel; the router is inside)
    python benchmarks/fleet.py --replicas 2 --max-tokens 8
    python benchmarks/fleet.py --policies cache_aware,round_robin,random --conversations 8 --turns 4
    python benchmarks/fleet.py --router sglang        # sglang-router (pip install sglang-router) instead

Per policy, from a cold start (fresh replicas, so no policy inherits another's prefix cache):

  1. start N replicas on loopback ports, and the router (bound to 127.0.0.1, its Prometheus port
     too) with `--policy P --worker-urls ...`; wait until the router answers /v1/models
  2. run the workload through the router with the official openai async client: C conversations at
     once, each with its own system prompt, T turns each; every turn re-sends the whole transcript
     (the assistant's replies included), greedy, max_tokens small
  3. read every replica's /metrics: prefix-cache hit and query tokens, requests served; the fleet
     hit rate is sum(hits) / sum(queries). Stop everything

A conversation's later turns share its earlier turns' prefix, so a router that keeps a
conversation on one replica lets that replica's radix cache serve it; round robin scatters the
turns and each replica prefills what another already holds. The last line is one JSON object.

vllm-router is the default: it passes onecall's extension fields (`trace`, `top_k`, ...) through
on both completion routes and reads /get_load; sglang-router drops unknown chat fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

TOPICS = [
    "lighthouses", "volcanoes", "honeybees", "glaciers", "violins", "coral reefs", "comets", "bread",
    "rivers", "chess", "owls", "deserts", "printing presses", "tides", "mushrooms", "bridges",
]  # fmt: skip
# router -> (its Python module, its quiet log level): the two take the same flags otherwise
ROUTERS = {
    "sglang": ("sglang_router.launch_router", "warn"),
    "vllm": ("vllm_router.launch_router", "warning"),
}
QUESTIONS = ["Tell me one fact.", "Why is that?", "Give another example.", "Summarize in one line."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", choices=sorted(ROUTERS), default="vllm", help="vllm-router or sglang-router")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a process")
    a = p.parse_args(argv)
    if len(TOPICS) < a.conversations or len(QUESTIONS) < a.turns:
        p.error(f"at most {len(TOPICS)} conversations and {len(QUESTIONS)} turns")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A child process with its output in a temporary log; stop() ends it and waits."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        # closed and removed by stop()
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"fleet-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def start_replica(args: argparse.Namespace, port: int) -> Process:
    cmd = [sys.executable, "-m", "onecall.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-threads", str(args.num_threads), "--max-model-len", str(args.max_model_len)]
    cmd += ["--model", args.model] if args.model else []
    return Process(f"replica{port}", cmd)


def start_router(router: str, policy: str, workers: list[str], port: int, prometheus_port: int) -> Process:
    module, quiet = ROUTERS[router]
    cmd = [sys.executable, "-m", module, "--policy", policy, "--log-level", quiet]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    return Process(f"{router}-router-{policy}", cmd)


async def conversation(client: openai.AsyncOpenAI, model: str, i: int, args: argparse.Namespace) -> None:
    """One conversation: its own system prompt, then `turns` user turns on the growing transcript."""
    topic = TOPICS[i]
    system = (
        f"You are a patient teacher who only talks about {topic}. Answer briefly and plainly, in "
        f"simple words, and stay on the subject of {topic} whatever the user asks. " * 3
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for question in QUESTIONS[: args.turns]:
        messages.append({"role": "user", "content": f"About {topic}: {question}"})
        r = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=args.max_tokens,
            temperature=0.0,
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def replica_stats(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        "hit_tokens": metric_sum(text, "onecall_prefix_cache_hit_tokens_total"),
        "query_tokens": metric_sum(text, "onecall_prefix_cache_query_tokens_total"),
        "requests": metric_sum(text, "onecall_request_success_total"),
    }


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Phases 1-3 of the docstring for one policy; every process is stopped before returning."""
    procs: list[Process] = []
    try:
        ports = [free_port() for _ in range(args.replicas)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for port in ports:
            procs.append(start_replica(args, port))
        for proc, url in zip(procs, urls, strict=True):
            proc.wait_http(f"{url}/health", args.timeout)
        router_port = free_port()
        router = start_router(args.router, policy, urls, router_port, free_port())
        procs.append(router)
        router.wait_http(f"http://127.0.0.1:{router_port}/v1/models", args.timeout)

        async def workload() -> float:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{router_port}/v1", api_key="none", max_retries=0, timeout=600
            )
            model = (await client.models.list()).data[0].id
            t0 = time.perf_counter()
            await asyncio.gather(*(conversation(client, model, i, args) for i in range(args.conversations)))
            return time.perf_counter() - t0

        seconds = asyncio.run(workload())
        replicas = [replica_stats(url) for url in urls]
        hits = sum(r["hit_tokens"] for r in replicas)
        queries = sum(r["query_tokens"] for r in replicas)
        return {
            "policy": policy,
            "seconds": round(seconds, 1),
            "hit_rate": round(hits / queries, 4) if queries else None,
            "hit_tokens": int(hits),
            "query_tokens": int(queries),
            "requests_per_replica": [int(r["requests"]) for r in replicas],
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = []
    for policy in args.policies.split(","):
        print(
            f"-- {args.router} router, {policy}: {args.replicas} replicas, {args.conversations} x {args.turns} turns",
            flush=True,
        )
        results.append(run_policy(policy, args))
        r = results[-1]
        print(f"   hit rate {r['hit_rate']}  ({r['hit_tokens']} / {r['query_tokens']} tokens), "
              f"requests per replica {r['requests_per_replica']}, {r['seconds']} s", flush=True)  # fmt: skip
    print()
    print(f"{'policy':<14}{'fleet prefix-cache hit rate':>28}{'requests per replica':>24}{'seconds':>9}")
    for r in results:
        print(f"{r['policy']:<14}{r['hit_rate']!s:>28}{r['requests_per_replica']!s:>24}{r['seconds']:>9}")
    config = {
        k: getattr(args, k)
        for k in ("router", "replicas", "conversations", "turns", "max_tokens", "num_threads")
    }
    print(json.dumps({"config": config, "model": args.model or "embedded", "results": results}))


if __name__ == "__main__":
    main()
