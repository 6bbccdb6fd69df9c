"""The client libraries people build on, installed from PyPI, against the server (in process, over
ASGI): their own requests, not imitations of them. Each test is skipped where its library is not
installed (they are in the test extra: pip install -e '.[test]').

    OpenAI Agents SDK   an agent without tools on the Responses API sends `tools: []` (it used to be
                        a 400); on chat completions too
    instructor          Responses mode sends the schema both as a forced tool and as text.format
                        (it used to be a 400): the forced call is the output
    LangChain           ChatOpenAI's invoke and structured output (a forced tool call)
    remote tokenizers   GET /tokenizer_info with /tokenize and /detokenize, as lm-eval's remote
                        tokenizer reads them
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from onecall.config import EngineConfig
from onecall.engine.engine import Engine
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.tiny_engine import tiny_engine

Bodies = list[dict[str, Any]]


def _serve(
    test: Callable[[openai.AsyncOpenAI, httpx.AsyncClient, Bodies], Awaitable[None]], embedded: bool = False
) -> None:
    """Run `test` with an OpenAI client (and the raw httpx client) on the tiny random model's server
    (`embedded`: the embedded SmolLM2, which ends its answers); `bodies` collects every JSON request
    body the library sent."""

    async def main() -> None:
        engine = AsyncEngine(Engine(EngineConfig(max_model_len=2048)) if embedded else tiny_engine())
        app = create_app(engine, ServerConfig(served_model_name="tiny"))
        bodies: Bodies = []

        async def record(request: httpx.Request) -> None:
            if request.method == "POST" and request.content:
                bodies.append(json.loads(request.content))

        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://onecall", event_hooks={"request": [record]}
            ) as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="x", http_client=http)
                await asyncio.wait_for(test(client, http, bodies), timeout=120)

    asyncio.run(main())


@pytest.mark.slow
def test_an_agents_sdk_agent_without_tools_runs_on_both_apis() -> None:
    """The SDK raises on an incomplete response, so this runs the embedded model, which stops."""
    agents = pytest.importorskip("agents")

    async def test(client: openai.AsyncOpenAI, http: httpx.AsyncClient, bodies: Bodies) -> None:
        agents.set_tracing_disabled(True)
        settings = agents.ModelSettings(max_tokens=96, temperature=0)
        for model in (
            agents.OpenAIResponsesModel(model="tiny", openai_client=client),
            agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client),
        ):
            bodies.clear()
            agent = agents.Agent(name="brief", instructions="Be brief.", model=model, model_settings=settings)
            result = await agents.Runner.run(agent, "Say hello.")
            assert isinstance(result.final_output, str)
            assert bodies, "the SDK sent nothing"
            if isinstance(model, agents.OpenAIResponsesModel):
                assert bodies[-1].get("tools") == []  # what used to be refused

    _serve(test, embedded=True)


def test_an_empty_tools_list_with_a_required_choice_is_still_refused() -> None:
    async def test(client: openai.AsyncOpenAI, http: httpx.AsyncClient, bodies: Bodies) -> None:
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "tools": [], "tool_choice": "required"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"

    _serve(test)


def test_instructor_responses_mode_gets_its_object() -> None:
    instructor = pytest.importorskip("instructor")
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):  # an enum keeps the random model's forced arguments short
        name: str = pydantic.Field(json_schema_extra={"enum": ["Paris", "Rome"]})

    async def test(client: openai.AsyncOpenAI, http: httpx.AsyncClient, bodies: Bodies) -> None:
        patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
        city = await patched.responses.create(
            model="tiny", input="Which city is the capital of France?", response_model=City,
            max_output_tokens=40, temperature=0, max_retries=0,
        )  # fmt: skip
        assert isinstance(city, City) and city.name in ("Paris", "Rome")
        sent = bodies[-1]  # a forced call and the same schema as text.format: the combination once refused
        assert sent["tool_choice"] == {"type": "function", "name": "City"}
        assert sent["text"]["format"]["type"] == "json_schema"

    _serve(test)


def test_langchain_chat_and_structured_output() -> None:
    lc_openai = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(json_schema_extra={"enum": ["Paris", "Rome"]})

    async def test(client: openai.AsyncOpenAI, http: httpx.AsyncClient, bodies: Bodies) -> None:
        chat = lc_openai.ChatOpenAI(
            model="tiny", base_url="http://onecall/v1", api_key="x", http_async_client=http,
            max_tokens=40, temperature=0,
        )  # fmt: skip
        reply = await chat.ainvoke("Say hello.")
        assert isinstance(reply.content, str) and reply.response_metadata.get("model_name")
        city = await chat.with_structured_output(City, method="function_calling").ainvoke("Capital of France?")
        assert isinstance(city, City) and city.name in ("Paris", "Rome")

    _serve(test)


def test_tokenizer_info_is_what_a_remote_tokenizer_needs() -> None:
    """What lm-eval's remote tokenizer reads: eos/bos tokens that /tokenize turns into one id each,
    the chat template, and /detokenize round-tripping ids."""

    async def test(client: openai.AsyncOpenAI, http: httpx.AsyncClient, bodies: Bodies) -> None:
        info = (await http.get("/tokenizer_info")).json()
        engine_tok = tiny_engine().tokenizer
        assert info["eos_token"] == engine_tok.eos_token and info["chat_template"] == engine_tok.chat_template
        assert info["vocab_size"] == engine_tok.vocab_size and info["model_max_length"] > 0
        eos = (await http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})).json()
        assert eos["tokens"] in ([i] for i in info["eos_token_ids"])
        ids = (await http.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False})).json()
        text = (await http.post("/detokenize", json={"tokens": ids["tokens"]})).json()["prompt"]
        assert text == "Hello there"

    _serve(test)
