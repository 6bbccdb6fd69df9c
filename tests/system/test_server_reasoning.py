"""Reasoning and Hermes tool calls through the server, in-process, over a scripted model.

The embedded model's template knows neither <think> nor <tool_call>, so these tests serve a Qwen3-style
template (thinking and Hermes tools) from an engine whose tokenizer is the embedded one with four unused
control tokens turned into the plain added tokens <tool_call>, </tool_call>, <think> and </think> (single
ids, as in Qwen's vocabulary), and whose model is a script: after the prompt it emits chosen tokens,
then EOS. Where a grammar masks the scripted token, every allowed token ties and the lowest id wins.

What is checked, through the official openai client over ASGI: reasoning_content vs content, whole and
streamed (identical), for the three prompt shapes (the block opened by the output, by the prompt, or
closed by enable_thinking=False); a JSON schema that applies only after </think> (the trace shows no mask
before, a mask after) and from the first token when the block is skipped; a Hermes call in the output
parsed into tool_calls (finish_reason "tool_calls"), whole and streamed; a named function enforced by the
Hermes grammar after the reasoning; the grammar's argument objects are closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine
from onecall.engine.engine_parts import LoadedEngineParts
from onecall.formats.checkpoint import resolve_model
from onecall.formats.gguf import open_gguf
from onecall.model.kv_cache import PagedKVCache
from onecall.server.app import create_app
from onecall.server.async_engine import AsyncEngine
from onecall.text.chat_template import render_chat
from onecall.text.tokenizer import Tokenizer
from onecall.tools.specs import tool_call_grammar
from tests.helpers.server_process import check_chat_stream
from tests.helpers.tiny_engine import tiny_model

QWEN3_STYLE = (
    "{%- if tools -%}<|im_start|>system\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{%- endif -%}'
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' -%}{{ (m.content or '').split('</think>')[-1].lstrip('\n') }}"
    "{%- for c in m.tool_calls or [] -%}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think>\n\n</think>\n\n"
    "{%- elif open_thinking is defined and open_thinking -%}<think>\n{%- endif -%}"
    "{%- endif -%}"
)
MARKERS = {12: "<tool_call>", 13: "</tool_call>", 14: "<think>", 15: "</think>"}  # unused jupyter tokens
EOS = 2
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the engine's files are the embedded model's
HI = [{"role": "user", "content": "What is two plus two?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"answer": {"const": "four"}}, "required": ["answer"]}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def thinking_tokenizer() -> Tokenizer:
    metadata = dict(open_gguf(resolve_model(None).path).metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata["tokenizer.ggml.token_type"])
    for i, marker in MARKERS.items():
        tokens[i], types[i] = marker, 4  # user-defined: matched whole, kept in the text
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    metadata["tokenizer.chat_template"] = QWEN3_STYLE
    return Tokenizer.from_gguf_metadata(metadata)


class ScriptedLM(torch.nn.Module):
    """Emits `script[position]` at each scripted position, EOS anywhere else (logit 10, the rest 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_model().config
        self.script: dict[int, int] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        return (positions + 1).float().unsqueeze(1)  # (num_tokens, 1): the position being predicted

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        for row, position in enumerate(hidden[:, 0].long().tolist()):
            logits[row, self.script.get(position, EOS)] = 10.0
        return logits


@pytest.fixture(scope="module")
def engine() -> Engine:
    tok, model = thinking_tokenizer(), ScriptedLM()
    assert [tok.encode(m) for m in MARKERS.values()] == [[i] for i in MARKERS]
    mc = model.config
    kv_cache = PagedKVCache(
        mc.num_hidden_layers, 256, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu"
    )
    parts = LoadedEngineParts(
        files=resolve_model(None), model_config=mc, model=model, tokenizer=tok,  # type: ignore[arg-type]
        kv_cache=kv_cache, num_blocks=256, max_model_len=1024, device=torch.device("cpu"),
        dtype=torch.float32, load_seconds=0.0,
    )  # fmt: skip
    return Engine(EngineConfig(device="cpu", dtype="float32", block_size=4), parts=parts)


def script(
    engine: Engine,
    output: str,
    *,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Make the model answer HI (rendered as the server will, with these tools and template kwargs)
    with `output`; returns its token ids."""
    tok = engine.tokenizer
    prompt = render_chat(tok, HI, tools=tools, template_kwargs=kwargs)
    ids = tok.encode(output)
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt.token_ids) + k: t for k, t in enumerate(ids)}
    return ids


def serve(engine: Engine, test: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> None:
    async def main() -> None:
        app = create_app(AsyncEngine(engine))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="-", http_client=http)
                await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(main())


async def both(client: openai.AsyncOpenAI, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The whole response, and the stream accumulated (reasoning, content, calls, finish_reason)."""
    whole = await client.chat.completions.create(model=MODEL, temperature=0, **kw)
    chunks = [
        c async for c in await client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw)
    ]
    check_chat_stream(chunks, usage=False)
    acc: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "order": ""}
    for c in chunks:
        for ch in c.choices:
            reasoning = (ch.delta.model_extra or {}).get("reasoning_content") or ""
            acc["reasoning"] += reasoning
            acc["content"] += ch.delta.content or ""
            acc["order"] += ("r" if reasoning else "") + ("c" if ch.delta.content else "")
            for d in ch.delta.tool_calls or []:
                call = acc["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None and d.function.name, "id and name are sent once"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            acc["finish_reason"] = ch.finish_reason or acc.get("finish_reason")
    assert "cr" not in acc["order"], "reasoning after content"
    return whole, acc


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


# ---- reasoning ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "output", "reasoning"),
    [
        (None, "<think>\nLet me count.\n</think>\n\nFour.", "Let me count."),  # the output opens it
        ({"open_thinking": True}, "Let me count.\n</think>\n\nFour.", "Let me count."),  # the prompt does
        ({"enable_thinking": False}, "Four.", None),  # closed by the template: no reasoning
        (None, "Four. <think>not reasoning</think>", None),  # only a leading block is reasoning
    ],
)
def test_reasoning_goes_to_reasoning_content(
    engine: Engine, kwargs: dict[str, Any] | None, output: str, reasoning: str | None
) -> None:
    script(engine, output, kwargs=kwargs)
    content = output if reasoning is None else "Four."

    async def test(client: openai.AsyncOpenAI) -> None:
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        whole, streamed = await both(client, messages=HI, max_tokens=40, extra_body=extra)
        message = whole.choices[0].message
        assert (reasoning_of(message), message.content) == (reasoning, content)
        assert whole.choices[0].finish_reason == "stop" and message.tool_calls == []
        assert (streamed["reasoning"] or None, streamed["content"]) == (reasoning, content)
        assert streamed["finish_reason"] == "stop"

    serve(engine, test)


