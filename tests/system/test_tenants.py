"""A server many people share (server/tenants.py): who a request is, what it may read.

1. Keys: --api-key and --api-keys-file make tenants; an empty or whitespace key, a malformed keys
   file (named by line), a name or key given twice are refused; each key authenticates its own
   tenant; no key shows in a repr.
2. Cache namespaces, in process over the tiny engine with two tenants and the official openai client.
   Tenant A's prompt holds a PIN; tenant B probes with A's prefix and another digit, the probe that
   read a PIN back one digit per request through the trace's `divergence.cached_token_text`:
   - by default B gets no cached token and no divergence at all; A's own probe still sees its digit;
   - with --shared-prefix-cache B gets `cached_tokens` (what sharing means) but the divergence has
     no cached token, streamed or not; A under a cache_salt of its own sees its digit again.
3. /metrics needs a key once keys are set (any tenant's), --open-metrics opens it; /, /health,
   /openapi.json and /docs stay open.
4. `onecall serve` (subprocesses, marked server): an empty key and a KV-events endpoint beyond
   loopback exit 2 with the reason before anything binds; a real server with a keys file keeps two
   tenants apart end to end.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from onecall.cli import build_parser
from onecall.cli.serve import _kv_event_publisher, _warnings
from onecall.errors import InvalidParameterError
from onecall.sampling_params import MAX_CACHE_SALT
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from onecall.server.tenants import SHARED_CACHE_SALT, Tenant, Tenants, load_keys_file
from tests.helpers.server_process import ServerProcess, assert_error, free_port
from tests.helpers.tiny_engine import tiny_engine

ALICE, BOB = Tenant("alice", "sk-alice-0123"), Tenant("bob", "sk-bob-4567")
SECRET = "The vault PIN is 4711. Keep it safe."
PROBE = "The vault PIN is 0"  # A's prefix, then a guess at the PIN's first digit


# ---- 1. keys ----------------------------------------------------------------------------------------
def test_an_empty_or_blank_api_key_is_refused() -> None:
    for key in ("", "   "):
        with pytest.raises(InvalidParameterError, match="api_key: is empty"):
            ServerConfig(api_key=key)
    for tenants, problem in [
        ((Tenant("a", ""),), "the key of 'a' is empty"),
        ((Tenant("a", " k "),), "starts or ends with whitespace"),
        ((Tenant("default", "other"),), "'default' is given twice"),  # with --api-key's "default"
        ((Tenant("a", "sk"),), "is another tenant's too"),
    ]:
        with pytest.raises(InvalidParameterError, match=problem):
            ServerConfig(api_key="sk", tenants=tenants)
    config = ServerConfig(api_key="sk-never-printed", tenants=(ALICE,))
    assert "sk-never-printed" not in repr(config) and ALICE.key not in repr(config)


def test_keys_file_one_tenant_per_line_and_refusals_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# the team\n\n{ALICE.name} {ALICE.key}\n  {BOB.name}\t{BOB.key}  \n")
    assert load_keys_file(path) == [ALICE, BOB]
    for text, problem in [
        (f"alice {ALICE.key}\nbob\n", "line 2: expected 'name key' (two fields), got 1"),
        ("alice k1 # a comment\n", "line 1: expected 'name key' (two fields), got 5"),
        ("alice k1\nalice k2\n", "line 2: the tenant name 'alice' is given twice"),
        ("alice k1\nbob k1\n", "line 2: the key of 'bob' is another tenant's too"),
        ("al/ice k1\n", "line 1: the name 'al/ice' must be"),
        ("alice alice\n", "line 1: the key of 'alice' is its name"),
        ("# nothing\n\n", "holds no 'name key' line"),
    ]:
        path.write_text(text)
        with pytest.raises(InvalidParameterError) as e:
            load_keys_file(path)
        assert str(e.value).startswith("api_keys_file: ") and problem in str(e.value), e.value
    with pytest.raises(InvalidParameterError, match="cannot read"):
        load_keys_file(tmp_path / "missing")


def test_each_key_authenticates_its_own_tenant() -> None:
    auth = Tenants.build("sk-default-key", [ALICE, BOB])
    assert auth.authenticate(f"Bearer {ALICE.key}") == ALICE
    assert auth.authenticate(f"bearer {BOB.key}") == BOB
    assert auth.authenticate("Bearer sk-default-key") == Tenant("default", "sk-default-key")
    for header in ("", "Bearer ", "Bearer", f"Basic {ALICE.key}", ALICE.key, "Bearer sk-alice"):
        assert auth.authenticate(header) is None, header


def test_cache_namespaces_are_per_tenant_and_within_the_salt_limit() -> None:
    isolated, shared = Tenants([ALICE, BOB]), Tenants([ALICE, BOB], shared_prefix_cache=True)
    long_salt = "s" * MAX_CACHE_SALT
    a, b = isolated.cache_salt(ALICE, None), isolated.cache_salt(BOB, None)
    assert a is not None and b is not None and a != b
    assert isolated.cache_salt(ALICE, None) == a  # the same namespace for every request of a tenant
    assert len(isolated.cache_salt(ALICE, long_salt) or "") <= MAX_CACHE_SALT
    assert isolated.cache_salt(ALICE, "x") not in (a, isolated.cache_salt(BOB, "x"), "x")
    assert shared.cache_salt(ALICE, None) == shared.cache_salt(BOB, None) == SHARED_CACHE_SALT
    assert shared.cache_salt(ALICE, "x") == "x"  # a salt is a namespace for whoever knows it
    assert Tenants([]).cache_salt(None, "x") == "x" and Tenants([ALICE]).cache_salt(ALICE, None) is None


# ---- 2. cache namespaces, in process ------------------------------------------------------------------
Clients = dict[Tenant, openai.AsyncOpenAI]


def _serve(config: ServerConfig, test: Callable[[Clients, httpx.AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        app = create_app(AsyncEngine(tiny_engine()), config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as http:
                clients = {
                    t: openai.AsyncOpenAI(
                        base_url="http://onecall/v1", api_key=t.key, http_client=http, max_retries=0
                    )
                    for t in (ALICE, BOB)
                }
                await asyncio.wait_for(test(clients, http), timeout=120)

    asyncio.run(main())


async def _complete(client: openai.AsyncOpenAI, prompt: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    """(cached_tokens, trace) of a one-token greedy completion."""
    r = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body={"trace": True, **extra}
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None and r.model_extra
    return r.usage.prompt_tokens_details.cached_tokens or 0, r.model_extra["trace"]


def test_a_tenant_reads_nothing_of_another_tenants_cache_by_default() -> None:
    async def test(clients: Clients, http: httpx.AsyncClient) -> None:
        alice, bob = clients[ALICE], clients[BOB]
        assert (await _complete(alice, SECRET))[0] == 0
        cached, trace = await _complete(bob, PROBE)
        assert cached == 0 and trace["num_cached_tokens"] == 0 and trace["divergence"] is None
        # the same probe from A: its own history, explained in full
        cached, trace = await _complete(alice, PROBE)
        assert cached > 0 and trace["divergence"]["cached_token_text"] == "4"
        assert trace["divergence"]["prompt_token_text"] == "0"

    _serve(ServerConfig(served_model_name="tiny", tenants=(ALICE, BOB)), test)


def test_a_shared_cache_never_shows_another_tenants_token() -> None:
    async def test(clients: Clients, http: httpx.AsyncClient) -> None:
        alice, bob = clients[ALICE], clients[BOB]
        await _complete(alice, SECRET)
        cached, trace = await _complete(bob, PROBE)
        assert cached > 0  # the shared prefix is a hit: that is what sharing the cache buys
        divergence = trace["divergence"]
        index = divergence["index"]
        assert divergence == {
            "index": index,
            "prompt_token": trace["prompt_token_ids"][index],
            "prompt_token_text": "0",
            "cached_token": None,
            "cached_token_text": None,
        }
        # streamed chat: the trace on the usage chunk is hidden the same way
        messages: Any = [{"role": "user", "content": "My PIN is 4711."}]
        await alice.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
        messages = [{"role": "user", "content": "My PIN is 0000."}]
        stream = await bob.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"trace": True},
        )  # fmt: skip
        traces = [c.model_extra["trace"] async for c in stream if c.model_extra and "trace" in c.model_extra]
        (divergence,) = [t["divergence"] for t in traces]
        assert divergence["cached_token"] is None and divergence["cached_token_text"] is None
        assert divergence["prompt_token_text"] == "0"
        # a cache_salt of A's own is a private namespace: the trace explains it in full
        await _complete(alice, SECRET, cache_salt="alice-only")
        cached, trace = await _complete(alice, PROBE, cache_salt="alice-only")
        assert cached > 0 and trace["divergence"]["cached_token_text"] == "4"

    config = ServerConfig(served_model_name="tiny", tenants=(ALICE, BOB), shared_prefix_cache=True)
    _serve(config, test)


# ---- 3. which routes need a key ---------------------------------------------------------------------
def test_metrics_needs_a_key_once_keys_are_set_unless_opened() -> None:
    async def test(clients: Clients, http: httpx.AsyncClient) -> None:
        assert_error(await http.get("/metrics"), 401, type="authentication_error", code="invalid_api_key")
        r = await http.get("/metrics", headers={"Authorization": f"Bearer {BOB.key}"})
        assert r.status_code == 200 and "onecall_requests_running" in r.text
        for path in ("/", "/health", "/openapi.json", "/docs"):
            assert (await http.get(path)).status_code == 200, path
        r = await http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1}, headers={
            "Authorization": f"Bearer {ALICE.key}"})  # fmt: skip
        assert r.status_code == 200, r.text  # its namespaced cache_salt passes the chat request's checks

    _serve(ServerConfig(tenants=(ALICE, BOB)), test)

    async def opened(clients: Clients, http: httpx.AsyncClient) -> None:
        assert (await http.get("/metrics")).status_code == 200

    _serve(ServerConfig(tenants=(ALICE, BOB), open_metrics=True), opened)
    _serve(ServerConfig(), opened)  # an open server is open everywhere


# ---- 4. the CLI -------------------------------------------------------------------------------------
def _serve_args(*args: str) -> Any:
    return build_parser().parse_args(["serve", "--port", str(free_port()), *args])


def test_kv_events_beyond_loopback_need_an_explicit_flag() -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    config = ServerConfig()
    for endpoint in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557", "tcp://10.1.2.3:5557",
                     "tcp://eth0:5557", "tcp://example.com:5557", "epgm://eth0;239.1.1.1:5555"):  # fmt: skip
        with pytest.raises(InvalidParameterError, match="beyond loopback.*--kv-events-allow-remote"):
            _kv_event_publisher(_serve_args("--kv-events-endpoint", endpoint), config)
    a = _serve_args("--kv-events-endpoint", "tcp://0.0.0.0:5557", "--kv-events-allow-remote")
    assert any("anyone who connects" in w for w in _warnings(a, config))  # allowed, said out loud
    publisher = _kv_event_publisher(
        _serve_args("--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"), config
    )
    assert publisher is not None
    publisher.close()


def test_startup_warnings_name_what_the_flags_leave_open(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE.name} {ALICE.key}\n{BOB.name} {BOB.key}\n")
    os.chmod(keys, 0o644)
    config = ServerConfig(tenants=tuple(load_keys_file(keys)))
    said = " ".join(_warnings(_serve_args("--api-keys-file", str(keys)), config))
    assert "chmod 600" in said
    os.chmod(keys, 0o600)
    assert _warnings(_serve_args("--api-keys-file", str(keys)), config) == []
    said = " ".join(_warnings(_serve_args("--host", "0.0.0.0"), ServerConfig()))
    assert "no key is set" in said


def _refused(*args: str) -> str:
    """Run `onecall serve ARGS`: it must exit 2 before serving; its stderr."""
    cmd = [sys.executable, "-m", "onecall.cli", "serve", "--port", str(free_port()), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`onecall serve {' '.join(args)}` served instead of refusing")
    assert done.returncode == 2 and "serving" not in done.stderr, done.stderr
    return done.stderr


@pytest.mark.server
def test_serve_refuses_an_empty_key_and_a_remote_kv_events_endpoint(tmp_path: Path) -> None:
    assert "onecall: error: api_key: is empty" in _refused("--api-key", "")
    assert "api_key: is empty" in _refused("--api-key", " ")
    keys = tmp_path / "keys"
    keys.write_text("alice sk-1\nbob\n")
    assert f"api_keys_file: {keys}, line 2: expected 'name key'" in _refused("--api-keys-file", str(keys))
    err = _refused("--kv-events-endpoint", f"tcp://0.0.0.0:{free_port()}")
    assert "beyond loopback" in err and "--kv-events-allow-remote" in err


@pytest.mark.server
def test_a_real_server_with_a_keys_file_keeps_tenants_apart(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# two tenants\n{ALICE.name} {ALICE.key}\n{BOB.name} {BOB.key}\n")
    os.chmod(keys, 0o600)
    proc = ServerProcess("--api-keys-file", str(keys), "--max-model-len", "256", num_threads=2)
    try:
        proc.start()

        def complete(tenant: Tenant, prompt: str) -> tuple[int, dict[str, Any]]:
            client = openai.OpenAI(base_url=proc.url("/v1"), api_key=tenant.key, max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            r = client.completions.create(
                model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"trace": True}
            )
            assert r.usage is not None and r.usage.prompt_tokens_details is not None and r.model_extra
            return r.usage.prompt_tokens_details.cached_tokens or 0, r.model_extra["trace"]

        complete(ALICE, SECRET)
        cached, trace = complete(BOB, PROBE)
        assert cached == 0 and trace["divergence"] is None
        cached, trace = complete(ALICE, PROBE)
        assert cached > 0 and trace["divergence"]["cached_token_text"] == "4"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proc.url("/v1"), api_key="sk-nobody", max_retries=0).models.list()
        assert httpx.get(proc.url("/metrics")).status_code == 401
        bob = {"Authorization": f"Bearer {BOB.key}"}
        assert httpx.get(proc.url("/metrics"), headers=bob).status_code == 200
        assert httpx.get(proc.url("/")).status_code == 200  # the viewer's page; its calls carry a key
        assert "chmod" not in proc.log()
    finally:
        assert proc.stop() == 0
