"""POST /v1/responses through the official openai client's `responses` methods, in process over the
tiny engine: the chat pipeline underneath (a forced tool call comes back as a function_call item
whose arguments parse; a json_schema text.format gives output that validates; the conversation with
the call's output continues), usage and the trace extension, the streamed events adding up to the
unstreamed response, and every refusal a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.tiny_engine import tiny_engine

# an enum keeps the random tiny model's forced arguments short (a free string may run past max tokens)
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}}]  # fmt: skip


def _with_client(test: Any) -> None:
    async def main() -> None:
        engine = AsyncEngine(tiny_engine())
        app = create_app(engine, ServerConfig(served_model_name="tiny"))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="x", http_client=http)
                await asyncio.wait_for(test(client), timeout=120)

    asyncio.run(main())


def test_text_tool_calls_and_structured_output() -> None:
    async def test(client: openai.AsyncOpenAI) -> None:
        # 1. plain text, with instructions and the trace extension
        r = await client.responses.create(
            model="tiny", input="Say something.", instructions="Be brief.", max_output_tokens=6,
            temperature=0, extra_body={"trace": True},
        )  # fmt: skip
        assert r.object == "response" and r.model == "tiny" and r.status in ("completed", "incomplete")
        assert r.output and r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
        assert r.usage is not None and r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert (
            r.model_extra is not None and r.model_extra["trace"]["num_prompt_tokens"] == r.usage.input_tokens
        )
        # 2. a forced call: a function_call item whose arguments parse
        r = await client.responses.create(
            model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required", temperature=0,  # type: ignore[arg-type]
            max_output_tokens=60,
        )  # fmt: skip
        calls = [item for item in r.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather" and r.status == "completed"
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
        # 3. the conversation goes on with the call and its output replayed as input items
        follow = await client.responses.create(
            model="tiny", temperature=0, max_output_tokens=5, tools=TOOLS,  # type: ignore[arg-type]
            input=[{"role": "user", "content": "Weather in Paris?"},
                   {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                    "arguments": calls[0].arguments},
                   {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        )  # fmt: skip
        assert follow.output and follow.usage is not None and follow.usage.input_tokens > r.usage.input_tokens  # type: ignore[union-attr]
        # 4. text.format json_schema: output that validates
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}  # fmt: skip
        r = await client.responses.create(
            model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "JSON please"}]}],
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
            temperature=0, max_output_tokens=30,
        )  # fmt: skip
        assert isinstance(json.loads(r.output_text)["ok"], bool)

    _with_client(test)


def test_streamed_events_add_up_to_the_response() -> None:
    """The openai client reads the stream: created first, the text deltas join to the final text,
    a forced call arrives as a function_call item, completed last with usage; the same greedy request
    unstreamed gives the same output."""

    async def test(client: openai.AsyncOpenAI) -> None:
        for extra in ({}, {"tools": TOOLS, "tool_choice": "required"}):
            kwargs: dict[str, Any] = dict(
                model="tiny", input="Weather in Paris?", temperature=0, max_output_tokens=30, **extra
            )
            stream = await client.responses.create(stream=True, **kwargs)
            events = [e async for e in stream]
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] in (
                "response.completed",
                "response.incomplete",
            )
            assert [e.sequence_number for e in events] == list(range(len(events)))
            final = events[-1].response  # type: ignore[union-attr]
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
            assert deltas == final.output_text
            whole = await client.responses.create(**kwargs)
            assert [i.type for i in final.output] == [i.type for i in whole.output]
            assert final.output_text == whole.output_text and final.usage is not None
            if extra:
                (call,) = [i for i in final.output if i.type == "function_call"]
                (same,) = [i for i in whole.output if i.type == "function_call"]
                assert call.arguments == same.arguments and "response.function_call_arguments.done" in kinds
                # a required call runs under a grammar: its arguments stream token by token, and the
                # fragments join to the final arguments
                fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]  # type: ignore[union-attr]
                assert len(fragments) > 1 and "".join(fragments) == call.arguments
                (added,) = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]  # type: ignore[union-attr]
                assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
                assert added.output_index == final.output.index(call)  # type: ignore[union-attr]

    _with_client(test)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": []}, "input"),
    ],
)
def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    async def test(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(**{"model": "tiny", "input": "hi", **body})
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]

    _with_client(test)