@pytest.mark.parametrize("opened_by", ["output", "prompt"])
def test_the_schema_applies_only_after_the_reasoning(engine: Engine, opened_by: str) -> None:
    kwargs = {"open_thinking": True} if opened_by == "prompt" else None
    start = "<think>\n" if opened_by == "output" else ""
    # after </think> the script says "Four." but the grammar only allows the schema's JSON
    ids = script(engine, start + "Let me count.\n</think>\n\nFour.", kwargs=kwargs)
    num_thinking = ids.index(15) + 1  # tokens up to and including </think>

    async def test(client: openai.AsyncOpenAI) -> None:
        extra = {"trace": True, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        whole, streamed = await both(
            client, messages=HI, max_tokens=40, response_format=JSON_FORMAT, extra_body=extra
        )
        message = whole.choices[0].message
        assert reasoning_of(message) == "Let me count." and json.loads(message.content) == {"answer": "four"}
        assert (streamed["reasoning"], streamed["content"]) == ("Let me count.", message.content)
        trace = whole.model_extra["trace"]
        grammar = trace["grammar"]
        assert grammar["activated_at"] == num_thinking and grammar["reasoning_end"] == "</think>"
        assert grammar["reasoning_start"] == ("<think>" if opened_by == "output" else None)
        masked = [s["num_allowed"] is not None for s in trace["steps"] if s["token_id"] is not None]
        first_free = 1 if opened_by == "output" else 0  # the preamble step: the grammar or <think>
        assert not any(masked[first_free:num_thinking]) and all(masked[num_thinking:]), masked
        assert whole.choices[0].finish_reason == "stop"

    serve(engine, test)


def test_a_skipped_reasoning_block_leaves_the_schema_in_force_from_the_first_token(engine: Engine) -> None:
    script(engine, '{"answer": "four"}', kwargs={"enable_thinking": False})

    async def test(client: openai.AsyncOpenAI) -> None:
        extra = {"trace": True, "chat_template_kwargs": {"enable_thinking": False}}
        whole, _ = await both(
            client, messages=HI, max_tokens=20, response_format=JSON_FORMAT, extra_body=extra
        )
        assert json.loads(whole.choices[0].message.content) == {"answer": "four"}
        assert reasoning_of(whole.choices[0].message) is None
        assert whole.model_extra["trace"]["grammar"]["activated_at"] == 0

    serve(engine, test)


# ---- hermes tool calls --------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_hermes_call_in_the_output_becomes_tool_calls(engine: Engine) -> None:
    script(engine, "<think>\nThe user wants weather.\n</think>\n\n" + CALL, tools=TOOLS)

    async def test(client: openai.AsyncOpenAI) -> None:
        whole, streamed = await both(client, messages=HI, tools=TOOLS, max_tokens=60)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert reasoning_of(choice.message) == "The user wants weather."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and len(call.id) >= 9 and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""
        (s,) = streamed["calls"].values()
        assert (s["name"], json.loads(s["arguments"])) == ("get_weather", {"city": "Paris"})
        # tool_choice "none": the same output is plain content (nothing offered, nothing parsed)
        script(engine, CALL)
        kw: Any = {"messages": HI, "tools": TOOLS, "tool_choice": "none", "max_tokens": 60, "temperature": 0}
        r = await client.chat.completions.create(model=MODEL, **kw)
        assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content == CALL
        assert r.choices[0].finish_reason == "stop"

    serve(engine, test)


def test_a_named_function_is_enforced_after_the_reasoning(engine: Engine) -> None:
    # after </think> the script writes a call with an invented argument; the closed grammar refuses it
    invented = CALL.replace('"Paris"}', '"Paris", "country": "France"}')
    script(engine, "<think>\nCall it.\n</think>\n\n" + invented, tools=TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def test(client: openai.AsyncOpenAI) -> None:
        whole, streamed = await both(client, messages=HI, tools=TOOLS, tool_choice=named, max_tokens=60)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and reasoning_of(choice.message) == "Call it."
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and arguments["city"] == "Paris"
        assert set(arguments) <= {"city", "unit"} and arguments.get("unit", "C") in ("C", "F")
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
            ("get_weather", call.function.arguments)
        ]

    serve(engine, test)


def test_the_hermes_grammar_closes_argument_objects() -> None:
    grammar = tool_call_grammar(TOOLS, required_name="get_weather")
    body = json.loads(grammar.split("%json ", 1)[1])
    assert body["properties"]["arguments"]["additionalProperties"] is False
    assert "additionalProperties" not in WEATHER  # the request's schema is left as it was
