"""A forced tool call through the real OpenAI Agents SDK on a Qwen-like tokenizer with one token for
">\\n" (Qwen's tokenizers have it): the model closes its call with "</tool_call" + ">\\n" and wants to
stop there. The call grammar used to accept the end only after ">" alone, so ">\\n" committed the
model to another call, again and again until max_tokens (the SDK then ran the tool many times); now
the output may end after any complete call, so the SDK runs the tool once.

The model is scripted (tests/system/test_server_reasoning.py's ScriptedLM idea, keyed here by the
position in the reply, since the SDK's prompt is not known in advance): it emits the call's tokens, then
EOS everywhere else, as a model that wants to stop after its call."""

from __future__ import annotations

import asyncio
import json
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
from onecall.text.tokenizer import Tokenizer
from tests.helpers.tiny_engine import tiny_model
from tests.system.test_server_reasoning import EOS, MARKERS, QWEN3_STYLE

GT_NEWLINE = 16  # an unused token of the embedded vocabulary, made ">\n" (user-defined: matched whole)


def qwen_like_tokenizer() -> Tokenizer:
    metadata = dict(open_gguf(resolve_model(None).path).metadata)
    tokens, types = list(metadata["tokenizer.ggml.tokens"]), list(metadata["tokenizer.ggml.token_type"])
    for i, marker in {**MARKERS, GT_NEWLINE: ">\n"}.items():
        tokens[i], types[i] = marker, 4
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    metadata["tokenizer.chat_template"] = QWEN3_STYLE
    return Tokenizer.from_gguf_metadata(metadata)


class ReplyScript(torch.nn.Module):
    """Emits reply[k] as the k-th token of each request's reply (a request starts where a forward begins
    at position 0: its prompt is prefilled in one chunk here), EOS anywhere else (logit 10, the rest 0)."""

    def __init__(self, reply: list[int]) -> None:
        super().__init__()
        self.config = tiny_model().config
        self.reply = reply
        self.prompt_len = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        if int(positions[0]) == 0:
            self.prompt_len = positions.numel()
        return (positions + 1 - self.prompt_len).float().unsqueeze(1)  # the reply position being predicted

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        for row, k in enumerate(hidden[:, 0].long().tolist()):
            logits[row, self.reply[k] if 0 <= k < len(self.reply) else EOS] = 10.0
        return logits


def test_a_forced_call_stops_after_one_call_and_the_sdk_runs_the_tool_once() -> None:
    agents = pytest.importorskip("agents")
    tok = qwen_like_tokenizer()
    assert tok.encode("</tool_call>\n")[-1] != GT_NEWLINE  # the whole marker is one token...
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    # ...but a model may write it as "</tool_call" + ">\n", Qwen's tokenization of the template's text
    reply = [*tok.encode("<tool_call>\n" + call + "\n</tool_call"), GT_NEWLINE]
    assert reply[-2] != GT_NEWLINE and tok.decode(reply[-1:], skip_special_tokens=False) == ">\n"
    model = ReplyScript(reply)
    mc = model.config
    kv = PagedKVCache(mc.num_hidden_layers, 256, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu")
    parts = LoadedEngineParts(
        files=resolve_model(None), model_config=mc, model=model, tokenizer=tok,  # type: ignore[arg-type]
        kv_cache=kv, num_blocks=256, max_model_len=1024, device=torch.device("cpu"), dtype=torch.float32,
        load_seconds=0.0,
    )  # fmt: skip
    engine = Engine(EngineConfig(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=1024), parts=parts)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async def main() -> Any:
        app = create_app(AsyncEngine(engine))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="-", http_client=http)
                agents.set_tracing_disabled(True)
                agent = agents.Agent(
                    name="weather", instructions="Use the tool.", tools=[get_weather],
                    model=agents.OpenAIChatCompletionsModel(model="SmolLM2-135M-Instruct.Q4_1", openai_client=client),
                    model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
                    tool_use_behavior="stop_on_first_tool",
                )  # fmt: skip
                return await asyncio.wait_for(agents.Runner.run(agent, "Weather in Paris?"), timeout=60)

    result = asyncio.run(main())
    assert calls == ["Paris"], calls
    assert result.final_output == "sunny"
    # the model stopped right after its call: its reply and the end token, not max_tokens' worth of
    # further forced calls (then cut, and dropped from the message)
    (response,) = result.raw_responses
    assert response.usage.output_tokens == len(reply) + 1, response.usage
