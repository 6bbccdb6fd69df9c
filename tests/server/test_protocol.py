"""The wire schema and its conversion to engine inputs, without a server.

What is checked: protocol.py (and params.py) import neither torch, the web framework nor the
engine; requests are validated strictly (wrong types and protocol limits refused, unknown fields
ignored); the one conversion to SamplingParams (defaults, max_completion_tokens, seed + i for n
choices, logit_bias keys, logprobs) and every refusal names its field; messages reach the chat
template as dicts (extra fields kept, tool-call arguments decoded); responses serialize as the
official openai client's own models parse them (omitted fields, null finish_reason); exceptions
map to the right status, type, param and code, and a bug's body hides its details.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from onecall.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidParameterError,
    QueueFullError,
    TemplateError,
)
from onecall.sampling_params import MAX_LOGPROBS
from onecall.server.params import completion_prompts, template_messages, to_sampling_params
from onecall.server.protocol import (
    MAX_TOP_LOGPROBS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from onecall.server.protocol import (
    ChatCompletionChunk as OurChunk,
)

HI = [{"role": "user", "content": "Hi"}]


def chat_req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": HI, **kw}))


def completion_req(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "Hi", **kw}))


def test_protocol_and_params_import_neither_torch_nor_fastapi_nor_the_engine() -> None:
    code = (
        "import sys, onecall.server.protocol, onecall.server.protocol_info, onecall.server.params; "
        "print([m for m in ('torch', 'fastapi', 'starlette', 'onecall.engine') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert MAX_TOP_LOGPROBS == MAX_LOGPROBS


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": "0.5"}, "temperature"),  # strict: no strings for numbers
        ({"temperature": True}, "temperature"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"logit_bias": {"1": "high"}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ],
)
def test_chat_request_validation_refuses(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(json.dumps({"messages": HI, **body}))
    assert e.value.errors()[0]["loc"][0] == field


def test_chat_request_accepts_the_openai_shapes_and_ignores_unknown_fields() -> None:
    req = chat_req(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
                "reasoning_content": "hm",
            },  # fmt: skip
            {"role": "tool", "tool_call_id": "c", "content": "2"},
        ],
        temperature=1,  # an int where a float belongs is fine
        stop="\n",
        a_field_from_the_future={"x": 1},
        trace=True,
    )
    assert req.temperature == 1.0 and req.trace and not hasattr(req, "a_field_from_the_future")
    msgs = template_messages(req.messages)
    assert msgs[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert msgs[1] == {"role": "user", "content": "Hi", "name": "ann"}
    assert msgs[2]["content"] is None and msgs[2]["reasoning_content"] == "hm"
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # decoded for the template
    assert msgs[3] == {"role": "tool", "content": "2", "tool_call_id": "c"}


def test_to_sampling_params_defaults_and_fields() -> None:
    (p,) = to_sampling_params(chat_req(), default_max_tokens=100)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == (
        1.0,
        1.0,
        0,
        0.0,
        100,
        None,
    )
    (p,) = to_sampling_params(
        chat_req(max_tokens=50, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3, min_p=0.1,
                 repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5, stop=["a", "b"],
                 logit_bias={"12": -100, "7": 5.5}, logprobs=True, top_logprobs=4, ignore_eos=True,
                 min_tokens=2, stop_token_ids=[3]),
        default_max_tokens=100,
    )  # fmt: skip
    assert p.max_tokens == 7 and p.temperature == 0 and p.top_p == 0.5 and p.top_k == 3 and p.min_p == 0.1
    assert p.repetition_penalty == 1.2 and (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.stop == ("a", "b") and p.logit_bias == {12: -100, 7: 5.5} and p.logprobs == 4
    assert p.ignore_eos and p.min_tokens == 2 and p.stop_token_ids == (3,)
    (p,) = to_sampling_params(chat_req(logprobs=True, response_format={"type": "text"}), default_max_tokens=1)
    assert p.logprobs == 0  # the chosen token's logprob, no alternatives
    (p,) = to_sampling_params(completion_req(logprobs=3), default_max_tokens=1)
    assert p.max_tokens == 16 and p.logprobs == 3  # OpenAI's completions default


def test_n_choices_get_seed_plus_index() -> None:
    params = to_sampling_params(chat_req(n=3, seed=10), default_max_tokens=5)
    assert [p.seed for p in params] == [10, 11, 12]
    assert [p.seed for p in to_sampling_params(chat_req(n=2), default_max_tokens=5)] == [None, None]


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (lambda: chat_req(stream_options={"include_usage": True}), "stream_options"),
        (lambda: chat_req(chat_template="{{ x }}"), "chat_template"),
        (lambda: chat_req(top_logprobs=2), "top_logprobs"),
        (lambda: chat_req(logit_bias={"x": 1}), "logit_bias"),
        (lambda: chat_req(logit_bias={"5": 101}), "logit_bias"),
        (lambda: chat_req(temperature=-1), "temperature"),
        (lambda: chat_req(top_p=0), "top_p"),
        (lambda: chat_req(presence_penalty=2.5), "presence_penalty"),
        (lambda: chat_req(stop=[""]), "stop"),
        (lambda: chat_req(min_tokens=9, max_tokens=3), "min_tokens"),
        (lambda: chat_req(echo=True), "echo"),
        (lambda: completion_req(suffix="x"), "suffix"),
        (lambda: completion_req(n=3, best_of=2), "best_of"),
        (lambda: completion_req(best_of=2, stream=True), "best_of"),
        (lambda: completion_req(max_tokens=0), "max_tokens"),
    ],
)
def test_every_refusal_names_its_field(req: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        to_sampling_params(req(), default_max_tokens=10)
    assert e.value.param == param


def test_completion_prompt_forms() -> None:
    assert completion_prompts(completion_req(prompt="abc")) == ["abc"]
    assert completion_prompts(completion_req(prompt=[1, 2, 3])) == [[1, 2, 3]]
    assert completion_prompts(completion_req(prompt=["abc", "d"])) == ["abc", "d"]
    assert completion_prompts(completion_req(prompt=[[4, 5], [6]])) == [[4, 5], [6]]
    with pytest.raises(InvalidParameterError) as e:
        completion_prompts(completion_req(prompt=[]))
    assert e.value.param == "prompt"
    for mixed in (["a", [1]], [1, "a"]):
        with pytest.raises(ValidationError) as v:
            completion_req(prompt=mixed)
        assert v.value.errors()[0]["loc"][0] == "prompt" and "one kind" in str(v.value)


def test_cache_salt_reaches_every_candidate() -> None:
    params = to_sampling_params(completion_req(n=2, cache_salt="tenant-7"), default_max_tokens=10)
    assert [p.cache_salt for p in params] == ["tenant-7", "tenant-7"]
    (chat,) = to_sampling_params(chat_req(cache_salt="t"), default_max_tokens=10)
    assert chat.cache_salt == "t"
    with pytest.raises(ValidationError) as e:
        completion_req(cache_salt="")
    assert e.value.errors()[0]["loc"][0] == "cache_salt"


def test_echo_logprobs_and_best_of_become_engine_params() -> None:
    (p,) = to_sampling_params(completion_req(echo=True, logprobs=2), default_max_tokens=10)
    assert p.prompt_logprobs == 2 and p.logprobs == 2
    (score,) = to_sampling_params(completion_req(echo=True, max_tokens=0), default_max_tokens=10)
    assert score.max_tokens == 0 and score.prompt_logprobs == 0
    candidates = to_sampling_params(completion_req(n=2, best_of=4, seed=5), default_max_tokens=10)
    assert [c.seed for c in candidates] == [5, 6, 7, 8] and all(c.logprobs == 0 for c in candidates)


def _usage() -> Usage:
    return Usage(
        prompt_tokens=5,
        completion_tokens=2,
        total_tokens=7,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=3),
    )


def test_responses_parse_as_the_openai_client_models() -> None:
    head: dict[str, Any] = dict(id="chatcmpl-1", created=1, model="m")
    whole = ChatCompletionResponse(
        **head,
        choices=[ChatChoice(index=0, message=ChatResponseMessage(content="Hi"), finish_reason="stop")],
        usage=_usage(),
    )
    parsed = ChatCompletion.model_validate_json(whole.model_dump_json())
    assert parsed.choices[0].message.content == "Hi" and parsed.usage.prompt_tokens_details.cached_tokens == 3  # type: ignore[union-attr]
    assert "trace" not in json.loads(whole.model_dump_json())  # only when asked for

    first = OurChunk(
        **head, choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))]
    )
    data = json.loads(first.model_dump_json())
    assert "usage" not in data and data["choices"][0]["finish_reason"] is None  # null, not missing
    middle = json.loads(
        OurChunk(**head, choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="x"))]).model_dump_json()
    )
    assert middle["choices"][0]["delta"] == {"content": "x"}  # no role after the first chunk
    last = OurChunk(**head, choices=[], usage=_usage(), trace={"num_prompt_tokens": 5})
    for chunk in (first, last):
        ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert json.loads(last.model_dump_json())["trace"] == {"num_prompt_tokens": 5}

    completion = CompletionResponse(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChoice(index=0, text="a", finish_reason="length")],
        usage=_usage(),
    )
    assert Completion.model_validate_json(completion.model_dump_json()).choices[0].text == "a"


def test_error_body_always_has_four_keys() -> None:
    body = json.loads(ErrorResponse(error=ErrorInfo(message="m", type="t")).model_dump_json())
    assert body == {"error": {"message": "m", "type": "t", "param": None, "code": None}}


def test_exceptions_map_to_status_type_param_code(caplog: pytest.LogCaptureFixture) -> None:
    from onecall.server.http_errors import http_error

    cases: list[tuple[BaseException, int, str, str | None, str | None]] = [
        (InvalidParameterError("top_p", "bad"), 400, "invalid_request_error", "top_p", None),
        (
            ContextLengthExceededError(600, 512, 10),
            400,
            "invalid_request_error",
            "prompt",
            "context_length_exceeded",
        ),
        (TemplateError("no"), 400, "invalid_request_error", "messages", None),
        (QueueFullError(4, 4, retry_after=2), 429, "rate_limit_error", None, "queue_full"),
        (EngineDeadError("dead"), 503, "service_unavailable_error", None, "engine_dead"),
        (RuntimeError("secret internals"), 500, "server_error", None, None),
    ]
    for exc, status, type_, param, code in cases:
        err = http_error(exc, "rid-123")
        assert (err.status, err.info.type, err.info.param, err.info.code) == (status, type_, param, code)
    assert (
        "600" in http_error(cases[1][0], "r").info.message
        and "512" in http_error(cases[1][0], "r").info.message
    )
    assert http_error(cases[3][0], "r").headers == {"Retry-After": "2"}
    bug = http_error(RuntimeError("secret internals"), "rid-123")
    assert "secret internals" not in bug.info.message and "rid-123" in bug.info.message
    assert any(
        "rid-123" in r.getMessage() and r.exc_info for r in caplog.records
    )  # logged with the traceback


def test_validation_errors_become_400_with_the_field() -> None:
    from onecall.server.http_errors import validation_error

    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(b'{"messages": [], "temperature": "x"}')
    err = validation_error(e.value)
    assert (
        err.status == 400
        and err.info.param in ("messages", "temperature")
        and "more problem" in err.info.message
    )
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(b"{not json")
    err = validation_error(e.value)
    assert err.status == 400 and err.info.param is None and "JSON" in err.info.message
