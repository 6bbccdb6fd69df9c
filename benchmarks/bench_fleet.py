"""Replicas behind vllm-router, measured: prefix-cache hit rate, TTFT, throughput and the request split
per routing policy; a replica killed mid-run; a replica added and removed at run time.

    pip install -e '.[fleet]'                               # vllm-router (a Rust wheel; the router is inside)
    python benchmarks/bench_fleet.py                        # cache_aware and round_robin on 2 replicas, 1 replica alone
    python benchmarks/bench_fleet.py --scenario kill        # SIGKILL one of 2 replicas mid-run
    python benchmarks/bench_fleet.py --scenario autoscale   # 1 replica; a supervisor adds a 2nd, drains it, stops it
    python benchmarks/bench_fleet.py --policies cache_aware,round_robin,kv_aware    # kv_aware: KV events
    python benchmarks/bench_fleet.py --scenario all --conversations 8 --turns 4 --max-tokens 8

Every run starts from cold replicas (`onecall serve`, one torch thread each, loopback ports), so no run
inherits another's prefix cache; the router and its Prometheus port bind 127.0.0.1.

The workload: C users at once, each holding multi-turn conversations (its own system prompt, T user
turns; every turn re-sends the whole transcript, the replies included), greedy, streamed with usage.
Per request: the time to its first text (TTFT), prompt and cached tokens from its usage, success or
the error. The client never retries (max_retries=0): a request fails when the client sees an HTTP
error, a broken stream, or a stream that ends without its usage chunk.

Scenarios
  policies   per policy, N replicas behind the router, C conversations of T turns; then the same
             conversations sent to 1 replica alone (no router): the hit rate a perfectly placed fleet
             could reach. After each routed run, POST /flush_cache through the router (it fans out).
             kv_aware: each replica also publishes its prefix cache's KV events (--kv-events-endpoint)
             and the router subscribes to them (--kv-event-source URL=ENDPOINT, one per replica)
  kill       2 replicas, cache_aware; users converse until each replica served --warm requests, then
             one replica is SIGKILLed while it runs a request, and they go on for --after seconds.
             Failures are split into those in flight at the kill (a stream already answering cannot
             move) and those sent after it (the router still choosing the dead replica)
  autoscale  1 replica behind the router; a supervisor starts a 2nd, waits for its /health, adds it
             (POST /add_worker?url=), lets it serve --warm requests, removes it (POST /remove_worker?url=:
             no new requests go to it), waits until its /get_load reads 0 twice (drained), SIGTERMs it
             and waits for its exit; users converse throughout, and --after seconds more. Goal: 0 failed

Reported per run: the fleet hit rate (sum of cached_tokens / sum of prompt_tokens, successful requests),
TTFT p50/p99 (nearest rank), requests/s and output tokens/s, requests per replica (each replica's own
onecall_request_success_total), failures, the 404s the replicas logged (a probe of a route onecall
lacks shows up here) and the router's own warnings. A readable table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

TOPICS = [
    "lighthouses", "volcanoes", "honeybees", "glaciers", "violins", "coral reefs", "comets", "bread",
    "rivers", "chess", "owls", "deserts", "printing presses", "tides", "mushrooms", "bridges",
]  # fmt: skip
QUESTIONS = ["Tell me one fact.", "Why is that?", "Give another example.", "Summarize in one line."]
# The router's defaults notice a dead worker slowly (a health check every 60 s, 3 failures to mark it
# down, 10 failures to open its circuit), and until then cache_aware keeps choosing it for its
# conversations. With these, the first refused connection opens the worker's circuit, the router's
# retry goes to a live worker, and the next 1 s health check marks the dead one down. A circuit opened
# by one stray 5xx closes again after 5 s. --router-defaults leaves them out.
FAILOVER_FLAGS = [
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
    "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "5",
    "--retry-max-retries", "3", "--retry-initial-backoff-ms", "20",
]  # fmt: skip
ACCESS_LOG = re.compile(r'"(?:GET|POST|PUT|DELETE) (\S+?)(?:\?\S*)? HTTP/[\d.]+" 404')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["policies", "kill", "autoscale", "all"], default="policies")
    p.add_argument("--replicas", type=int, default=2, help="replicas in the policies scenario")
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument(
        "--conversations", type=int, default=8, help="users at once (policies: one conversation each)"
    )
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--warm", type=int, default=6, help="kill/autoscale: requests each replica serves first")
    p.add_argument("--after", type=float, default=20.0, help="kill/autoscale: seconds the users go on after")
    p.add_argument(
        "--router-defaults", action="store_true", help="the router's own health/retry/circuit flags"
    )
    p.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a process or a phase")
    a = p.parse_args(argv)
    if not 1 <= a.turns <= len(QUESTIONS):
        p.error(f"--turns must be 1..{len(QUESTIONS)}")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A child process with its output in a temporary log, kept until close() (404s are read from it)."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"fleet-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    async def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout:.0f} s:\n{self.tail()}")

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class Fleet:
    """The processes of one run: replicas by URL, the router; close() stops them all."""

    def __init__(self, args: argparse.Namespace, *, kv_events: bool = False) -> None:
        self.args = args
        self.replicas: dict[str, Process] = {}
        # kv_aware: each replica publishes its prefix cache's KV events here (URL -> ZMQ endpoint)
        self.kv_events: dict[str, str] | None = {} if kv_events else None
        self.router: Process | None = None
        self.router_url = ""
        self.router_metrics_url = ""

    async def add_replicas(self, n: int) -> list[str]:
        """Start n replicas side by side; returns their URLs once each answers /health."""
        urls = [f"http://127.0.0.1:{free_port()}" for _ in range(n)]
        for url in urls:
            cmd = [sys.executable, "-m", "onecall.cli", "serve", "--host", "127.0.0.1"]
            cmd += ["--port", url.rsplit(":", 1)[1], "--num-threads", str(self.args.num_threads)]
            cmd += ["--max-model-len", str(self.args.max_model_len)]
            cmd += ["--model", self.args.model] if self.args.model else []
            if self.kv_events is not None:
                self.kv_events[url] = f"tcp://127.0.0.1:{free_port()}"
                cmd += ["--kv-events-endpoint", self.kv_events[url], "--kv-events-block-size", "16"]
            self.replicas[url] = Process(f"replica{url.rsplit(':', 1)[1]}", cmd)
        await asyncio.gather(*(self.replicas[u].wait_http(f"{u}/health", self.args.timeout) for u in urls))
        return urls

    async def start_router(self, policy: str, workers: list[str]) -> str:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--policy",
            policy,
            "--log-level",
            "warning",
        ]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
        prometheus_port = free_port()
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
        cmd += [] if self.args.router_defaults else FAILOVER_FLAGS
        if self.kv_events is not None:  # the router subscribes to each replica's events
            async with httpx.AsyncClient() as client:
                model = (await client.get(f"{workers[0]}/v1/models", timeout=10)).json()["data"][0]["id"]
            cmd += ["--kv-event-block-size", "16", "--kv-event-model", model]
            for url in workers:
                cmd += ["--kv-event-source", f"{url}={self.kv_events[url]}"]
        self.router = Process(f"router-{policy}", cmd)
        self.router_url = f"http://127.0.0.1:{port}"
        self.router_metrics_url = f"http://127.0.0.1:{prometheus_port}/metrics"
        await self.router.wait_http(f"{self.router_url}/v1/models", self.args.timeout)
        return self.router_url

    async def router_failures(self) -> dict[str, float]:
        """The router's own counters of retries and of failed attempts per worker (Prometheus text)."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(self.router_metrics_url, timeout=10)).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name.endswith("_total") and ("retr" in name or 'outcome="failure"' in line):
                found[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
        return found

    def not_found(self) -> dict[str, int]:
        """404s the replicas logged, by path (uvicorn's access log), dead and stopped replicas included."""
        return dict(Counter(m for p in self.replicas.values() for m in ACCESS_LOG.findall(p.text())))

    def close(self) -> None:
        for proc in [*([self.router] if self.router else []), *self.replicas.values()]:
            proc.close()


@dataclass
class Record:
    """One request as the client saw it (times from time.perf_counter())."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Workload:
    """C users conversing through one base URL; `records` grows as requests are sent."""

    base_url: str
    args: argparse.Namespace
    records: list[Record] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, *, until_stopped: bool) -> float:
        """Each user holds one conversation, or (until_stopped) one after another until `stop` is set.
        Returns the wall time in seconds."""
        client = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=600
        )
        model = (await client.models.list()).data[0].id
        users = self.args.conversations

        async def user(i: int) -> None:
            conversation = i
            await self.converse(client, model, conversation)
            while until_stopped and not self.stop.is_set():
                conversation += users
                await self.converse(client, model, conversation)

        t0 = time.perf_counter()
        await asyncio.gather(*(user(i) for i in range(users)))
        return time.perf_counter() - t0

    async def converse(self, client: openai.AsyncOpenAI, model: str, conversation: int) -> None:
        """T turns on a growing transcript; a failed turn ends the conversation."""
        topic = TOPICS[conversation % len(TOPICS)]
        # a user's later conversations start differently (a prefix shared with an earlier one would
        # pull it to that conversation's replica), the first ones as in earlier runs of this script
        opening = f"Talk {conversation // len(TOPICS)}. " if conversation >= len(TOPICS) else ""
        system = opening + (
            f"You are a patient teacher who only talks about {topic}. Answer briefly and plainly, in "
            f"simple words, and stay on the subject of {topic} whatever the user asks. " * 3
        )
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for question in QUESTIONS[: self.args.turns]:
            messages.append({"role": "user", "content": f"About {topic}: {question}"})
            record = Record(start=time.perf_counter())
            self.records.append(record)
            try:
                reply = await self.turn(client, model, messages, record)
            except (openai.APIError, httpx.HTTPError, ValueError) as e:
                record.error = f"{type(e).__name__}: {e}"[:200]
                return
            finally:
                record.end = time.perf_counter()
            messages.append({"role": "assistant", "content": reply})

    async def turn(
        self, client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]], record: Record
    ) -> str:
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model=model,
            messages=messages,
            max_tokens=self.args.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    if record.ttft is None:
                        record.ttft = time.perf_counter() - record.start
                    parts.append(choice.delta.content)
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.cached_tokens = (details.cached_tokens or 0) if details else 0
                record.completion_tokens = chunk.usage.completion_tokens
        if record.prompt_tokens == 0:
            raise ValueError("the stream ended without its usage chunk (cut short)")
        return "".join(parts)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(run: str, records: list[Record], seconds: float, split: dict[str, int]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    return {
        "run": run,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 1),
        "requests_per_s": round(len(ok) / seconds, 3) if seconds else None,
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / seconds, 2) if seconds else None,
        "seconds": round(seconds, 1),
        "requests_per_replica": split,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def served(client: httpx.AsyncClient, url: str) -> int:
    text = (await client.get(f"{url}/metrics", timeout=10)).text
    return int(metric_sum(text, "onecall_request_success_total"))


async def split_of(urls: list[str]) -> dict[str, int]:
    async with httpx.AsyncClient() as client:
        return {url.rsplit(":", 1)[1]: await served(client, url) for url in urls}


async def wait_until(what: str, check: Any, timeout: float, interval: float = 0.5) -> None:
    """Poll the async predicate `check` until it holds; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout:.0f} s")
        await asyncio.sleep(interval)


