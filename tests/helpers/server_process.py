"""ServerProcess: a real `onecall serve` subprocess on a free loopback port, for the server tests.

    server = ServerProcess("--api-key", "sk-test").start()   # returns once /health says 200
    server.url("/v1/models")
    assert server.stop() == 0                                  # SIGTERM, then the exit code

Output goes to a temporary log file (a pipe nobody reads would fill up and stall the server);
`log()` returns it, and a server that dies or never gets ready raises with its log attached.
`health_seen` records each /health answer received while waiting (503 "loading", then 200).
Also here: the checks every server test shares (the error body, the chat stream invariants).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, *args: str, num_threads: int = 1) -> None:
        self.port = free_port()
        self.args = [
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num-threads",
            str(num_threads),
            *args,
        ]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.health_seen: list[tuple[int, dict]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def launch(self) -> ServerProcess:
        """Start the process without waiting (so several servers can load side by side)."""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "onecall.cli", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        return self

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        assert self._proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"onecall serve exited with {self._proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url("/health"), timeout=2.0)
            except httpx.TransportError:
                time.sleep(0.1)  # not listening yet
                continue
            self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"onecall serve not ready after {timeout} s:\n{self.log()}")

    def start(self, timeout: float = 90.0) -> ServerProcess:
        return self.launch().wait_ready(timeout)

    def send_sigterm(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit code (killed after `timeout`, which fails the caller's check)."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


def sse_payloads(lines: list[str]) -> list[dict | str]:
    """The `data:` payloads of an SSE body, JSON-decoded; "[DONE]" stays a string."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def metric(text: str, name: str) -> float:
    """One unlabelled sample from Prometheus text, e.g. metric(body, "onecall_requests_running")."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in the metrics")


def assert_error(
    r: httpx.Response, status: int, *, type: str = "invalid_request_error", param: Any = ..., code: Any = ...
) -> dict[str, Any]:
    """An OpenAI error body: only `error`, with all four keys; status, type (and param, code if given)."""
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    err: dict[str, Any] = body["error"]
    assert err["type"] == type and isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def check_chat_stream(chunks: list[Any], n: int = 1, usage: bool = True) -> list[str]:
    """Stream invariants; returns each choice's text."""
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    texts, roles, finishes = [""] * n, [0] * n, [0] * n
    for c in chunks[:-1] if usage else chunks:
        assert c.usage is None
        for ch in c.choices:
            assert finishes[ch.index] == 0, "a chunk after the finish_reason"
            if ch.delta.role is not None:
                assert ch.delta.role == "assistant" and roles[ch.index] == 0 and texts[ch.index] == ""
                roles[ch.index] += 1
            assert roles[ch.index] == 1, "the role comes first"
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] += ch.finish_reason is not None
    assert roles == [1] * n and finishes == [1] * n
    if usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return texts
