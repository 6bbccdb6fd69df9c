"""The OpenAI-compatible server, driven over HTTP like any client would.

One real `onecall serve` subprocess with the embedded model, --api-key set (every request below
carries it), a served name and a 512-token window, driven with the official openai client and raw
httpx (malformed bodies, disconnects); the last test stops it with SIGTERM while a stream is in
flight, and it must exit 0. A few tests run the app in-process over the tiny random-weight engine,
to reach states a healthy subprocess does not show on cue (loading, a full queue, a dead engine,
a bug). The subprocess tests are marked `server` (`make test-fast` leaves them out); those are not.

What is checked: every endpoint and field; stream invariants (one id, role first, exactly one
finish_reason per choice, usage last); streamed text == non-streamed text at temperature 0;
n choices with seed + i; seed determinism; cached_tokens on a shared long prefix; logprobs in
both formats; the trace; every error case with its status and body, each followed by a request
that works; the API key on every inference route; disconnects and client timeouts free
everything; 32 concurrent streams batched together; SIGTERM exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from onecall.errors import ModelNotFoundError
from onecall.sampling_params import SamplingParams
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.server_process import ServerProcess, assert_error, check_chat_stream, metric, sse_payloads
from tests.helpers.tiny_engine import tiny_engine

KEY = "sk-onecall-test"
NAME = "onecall-test"
WINDOW = 512
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "What is the capital of France?"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


# ---- fixtures and helpers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        *("--api-key", KEY, "--served-model-name", NAME, "--max-model-len", str(WINDOW)),
        *("--max-num-seqs", "40", "--max-waiting", "64", "--shutdown-timeout", "1"),
        num_threads=2,
    )
    try:
        yield proc.start()
    finally:
        code = proc.stop()  # the last test has stopped it already, with a stream in flight
    assert code == 0, f"exit code {code} after SIGTERM\n{proc.log()[-3000:]}"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)


def post(
    server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = AUTH
) -> httpx.Response:
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url(path), headers=headers, timeout=60, **kw)


def assert_still_serves(server: ServerProcess, headers: dict[str, str] | None = AUTH) -> None:
    r = post(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 1}, headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = HI, **kw: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=messages, **kw)  # type: ignore[arg-type]


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.create(model=NAME, **kw)


def metrics_text(server: ServerProcess) -> str:
    r = httpx.get(server.url("/metrics"), headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def wait_idle(server: ServerProcess, within: float = 5.0) -> str:
    """Until nothing runs or waits and the KV pool is free again; then no token is generated."""
    deadline = time.monotonic() + within
    while True:
        text = metrics_text(server)
        idle = metric(text, "onecall_requests_running") == 0 and metric(text, "onecall_requests_waiting") == 0
        if idle and metric(text, "onecall_kv_cache_usage") < 0.01:
            break
        assert time.monotonic() < deadline, f"not idle after {within} s:\n{text}"
        time.sleep(0.1)
    time.sleep(0.3)
    later = metrics_text(server)
    assert metric(later, "onecall_generation_tokens_total") == metric(text, "onecall_generation_tokens_total")
    return later


# ---- endpoints and fields --------------------------------------------------------------------------
@pytest.mark.server
def test_health_loading_then_ready_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert server.health_seen[-1] == (200, {"status": "ok"})
    for status, body in server.health_seen[:-1]:  # the socket is up before the model: "loading"
        assert status == 503 and "loading" in body["error"]["message"], body
    assert f"onecall: serving {NAME} on {server.base_url}" in server.log()
    assert "onecall: cpu float32, native int4 (" in server.log()  # what the kernels switch gave
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    card = models.data[0]
    assert card.owned_by == "onecall" and card.model_extra["max_model_len"] == WINDOW  # type: ignore[index]
    assert "SmolLM2" in card.model_extra["root"]  # type: ignore[index]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.server
def test_chat_completion_and_usage(server: ServerProcess, client: openai.OpenAI) -> None:
    r = chat(client, temperature=0, max_tokens=10)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    assert r.choices[0].message.role == "assistant" and "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens >= 0
    # the same conversation as /tokenize renders it; text parts and a tool exchange are accepted
    count = post(server, "/tokenize", {"messages": HI}).json()["count"]
    assert u.prompt_tokens == count
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert chat(client, parts, temperature=0, max_tokens=2).choices[0].finish_reason
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "capital", "arguments": '{"country": "France"}'},
    }
    tools: list[dict[str, Any]] = [
        {"role": "system", "content": "You can call tools."},
        *HI,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Paris"},
    ]
    assert chat(client, tools, temperature=0, max_tokens=2).usage.prompt_tokens > u.prompt_tokens


@pytest.mark.server
def test_streamed_text_equals_non_streamed_at_temperature_0(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(temperature=0, max_tokens=12)
    whole = chat(client, **kw)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert check_chat_stream(chunks) == [whole.choices[0].message.content]
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    plain = list(chat(client, stream=True, **kw))  # no usage chunk unless asked for
    assert check_chat_stream(plain, usage=False) == [whole.choices[0].message.content]


@pytest.mark.server
def test_n_choices_use_seed_plus_index_and_seeds_repeat(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(temperature=1.0, max_tokens=6, extra_body={"ignore_eos": True})
    r = chat(client, n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    texts = [c.message.content for c in r.choices]
    single = chat(client, seed=12, **kw).choices[0].message.content
    assert single == texts[1]  # choice i is sampled with seed + i
    assert chat(client, seed=12, **kw).choices[0].message.content == single
    chunks = list(chat(client, n=2, seed=11, stream=True, **kw))
    assert check_chat_stream(chunks, n=2, usage=False) == texts[:2]


@pytest.mark.server
def test_sampling_fields_and_extensions(server: ServerProcess, client: openai.OpenAI) -> None:
    extensions = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                  "chat_template_kwargs": {"enable_thinking": False}, "min_tokens": 2, "a_future_field": [1]}  # fmt: skip
    r = chat(client, temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, user="u-1",
             max_tokens=5, seed=3, extra_body=extensions)  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = chat(client, temperature=0, max_completion_tokens=3, max_tokens=50, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3  # max_completion_tokens wins
    # stop: the greedy text, cut right before the first occurrence of the stop string
    base = chat(client, temperature=0, max_tokens=12).choices[0].message.content or ""
    word = base.split()[2]
    cut = chat(client, temperature=0, max_tokens=12, stop=[word, "zzzz"]).choices[0]
    assert cut.message.content == base[: base.index(word)] and cut.finish_reason == "stop"
    # logit_bias: +100 on one token makes greedy decoding repeat it
    (hello,) = post(server, "/tokenize", {"prompt": " hello", "add_special_tokens": False}).json()["tokens"]
    r = chat(
        client, temperature=0, max_tokens=3, logit_bias={str(hello): 100}, extra_body={"ignore_eos": True}
    )
    assert (
        r.choices[0].message.content == post(server, "/detokenize", {"tokens": [hello] * 3}).json()["prompt"]
    )


@pytest.mark.server
def test_chat_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    r = chat(client, **kw)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens == 5
    for item in items:
        assert len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
        assert (
            item.top_logprobs[0].token == item.token
            and abs(item.top_logprobs[0].logprob - item.logprob) < 1e-5
        )
        assert item.logprob <= 0
    assert bytes(b for item in items for b in item.bytes).decode() == r.choices[0].message.content
    streamed = [
        it
        for c in chat(client, stream=True, **kw)
        for ch in c.choices
        if ch.logprobs
        for it in ch.logprobs.content
    ]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == [
        (i.token, round(i.logprob, 4)) for i in items
    ]
    r0 = chat(client, temperature=0, max_tokens=2, logprobs=True, top_logprobs=0)
    assert all(item.top_logprobs == [] for item in r0.choices[0].logprobs.content)
    assert chat(client, temperature=0, max_tokens=2).choices[0].logprobs is None


@pytest.mark.server
def test_trace_in_response_and_last_chunk(client: openai.OpenAI) -> None:
    r = chat(client, temperature=0, max_tokens=3, extra_body={"trace": True})
    t = r.model_extra["trace"]  # type: ignore[index]
    assert t["num_prompt_tokens"] == r.usage.prompt_tokens
    assert t["num_cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert t["num_prefilled_tokens"] >= 1 and t["time_to_first_token"] > 0
    assert "<|im_start|>" in t["prompt_text"] and any(t["prompt_is_control"])
    assert "trace" not in (chat(client, temperature=0, max_tokens=1).model_extra or {})
    chunks = list(chat(client, temperature=0, max_tokens=3, stream=True, extra_body={"trace": True}))
    assert [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("trace")] == [len(chunks) - 1]
    assert chunks[-1].choices[0].finish_reason
    chunks = list(chat(client, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True},
                       extra_body={"trace": True}))  # fmt: skip
    traces = chunks[-1].model_extra["trace"]  # type: ignore[index]
    assert chunks[-1].usage is not None and isinstance(traces, list) and len(traces) == 2


@pytest.mark.server
def test_cached_tokens_on_a_shared_long_prefix(client: openai.OpenAI) -> None:
    system = (
        f"Session {uuid.uuid4().hex}. "
        + "You are a careful assistant who answers briefly and politely. " * 20
    )
    first = chat(
        client, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], max_tokens=1
    )
    second = chat(
        client, [{"role": "system", "content": system}, {"role": "user", "content": "Bye"}], max_tokens=1
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 200 and cached > 200 > first.usage.prompt_tokens_details.cached_tokens


@pytest.mark.server
def test_completions(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = complete(client, prompt=prompt, max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.choices[0].text
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    assert complete(client, prompt=ids, max_tokens=5, temperature=0).choices[0].text == r.choices[0].text
    echo = complete(client, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + r.choices[0].text
    chunks = list(complete(client, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                           stream_options={"include_usage": True}))  # fmt: skip
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(ch.text for c in chunks for ch in c.choices) == r.choices[0].text
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    lp = complete(
        client, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = lp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= chosen
    default = complete(client, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


@pytest.mark.server
def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    r = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == WINDOW
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat_ids = post(server, "/tokenize", {"messages": HI}).json()["tokens"]
    assert "<|im_start|>" in post(server, "/detokenize", {"tokens": chat_ids}).json()["prompt"]


@pytest.mark.server
def test_metrics_endpoint(server: ServerProcess) -> None:
    assert_still_serves(server)
    text = metrics_text(server)  # with the key: a keyed server keeps /metrics behind it
    for name in ("onecall_requests_running", "onecall_requests_waiting", "onecall_kv_cache_usage",
                 "onecall_prompt_tokens_total", "onecall_generation_tokens_total",
                 "onecall_prefix_cache_hit_tokens_total", "onecall_prefix_cache_query_tokens_total"):  # fmt: skip
        assert metric(text, name) >= 0
    assert metric(text, "onecall_generation_tokens_total") >= 1
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert f"onecall_{name}_seconds_bucket" in text


# ---- errors -----------------------------------------------------------------------------------------
def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": HI, "max_tokens": 2, **kw}


ERROR_CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # id, path, body, status, param, code
    ("malformed_json", CHAT, b'{"messages": [', 400, None, None),
    ("body_not_an_object", CHAT, b"[1, 2]", 400, None, None),
    ("missing_messages", CHAT, {"max_tokens": 2}, 400, "messages", None),
    ("empty_messages", CHAT, _chat(messages=[]), 400, "messages", None),
    ("unknown_role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", None),
    ("image_part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages", None),
    ("temperature_string", CHAT, _chat(temperature="hot"), 400, "temperature", None),
    ("temperature_negative", CHAT, _chat(temperature=-0.5), 400, "temperature", None),
    ("top_p_zero", CHAT, _chat(top_p=0), 400, "top_p", None),
    ("max_tokens_zero", CHAT, _chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens_float", CHAT, _chat(max_tokens=1.5), 400, "max_tokens", None),
    ("stream_not_bool", CHAT, _chat(stream="yes"), 400, "stream", None),
    ("n_over_limit", CHAT, _chat(n=17), 400, "n", None),
    ("top_logprobs_over_limit", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("top_logprobs_without_logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", None),
    ("presence_penalty_range", CHAT, _chat(presence_penalty=2.5), 400, "presence_penalty", None),
    ("logit_bias_key", CHAT, _chat(logit_bias={"abc": 1}), 400, "logit_bias", None),
    ("logit_bias_outside_vocab", CHAT, _chat(logit_bias={"99999999": 1}), 400, "logit_bias", None),
    ("logit_bias_value", CHAT, _chat(logit_bias={"5": 500}), 400, "logit_bias", None),
    ("empty_stop", CHAT, _chat(stop=[""]), 400, "stop", None),
    ("stream_options_without_stream", CHAT, _chat(stream_options={"include_usage": True}), 400, "stream_options", None),
    ("chat_template_in_request", CHAT, _chat(chat_template="{{ messages }}"), 400, "chat_template", None),
    ("prompt_over_window", CHAT, _chat(messages=[{"role": "user", "content": "hello " * 600}]), 400, "messages", "context_length_exceeded"),
    ("prompt_plus_max_tokens_over_window", CHAT, _chat(max_tokens=600), 400, "messages", "context_length_exceeded"),
    ("mixed_prompt_batch", COMPLETIONS, {"prompt": ["a", [1, 2]]}, 400, "prompt", None),
    ("prompt_not_text_or_tokens", COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    ("empty_token_prompt", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("token_outside_vocab", COMPLETIONS, {"prompt": [99999999]}, 400, "prompt", None),
    ("best_of_below_n", COMPLETIONS, {"prompt": "a", "n": 2, "best_of": 1}, 400, "best_of", None),
    ("suffix", COMPLETIONS, {"prompt": "a", "suffix": "b"}, 400, "suffix", None),
    ("completion_over_window", COMPLETIONS, {"prompt": "a", "max_tokens": 900}, 400, "prompt", "context_length_exceeded"),
    ("tokenize_both", "/tokenize", {"prompt": "a", "messages": HI}, 400, "prompt", None),
    ("tokenize_neither", "/tokenize", {}, 400, "prompt", None),
    ("detokenize_bad_id", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("unknown_model", CHAT, _chat(model="gpt-4"), 404, "model", "model_not_found"),
]  # fmt: skip


@pytest.mark.server
@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_error_cases(server: ServerProcess, path: str, body: Any, status: int, param: str | None, code: str | None) -> None:  # fmt: skip
    err = assert_error(post(server, path, body), status, param=param, code=code)
    if code == "context_length_exceeded":
        assert str(WINDOW) in err["message"]  # the numbers are in the message
    assert_still_serves(server)


@pytest.mark.server
def test_openai_client_raises_the_matching_errors(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, temperature=-1)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    assert_still_serves(server)


@pytest.mark.server
def test_unknown_route_and_body_limits(server: ServerProcess) -> None:
    assert_error(post(server, "/v1/nothing", {}), 404, type="not_found_error")
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (5 << 20) + b'"}]}'
    assert_error(post(server, CHAT, big), 413)  # Content-Length says it all
    chunked = httpx.post(
        server.url(CHAT), headers=AUTH, content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
    )
    assert_error(chunked, 413)  # no Content-Length: counted as it is read
    assert_still_serves(server)


INFERENCE_ROUTES = [
    ("POST", CHAT, {"messages": HI, "max_tokens": 1}),
    ("POST", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{NAME}", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/metrics", None),  # every tenant's traffic together (--open-metrics opens it)
]


@pytest.mark.server
def test_api_key_on_every_inference_route(server: ServerProcess) -> None:
    for method, path, body in INFERENCE_ROUTES:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": KEY},
        ):
            r = httpx.request(method, server.url(path), json=body, headers=headers, timeout=30)
            assert_error(r, 401, type="authentication_error", code="invalid_api_key")
        assert httpx.request(method, server.url(path), json=body, headers=AUTH, timeout=30).status_code == 200
    for path in ("/", "/health", "/openapi.json", "/docs"):
        assert httpx.get(server.url(path)).status_code == 200


# ---- faults and load ----------------------------------------------------------------------------------
LONG = {"model": NAME, "messages": HI, "max_tokens": 300, "ignore_eos": True}


@pytest.mark.server
def test_disconnect_mid_stream_aborts_the_request(server: ServerProcess) -> None:
    with httpx.stream("POST", server.url(CHAT), json={**LONG, "stream": True}, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        events = [next(lines) for _ in range(8)][::2]
        assert len(events) == 4 and all(e.startswith("data: {") for e in events)
        assert metric(metrics_text(server), "onecall_requests_running") == 1
    wait_idle(server)  # closed after 3 tokens of 300: aborted, blocks freed, no more tokens
    assert_still_serves(server)


@pytest.mark.server
def test_non_streaming_client_timeout_aborts_the_request(server: ServerProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url(CHAT), json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=1.5))
    wait_idle(server)
    assert_still_serves(server)


@pytest.mark.server
def test_abandoned_requests_leave_the_server_responsive(server: ServerProcess) -> None:
    async def abandon(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json={**LONG, "stream": True}) as r:
            async for line in r.aiter_lines():
                assert line.startswith("data: ")
                break  # the role chunk, then gone

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=30) as client:
            await asyncio.gather(*(abandon(client) for _ in range(40)))

    asyncio.run(main())
    wait_idle(server)
    t0 = time.monotonic()
    assert_still_serves(server)
    assert time.monotonic() - t0 < 5


@pytest.mark.server
def test_32_concurrent_streams_are_batched(server: ServerProcess) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> list[Any]:
        stream = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": f"Say the number {i}."}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"trace": True},
        )
        return [c async for c in stream]

    async def main() -> list[list[Any]]:
        async with openai.AsyncOpenAI(
            base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    batch_sizes = []
    for chunks in results:
        (text,) = check_chat_stream(chunks)
        assert 1 <= chunks[-1].usage.completion_tokens <= 4 and text.strip()
        batch_sizes += [s["batch_size"] for s in chunks[-1].model_extra["trace"]["steps"]]
    assert max(batch_sizes) >= 16  # continuous batching ran them together
    wait_idle(server)


# ---- in-process: states a healthy subprocess never shows -----------------------------------------------
def _in_process(test: Any, engine: Any, config: ServerConfig | None = None) -> None:
    async def main() -> None:
        app = create_app(engine, config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(main())


def test_health_is_503_while_loading_then_200() -> None:
    release = threading.Event()

    def load() -> AsyncEngine:
        release.wait(30)
        return AsyncEngine(tiny_engine())

    async def test(client: httpx.AsyncClient) -> None:
        assert_error(await client.get("/health"), 503, type="service_unavailable_error")
        during = {
            "model": "SmolLM2-135M-Instruct.Q4_1",
            "messages": HI,
        }  # its name is not known yet: 503, not 404
        assert_error(await client.post(CHAT, json=during), 503, type="service_unavailable_error")
        release.set()
        for _ in range(100):
            if (await client.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        r = await client.post(CHAT, json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    _in_process(test, load)


def test_a_model_that_fails_to_load_is_a_503_saying_why() -> None:
    def load() -> AsyncEngine:
        raise ModelNotFoundError("model path 'nowhere.gguf' does not exist")

    async def test(client: httpx.AsyncClient) -> None:
        for _ in range(100):
            err = assert_error(await client.get("/health"), 503, type="service_unavailable_error")
            if "failed to load" in err["message"]:
                break
            await asyncio.sleep(0.02)
        assert "nowhere.gguf" in err["message"]
        assert_error(
            await client.post(COMPLETIONS, json={"prompt": "Hi"}), 503, type="service_unavailable_error"
        )

    _in_process(test, load)


def test_engine_death_mid_stream_is_an_error_event_then_503() -> None:
    engine = tiny_engine()
    real_step, calls = engine.step, [0]

    def failing_step() -> Any:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("a bug in the step")
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]

    async def test(client: httpx.AsyncClient) -> None:
        body = {"messages": HI, "max_tokens": 50, "ignore_eos": True, "stream": True}
        r = await client.post(CHAT, json=body)
        assert r.status_code == 200
        events = sse_payloads(r.text.split("\n"))
        assert events[-1] == "[DONE]" and len(events) >= 4
        last = events[-2]
        assert isinstance(last, dict)
        err = last["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "service_unavailable_error"
        assert all("choices" in e for e in events[:-2])  # type: ignore[operator]
        assert_error(await client.get("/health"), 503, type="service_unavailable_error", code="engine_dead")
        assert_error(await client.post(CHAT, json={"messages": HI}), 503, type="service_unavailable_error")

    _in_process(test, AsyncEngine(engine, max_restarts=0))  # the in-place restart: test_supervisor.py


def test_a_bug_is_a_logged_500_with_a_request_id_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = tiny_engine()

    def broken_encode(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(engine.tokenizer, "encode", broken_encode)

    async def test(client: httpx.AsyncClient) -> None:
        err = assert_error(await client.post("/tokenize", json={"prompt": "Hi"}), 500, type="server_error")
        assert "secret internals" not in err["message"] and "request id" in err["message"]
        request_id = err["message"].split("request id ")[1].split(")")[0]
        assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)
        r = await client.post("/detokenize", json={"tokens": [1, 2]})  # the server goes on
        assert r.status_code == 200

    _in_process(test, AsyncEngine(engine))


def test_queue_full_is_a_429_with_retry_after() -> None:
    engine = AsyncEngine(tiny_engine(max_num_seqs=1), max_waiting=1)
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)

    async def test(client: httpx.AsyncClient) -> None:
        running = await engine.add_request("running", "Hello", long)
        await running.__anext__()  # it has a token: it is running
        waiting = await engine.add_request("waiting", "Hello", long)  # max_num_seqs 1: it waits
        r = await client.post(CHAT, json={"messages": HI, "max_tokens": 2})
        assert_error(r, 429, type="rate_limit_error", code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
        await running.abort()
        await waiting.abort()
        r = await client.post(CHAT, json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    _in_process(test, engine)


def test_a_batch_of_prompts_counts_prompts_times_choices_against_the_queue() -> None:
    engine = AsyncEngine(tiny_engine(max_num_seqs=1), max_waiting=4)
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)

    async def test(client: httpx.AsyncClient) -> None:
        running = await engine.add_request("running", "Hello", long)
        await running.__anext__()  # it has a token: it is running, and the queue is empty
        waiting = await engine.add_request("waiting", "Hello", long)  # max_num_seqs 1: one waits
        body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}  # 4 requests: 1 + 4 > 4
        assert_error(
            await client.post(COMPLETIONS, json=body), 429, type="rate_limit_error", code="queue_full"
        )
        err = assert_error(await client.post(COMPLETIONS, json={**body, "n": 3}), 400, param="prompt")
        assert "6 requests" in err["message"]  # 2 prompts x 3: could never wait at once
        await running.abort()
        await waiting.abort()
        r = await client.post(COMPLETIONS, json=body)
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]

    _in_process(test, engine)


# ---- last: SIGTERM with a request in flight --------------------------------------------------------------
@pytest.mark.server
def test_sigterm_with_a_stream_in_flight_exits_0(server: ServerProcess) -> None:
    t0 = time.monotonic()
    with httpx.stream("POST", server.url(CHAT), json={**LONG, "stream": True}, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.send_sigterm()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # stopped accepting
            httpx.get(server.url("/health"), timeout=5)
        with contextlib.suppress(httpx.HTTPError):  # cut off once --shutdown-timeout (1 s) ran out
            for _ in lines:
                pass
    assert server.stop() == 0
    assert time.monotonic() - t0 < 15