async def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(args, kv_events=policy == "kv_aware")
    try:
        urls = await fleet.add_replicas(args.replicas)
        router = await fleet.start_router(policy, urls)
        work = Workload(router, args)
        seconds = await work.run(until_stopped=False)
        result = summarize(policy, work.records, seconds, await split_of(urls))
        async with httpx.AsyncClient() as client:  # the router fans it out to every replica
            result["flush_cache_status"] = (
                await client.post(f"{router}/flush_cache", timeout=30)
            ).status_code
        assert fleet.router is not None
        warnings = [line for line in fleet.router.text().splitlines() if "WARN" in line or "ERROR" in line]
        return {
            **result,
            "replicas": args.replicas,
            "not_found": fleet.not_found(),
            "router_warnings": warnings[:5],
        }
    finally:
        fleet.close()


async def run_single(args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(args)
    try:
        (url,) = await fleet.add_replicas(1)
        work = Workload(url, args)
        seconds = await work.run(until_stopped=False)
        result = summarize("1 replica alone", work.records, seconds, await split_of([url]))
        return {**result, "replicas": 1, "not_found": fleet.not_found()}
    finally:
        fleet.close()


async def run_kill(args: argparse.Namespace) -> dict[str, Any]:
    """Phases: 1. both replicas warm  2. SIGKILL the second while it runs a request  3. --after
    seconds on the survivor."""
    fleet = Fleet(args)
    try:
        urls = await fleet.add_replicas(2)
        work = Workload(await fleet.start_router("cache_aware", urls), args)
        task = asyncio.create_task(work.run(until_stopped=True))
        async with httpx.AsyncClient() as client:

            async def warm() -> bool:
                return all([await served(client, u) >= args.warm for u in urls])

            await wait_until("every replica served --warm requests", warm, args.timeout)
            # the victim: the replica that served more (it holds more conversations), caught busy
            counts = [await served(client, u) for u in urls]
            victim, survivor = (urls[0], urls[1]) if counts[0] >= counts[1] else (urls[1], urls[0])

            async def busy() -> bool:
                return int((await client.get(f"{victim}/get_load")).json()["load"]) > 0

            await wait_until("a request running on the victim", busy, args.timeout, interval=0.05)
            split = await split_of([victim])  # its count as it dies
        t_kill = time.perf_counter()
        fleet.replicas[victim].stop(signal.SIGKILL)
        noticed = await router_marks_down(fleet.router_url, victim, args.after)
        await asyncio.sleep(max(0.0, args.after - (time.perf_counter() - t_kill)))
        work.stop.set()
        seconds = await task
        split.update(await split_of([survivor]))
        failed = [r for r in work.records if r.error]
        result = summarize("kill one of 2", work.records, seconds, split)
        return {
            **result,
            "replicas": 2,
            "killed": victim.rsplit(":", 1)[1],
            "router_flags": "defaults" if args.router_defaults else "failover",
            "in_flight_at_kill": sum(r.start < t_kill < (r.end or math.inf) for r in work.records),
            "failed_in_flight_at_kill": sum(r.start < t_kill for r in failed),
            "failed_sent_after_kill": sum(r.start >= t_kill for r in failed),
            "sent_after_kill": sum(r.start >= t_kill for r in work.records),
            "last_failure_s_after_kill": round(max(r.end for r in failed) - t_kill, 2) if failed else None,
            "router_marked_down_s_after_kill": None if noticed is None else round(noticed - t_kill, 2),
            "router_failures": await fleet.router_failures(),
            "not_found": fleet.not_found(),
        }
    finally:
        fleet.close()


async def router_marks_down(router: str, worker: str, timeout: float) -> float | None:
    """When (time.perf_counter()) the router's GET /workers first shows `worker` unhealthy; None if not
    within timeout seconds."""
    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.perf_counter() < deadline:
            workers = (await client.get(f"{router}/workers")).json()["workers"]
            if not any(w["url"] == worker and w["is_healthy"] for w in workers):
                return time.perf_counter()
            await asyncio.sleep(0.1)
    return None


async def run_autoscale(args: argparse.Namespace) -> dict[str, Any]:
    """Phases: 1. one replica warm  2. start a second, add it  3. it serves --warm requests
    4. remove it, wait until drained, SIGTERM it  5. --after seconds on the first alone."""
    fleet = Fleet(args)
    events: list[tuple[str, float]] = []
    try:
        (first,) = await fleet.add_replicas(1)
        router = await fleet.start_router("cache_aware", [first])
        work = Workload(router, args)
        t0 = time.perf_counter()
        task = asyncio.create_task(work.run(until_stopped=True))

        def event(name: str) -> None:
            events.append((name, round(time.perf_counter() - t0, 1)))

        async with httpx.AsyncClient(timeout=30) as client:

            async def warm(url: str, n: int) -> None:
                async def check() -> bool:
                    return await served(client, url) >= n

                await wait_until(f"{url} served {n} requests", check, args.timeout)

            await warm(first, args.warm)
            event("first replica warm")
            (second,) = await fleet.add_replicas(1)  # the users go on meanwhile
            event("second replica healthy")
            r = await client.post(f"{router}/add_worker", params={"url": second})
            r.raise_for_status()
            event("added to the router")
            await warm(second, args.warm)
            at_removal = await served(client, second)
            event(f"second replica served {at_removal}")
            r = await client.post(f"{router}/remove_worker", params={"url": second})
            r.raise_for_status()
            event("removed from the router")
            idle_reads = 0

            async def drained() -> bool:
                nonlocal idle_reads
                idle_reads = (
                    idle_reads + 1 if (await client.get(f"{second}/get_load")).json()["load"] == 0 else 0
                )
                return idle_reads >= 2

            await wait_until("the removed replica drained", drained, args.timeout)
            event("drained (load 0 twice)")
            split = await split_of([second])
            drained_requests = split[second.rsplit(":", 1)[1]] - at_removal
            code = await asyncio.to_thread(fleet.replicas[second].stop)
            event(f"stopped (exit {code})")
            await asyncio.sleep(args.after)
        work.stop.set()
        seconds = await task
        split.update(await split_of([first]))
        result = summarize("autoscale 1-2-1", work.records, seconds, split)
        return {
            **result,
            "replicas": "1-2-1",
            "events": events,
            "finished_after_removal": drained_requests,
            "router_failures": await fleet.router_failures(),
            "not_found": fleet.not_found(),
        }
    finally:
        fleet.close()


def print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'run':<18}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>8}{'tok/s':>8}{'failed':>8}  requests per replica"
    print(head)
    for r in results:
        p50, p99 = r["ttft_p50_ms"], r["ttft_p99_ms"]
        print(
            f"{r['run']:<18}{r['hit_rate']!s:>9}{p50!s:>8}ms{p99!s:>8}ms{r['requests_per_s']!s:>8}"
            f"{r['output_tokens_per_s']!s:>8}{r['failed']:>5}/{r['requests']:<3} {r['requests_per_replica']}"
        )


async def scenarios(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    if args.scenario in ("policies", "all"):
        for policy in args.policies.split(","):
            results.append(await run_policy(policy, args))
            print(f"-- {policy}: {json.dumps(results[-1])}", flush=True)
        results.append(await run_single(args))
        print(f"-- 1 replica alone: {json.dumps(results[-1])}", flush=True)
    if args.scenario in ("kill", "all"):
        results.append(await run_kill(args))
        print(f"-- kill: {json.dumps(results[-1])}", flush=True)
    if args.scenario in ("autoscale", "all"):
        results.append(await run_autoscale(args))
        print(f"-- autoscale: {json.dumps(results[-1])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = asyncio.run(scenarios(args))
    print()
    print_table(results)
    keys = ("scenario", "replicas", "conversations", "turns", "max_tokens", "num_threads", "warm", "after")
    config = {k: getattr(args, k) for k in keys} | {
        "router": "vllm-router",
        "router_defaults": args.router_defaults,
    }
    print(json.dumps({"config": config, "model": args.model or "embedded", "results": results}))


if __name__ == "__main__":
    main()
