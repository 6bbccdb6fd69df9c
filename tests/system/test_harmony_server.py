"""A gpt-oss (harmony) chat through the server, in-process, over a scripted model.

The engine's tokenizer has the o200k_harmony vocabulary's size and its special tokens at their ids
(<|channel|> a special token: the server detects harmony from it), the other ids plain placeholder
words; the model is a script that, after the prompt, emits a completion openai-harmony encodes
(analysis, a call to functions.get_weather, <|call|>), then EOS. What is checked, with the openai
client over ASGI: the prompt is openai-harmony's rendering, the response's reasoning_content and
tool_calls (arguments JSON), finish_reason "tool_calls" (<|call|> stopped it), whole and streamed
the same; a forced tool_choice is a 400 naming tool_choice.
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
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

pytest.importorskip("openai_harmony")

from onecall.config import EngineConfig  # noqa: E402
from onecall.engine.engine import Engine  # noqa: E402
from onecall.engine.engine_parts import LoadedEngineParts  # noqa: E402
from onecall.formats.checkpoint import resolve_model  # noqa: E402
from onecall.model.kv_cache import PagedKVCache  # noqa: E402
from onecall.server.app import create_app  # noqa: E402
from onecall.server.async_engine import AsyncEngine  # noqa: E402
from onecall.text.harmony import harmony_encoding, render_harmony  # noqa: E402
from onecall.text.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.tiny_engine import tiny_model  # noqa: E402

VOCAB = 201088  # o200k_harmony
EOS = 199999  # <|endoftext|>
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
    enc = harmony_encoding()
    specials = {t: enc.encode(t, allowed_special="all")[0] for t in enc.special_tokens_set}
    by_id = {i: t for t, i in specials.items() if i < VOCAB}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(VOCAB)}
    hf = HFTokenizer(WordLevel(vocab, unk_token="w0"))
    hf.add_special_tokens([AddedToken(t, special=True) for t in by_id.values()])
    return Tokenizer(
        hf,
        bos_token_id=None,
        eos_token_ids=frozenset({EOS}),
        eos_token_id=EOS,
        special_ids=frozenset(by_id),
        add_bos_token=False,
        chat_template=None,
        piece_mode="plain",
    )


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

        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=HI, tools=TOOLS, tool_choice="required"
            )  # type: ignore[arg-type]
        assert "tool_choice" in str(err.value)

    serve(engine, test)
