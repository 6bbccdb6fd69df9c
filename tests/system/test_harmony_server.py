"""A gpt-oss (harmony) chat through the server, in-process, over a scripted model.

The engine's tokenizer has the o200k_harmony vocabulary's size and its special tokens at their ids
(<|channel|> a special token: the server detects harmony from it), the other ids plain placeholder
words; the model is a script that, after the prompt, emits a completion openai-harmony encodes
(analysis, a call to functions.get_weather, <|call|>), then EOS. What is checked, with the openai
client over ASGI: the prompt is openai-harmony's rendering, the response's reasoning_content and
tool_calls (arguments JSON), finish_reason "tool_calls" (<|call|> stopped it), whole and streamed
the same; a forced tool_choice (named or "required") is a call whatever the model wanted, after its
analysis, which is bounded; structured outputs shape the final message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import torch

pytest.importorskip("openai_harmony")
pytestmark = pytest.mark.slow  # builds gpt-oss's 200k-token tokenizer (~3 s a process)

from onecall.config import EngineConfig  # noqa: E402
from onecall.engine.engine import Engine  # noqa: E402
from onecall.engine.engine_parts import LoadedEngineParts  # noqa: E402
from onecall.formats.checkpoint import resolve_model  # noqa: E402
from onecall.model.kv_cache import PagedKVCache  # noqa: E402
from onecall.server.app import create_app  # noqa: E402
from onecall.server.async_engine import AsyncEngine  # noqa: E402
from onecall.text.harmony import harmony_encoding, render_harmony  # noqa: E402
from onecall.text.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.harmony_tokenizer import EOS, VOCAB, harmony_bytes_tokenizer  # noqa: E402
from tests.helpers.tiny_engine import tiny_model  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
HI = [{"role": "user", "content": "Weather in Paris?"}]
COMPLETION = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def harmony_tokenizer() -> Tokenizer:
    """o200k_harmony's ids with their real bytes (tests/helpers/harmony_tokenizer.py): the grammars of
    forced calls and structured outputs read them."""
    return harmony_bytes_tokenizer()


class ScriptedLM(torch.nn.Module):
    """Emits `script[position]` at each scripted position, EOS anywhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.config = dataclasses.replace(tiny_model().config, vocab_size=VOCAB)
        self.script: dict[int, int] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        return (positions + 1).float().unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        for row, position in enumerate(hidden[:, 0].long().tolist()):
            logits[row, self.script.get(position, EOS)] = 10.0
        return logits


@pytest.fixture(scope="module")
def engine() -> Engine:
    tok, model = harmony_tokenizer(), ScriptedLM()
    assert tok.encode("<|channel|>") == [200005]
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


def serve(engine: Engine, test: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> None:
    async def main() -> None:
        app = create_app(AsyncEngine(engine))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="-", http_client=http)
                await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(main())


def test_harmony_chat_reasoning_and_call(engine: Engine) -> None:
    prompt = render_harmony(HI, TOOLS)
    ids = list(harmony_encoding().encode(COMPLETION, allowed_special="all"))
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt.token_ids) + k: t for k, t in enumerate(ids)}
    model.script[len(prompt.token_ids) + len(ids)] = 200002  # past <|call|>: would be <|return|>

    async def test(client: openai.AsyncOpenAI) -> None:
        whole = await client.chat.completions.create(
            model=MODEL, messages=HI, tools=TOOLS, max_tokens=60, temperature=0
        )  # type: ignore[arg-type]
        choice = whole.choices[0]
        assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt.token_ids)
        assert whole.usage.completion_tokens == len(ids)  # <|call|> stopped it
        assert (choice.message.model_extra or {}).get("reasoning_content") == "Need the weather."
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=HI,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0,
            stream=True,
        )
        reasoning, arguments, names, finish = "", "", [], None
        async for chunk in stream:
            for ch in chunk.choices:
                reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                assert not ch.delta.content
                for d in ch.delta.tool_calls or []:
                    names += [d.function.name] if d.function and d.function.name else []
                    arguments += (d.function.arguments or "") if d.function else ""
                finish = ch.finish_reason or finish
        assert (reasoning, names, json.loads(arguments), finish) == (
            "Need the weather.",
            ["get_weather"],
            {"city": "Paris"},
            "tool_calls",
        )

    serve(engine, test)


UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}
BOTH = [*TOOLS, {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}]
ANSWER = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
)


def _script(engine: Engine, prompt_ids: list[int], completion: str) -> list[int]:
    """The model answers `completion` after this prompt (EOS anywhere off the script)."""
    ids = list(harmony_encoding().encode(completion, allowed_special="all"))
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt_ids) + k: t for k, t in enumerate(ids)}
    return ids


def test_forced_call_is_a_call_whatever_the_model_wanted(engine: Engine) -> None:
    """A model that would answer in the final channel, with tool_choice naming set_unit: its analysis
    is kept, then the grammar makes the rest a call of set_unit whose arguments match its schema;
    <|call|> ends it. A model that already calls (tool_choice "required") is not disturbed."""
    _script(engine, render_harmony(HI, BOTH).token_ids, ANSWER)

    async def test(client: openai.AsyncOpenAI) -> None:
        named = {"type": "function", "function": {"name": "set_unit"}}
        whole = await client.chat.completions.create(
            model=MODEL, messages=HI, tools=BOTH, tool_choice=named, max_tokens=60, temperature=0
        )  # type: ignore[arg-type]
        choice = whole.choices[0]
        assert (choice.message.model_extra or {}).get("reasoning_content") == "Easy."
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "set_unit"
        assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")

        stream = await client.chat.completions.create(
            model=MODEL, messages=HI, tools=BOTH, tool_choice=named, max_tokens=60, temperature=0, stream=True
        )  # type: ignore[arg-type]
        arguments, names = "", []
        async for chunk in stream:
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    names += [d.function.name] if d.function and d.function.name else []
                    arguments += (d.function.arguments or "") if d.function else ""
        assert names == ["set_unit"] and arguments == call.function.arguments

    serve(engine, test)

    ids = _script(engine, render_harmony(HI, BOTH).token_ids, COMPLETION)

    async def conforming(client: openai.AsyncOpenAI) -> None:
        whole = await client.chat.completions.create(
            model=MODEL, messages=HI, tools=BOTH, tool_choice="required", max_tokens=60, temperature=0
        )  # type: ignore[arg-type]
        [call] = whole.choices[0].message.tool_calls or []
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert whole.usage is not None and whole.usage.completion_tokens == len(ids)

    serve(engine, conforming)


def test_analysis_before_a_forced_call_is_bounded(engine: Engine) -> None:
    """An analysis that would go on past half of max_tokens is cut there; the call still comes."""
    _script(engine, render_harmony(HI, BOTH).token_ids, "<|channel|>analysis<|message|>" + " word" * 100)

    async def test(client: openai.AsyncOpenAI) -> None:
        named = {"type": "function", "function": {"name": "set_unit"}}
        whole = await client.chat.completions.create(
            model=MODEL, messages=HI, tools=BOTH, tool_choice=named, max_tokens=80, temperature=0
        )  # type: ignore[arg-type]
        choice = whole.choices[0]
        reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
        assert reasoning == " word" * 40  # the budget: 80 // 2 tokens of analysis text
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "set_unit"

    serve(engine, test)


def test_structured_outputs_shape_the_final_message(engine: Engine) -> None:
    """response_format json_schema on a model that would answer "Sunny.": the final message is JSON
    of the schema, the analysis before it kept as reasoning_content; a Lark grammar is refused."""
    _script(engine, render_harmony(HI).token_ids, ANSWER)
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}

    async def test(client: openai.AsyncOpenAI) -> None:
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=HI,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )
        choice = whole.choices[0]
        assert (choice.message.model_extra or {}).get("reasoning_content") == "Easy."
        assert isinstance(json.loads(choice.message.content or "")["sunny"], bool)
        assert choice.finish_reason == "stop"

        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL,
                messages=HI,
                max_tokens=8,
                extra_body={"structured_outputs": {"grammar": 'start: "x"'}},
            )  # type: ignore[arg-type]
        assert "structured_outputs" in str(err.value) and "harmony" in str(err.value)

    serve(engine, test)
