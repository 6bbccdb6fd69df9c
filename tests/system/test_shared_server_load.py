"""A shared server under a mix of good and hostile requests from two tenants (issue 24's load test).

One real `onecall serve` subprocess with the embedded model and a keys file of two tenants. Each
good request is first sent alone, then again, all at once, among hostile requests from both
tenants (parameters refused at intake, a grammar that cannot compile, malformed bodies, ids past
the vocabulary, a grammar with min_tokens that ends it early, a wrong key) and a secret that tenant
A caches. Bounded: about 70 requests of at most 8 tokens, one concurrent burst, a 120 s budget.

What must hold: every good request succeeds with exactly the text it got alone (greedy, and the
default path is batch invariant: tests/engine/test_batch_invariance.py); every hostile one gets its 4xx
(or its defined finish), never a 5xx; the server is healthy afterwards with no restart; and nothing
of A's secret reaches B: no cached tokens, no divergence, no secret text in B's responses.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server_process import ServerProcess, metric

A_KEY, B_KEY = "sk-tenant-a-7f3e", "sk-tenant-b-91c2"
SECRET = "Note to self: the vault PIN is 4711 and the door code is 9382."
PROBE = "Note to self: the vault PIN is"
GOOD = [
    "The capital of France is",
    "One, two, three, four,",
    "def fibonacci(n):",
    "Once upon a time there was",
    "The three primary colours are",
    "Water boils at",
    "A haiku about the sea:",
    "The largest planet in the solar system is",
]


def _good(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


HOSTILE: list[tuple[str, Any, int]] = [  # (name, body or raw bytes, expected status)
    ("too_many_stops", {**_good("x"), "stop": [f"s{i}" for i in range(65)]}, 400),
    ("long_stop", {**_good("x"), "stop": ["y" * 1025]}, 400),
    ("too_many_stop_ids", {**_good("x"), "stop_token_ids": list(range(1025))}, 400),
    # on the old engine two of these in a row failed their batches, then stopped the engine
    ("min_tokens_bans_everything", {**_good("x"), "min_tokens": 4, "stop_token_ids": list(range(49152))}, 400),
    ("stop_id_past_vocab", {**_good("x"), "stop_token_ids": [10**7]}, 400),
    ("logit_bias_flood", {**_good("x"), "logit_bias": {str(t): -100 for t in range(1025)}}, 400),
    ("logit_bias_past_vocab", {**_good("x"), "logit_bias": {"99999999": 5}}, 400),
    ("prompt_id_past_vocab", {**_good("x"), "prompt": [1, 2, 10**8]}, 400),
    ("bad_regex", {**_good("x"), "structured_outputs": {"regex": "(unclosed"}}, 400),
    ("min_tokens_over_max", {**_good("x"), "min_tokens": 50}, 400),
    ("malformed_json", b'{"prompt": "x", "max_tokens": ', 400),
    ("huge_n", {**_good("x"), "n": 10_000}, 400),
    # well-formed and allowed: a grammar complete after one character ends the request ("stop"),
    # whatever min_tokens asks (the grammar wins); it must not disturb anyone
    ("short_grammar_with_min_tokens", {**_good("x"), "min_tokens": 5, "structured_outputs": {"choice": ["ok"]}}, 200),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    keys: Path = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"alice {A_KEY}\nbob {B_KEY}\n")
    os.chmod(keys, 0o600)
    proc = ServerProcess("--api-keys-file", str(keys), "--max-num-seqs", "32", "--max-waiting", "128", num_threads=2)  # fmt: skip
    try:
        yield proc.start()
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


async def _post(client: httpx.AsyncClient, key: str, body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if isinstance(body, bytes):
        return await client.post("/v1/completions", content=body, headers={**headers, "content-type": "application/json"})  # fmt: skip
    return await client.post("/v1/completions", json={**body, "trace": True}, headers=headers)


@pytest.mark.server
def test_good_requests_of_two_tenants_survive_hostile_ones_and_stay_apart(server: ServerProcess) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url(""), timeout=120) as client:
            # 1. each good request alone, for its reference text
            alone = {}
            for prompt in GOOD:
                r = await _post(client, A_KEY, _good(prompt))
                assert r.status_code == 200, r.text
                alone[prompt] = r.json()["choices"][0]["text"]
            assert (await _post(client, A_KEY, {**_good(SECRET), "max_tokens": 1})).status_code == 200

            # 2. one burst: good requests of both tenants, hostile ones of both, B probing A's secret
            jobs: list[tuple[str, str, Any]] = []
            for i, prompt in enumerate(GOOD * 3):
                jobs.append(("good", A_KEY if i % 2 else B_KEY, _good(prompt)))
            for i, (name, body, _) in enumerate(HOSTILE * 2):
                jobs.append((name, A_KEY if i % 2 else B_KEY, body))
            jobs += [("probe", B_KEY, {**_good(PROBE), "max_tokens": 4})] * 4
            jobs += [("wrong_key", "sk-nobody", _good("x"))] * 2
            responses = await asyncio.gather(*(_post(client, key, body) for _, key, body in jobs))

        # 3. every good request: its text alone; every hostile one: its status, never a 5xx
        expected = {name: status for name, _, status in HOSTILE} | {"probe": 200, "wrong_key": 401}
        for (name, key, body), r in zip(jobs, responses, strict=True):
            assert r.status_code < 500, (name, r.text)
            if name == "good":
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == alone[body["prompt"]], name
            else:
                assert r.status_code == expected[name], (name, r.text)
            if name == "short_grammar_with_min_tokens":
                choice = r.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == ("ok", "stop")
            if key == B_KEY and r.status_code == 200:  # 4. nothing of A's secret in B's answers
                data = r.json()
                traces = data["trace"] if isinstance(data["trace"], list) else [data["trace"]]
                texts = [c["text"] for c in data["choices"]] + [str(t.get("divergence")) for t in traces]
                assert not any("4711" in t or "9382" in t for t in texts), (name, texts)
            if name == "probe":  # B's cache holds only B's own prompts: at most a shared first token
                data = r.json()
                assert data["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1, r.text
                d = data["trace"]["divergence"]
                assert d is None or "4" not in (d.get("cached_token_text") or ""), r.text

    asyncio.run(asyncio.wait_for(main(), timeout=240))
    health = httpx.get(server.url("/health"))
    assert health.status_code == 200
    scrape = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {A_KEY}"}).text
    assert metric(scrape, "onecall_engine_restarts_total") == 0
