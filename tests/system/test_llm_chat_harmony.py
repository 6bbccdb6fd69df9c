"""LLM.chat on a gpt-oss (harmony) model: rendered, stopped and parsed as the server does it.

The engine is the server test's (tests/system/test_harmony_server.py): a tokenizer with the
o200k_harmony vocabulary's size and its special tokens at their ids (<|channel|> one special token:
speaks_harmony), and a scripted model that emits, after the prompt, a completion openai-harmony
encodes, then EOS. What is checked, on real engine outputs: the prompt is openai-harmony's rendering
(with the tools when offered, without them for tool_choice "none"); an analysis message, a final
message and a commentary call to functions.get_weather split into reasoning, text/content and
tool_calls (ToolCall: id, name, arguments_json); <|return|> and <|call|> stop the request (the
script goes on past them); a forced tool_choice is a call and structured outputs shape the final
message, as in the server (tests/system/test_harmony_server.py); a chat_template, a Lark grammar
and structured outputs beside a forced call are InvalidParameterErrors naming the field; a plain model's LLM.chat does not speak harmony.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("openai_harmony")
pytestmark = pytest.mark.slow  # builds gpt-oss's 200k-token tokenizer (~3 s a process)

from onecall.config import EngineConfig  # noqa: E402
from onecall.engine.engine import Engine  # noqa: E402
from onecall.engine.engine_parts import LoadedEngineParts  # noqa: E402
from onecall.errors import InvalidParameterError  # noqa: E402
from onecall.formats.checkpoint import resolve_model  # noqa: E402
from onecall.llm import LLM, HarmonyChatOutput, HarmonyToolChatOutput  # noqa: E402
from onecall.model.kv_cache import PagedKVCache  # noqa: E402
from onecall.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from onecall.text.harmony import harmony_encoding, render_harmony  # noqa: E402
from onecall.tools.calling import ToolChatOutput  # noqa: E402
from tests.helpers.tiny_engine import tiny_engine  # noqa: E402
from tests.system.test_harmony_server import HI, TOOLS, ScriptedLM, harmony_tokenizer  # noqa: E402

RETURN, CALL = 200002, 200012  # <|return|>, <|call|>
ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Checking Paris.<|end|>"
CALL_PARIS = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
)
GREEDY = SamplingParams(temperature=0, max_tokens=80)


@pytest.fixture(scope="module")
def llm() -> LLM:
    tok, model = harmony_tokenizer(), ScriptedLM()
    mc = model.config
    kv_cache = PagedKVCache(
        mc.num_hidden_layers, 256, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu"
    )
    parts = LoadedEngineParts(
        files=resolve_model(None), model_config=mc, model=model, tokenizer=tok,  # type: ignore[arg-type]
        kv_cache=kv_cache, num_blocks=256, max_model_len=1024, device=torch.device("cpu"),
        dtype=torch.float32, load_seconds=0.0,
    )  # fmt: skip
    return LLM(engine=Engine(EngineConfig(device="cpu", dtype="float32", block_size=4), parts=parts))


def script(llm: LLM, prompt_ids: list[int], completion: str) -> list[int]:
    """Make the model answer `completion` after a prompt of this length, then go on (<|return|>)."""
    ids = list(harmony_encoding().encode(completion, allowed_special="all"))
    model = llm.engine.parts.model
    assert isinstance(model, ScriptedLM)
    start = len(prompt_ids)
    model.script = {start + k: t for k, t in enumerate(ids)}
    model.script[start + len(ids)] = RETURN  # what it would say past a stop token
    return ids


def test_detected_as_the_server_detects_it(llm: LLM) -> None:
    assert llm.speaks_harmony
    assert llm.render(HI).token_ids == render_harmony(HI).token_ids
    assert llm.render(HI, tools=TOOLS).token_ids == render_harmony(HI, TOOLS).token_ids


def test_chat_splits_reasoning_and_final(llm: LLM) -> None:
    prompt = render_harmony(HI)
    ids = script(llm, prompt.token_ids, ANSWER)
    [out] = llm.chat(HI, GREEDY)
    assert isinstance(out, HarmonyChatOutput)
    assert out.prompt_token_ids == prompt.token_ids
    assert out.token_ids == ids and ids[-1] == RETURN  # <|return|> stopped it
    assert (out.text, out.reasoning, out.finish_reason) == ("Sunny.", "Easy.", "stop")


def test_chat_with_tools_analysis_final_and_call(llm: LLM) -> None:
    prompt = render_harmony(HI, TOOLS)
    ids = script(llm, prompt.token_ids, ANALYSIS + FINAL + CALL_PARIS)
    [out] = llm.chat([HI], GREEDY, tools=TOOLS)  # a batch of one
    assert isinstance(out, HarmonyToolChatOutput) and isinstance(out, ToolChatOutput)
    assert out.output.prompt_token_ids == prompt.token_ids
    assert out.output.token_ids == ids and ids[-1] == CALL  # <|call|> stopped it, not the script's end
    assert out.reasoning == "Need the weather."
    assert out.content == "Checking Paris." == out.output.text
    [call] = out.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments_json) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert out.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first(llm: LLM) -> None:
    second = CALL_PARIS.replace("Paris", "Oslo").replace("<|call|>", "<|end|>")
    prompt = render_harmony(HI, TOOLS)
    script(llm, prompt.token_ids, ANALYSIS + second + CALL_PARIS)
    [both] = llm.chat(HI, GREEDY, tools=TOOLS)
    assert [json.loads(c.arguments_json)["city"] for c in both.tool_calls] == ["Oslo", "Paris"]
    [one] = llm.chat(HI, GREEDY, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.arguments_json)["city"] for c in one.tool_calls] == ["Oslo"]


def test_tool_choice_none_withdraws_the_tools(llm: LLM) -> None:
    prompt = render_harmony(HI)  # no tools in the developer message
    script(llm, prompt.token_ids, ANSWER)
    [out] = llm.chat(HI, GREEDY, tools=TOOLS, tool_choice="none")
    assert isinstance(out, HarmonyToolChatOutput)
    assert out.output.prompt_token_ids == prompt.token_ids
    assert (out.content, out.reasoning, out.tool_calls, out.finish_reason) == ("Sunny.", "Easy.", [], "stop")


def test_own_stop_ids_kept(llm: LLM) -> None:
    prompt = render_harmony(HI)
    ids = script(llm, prompt.token_ids, ANSWER)
    [out] = llm.chat(HI, SamplingParams(temperature=0, max_tokens=80, stop_token_ids=(ids[2],)))
    assert out.token_ids == ids[:3]  # its own stop id ended it first


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"params": SamplingParams(structured_outputs=StructuredOutputsParams(grammar='start: "x"'))}, "structured_outputs"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "params": SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})),
            },
            "structured_outputs",
        ),
    ],
)  # fmt: skip
def test_refusals_name_the_field(llm: LLM, kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        llm.chat(HI, **kwargs)  # type: ignore[call-overload]
    assert err.value.param == param


def test_plain_model_does_not_speak_harmony() -> None:
    llm = LLM(engine=tiny_engine())
    assert not llm.speaks_harmony
    [out] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))
    assert type(out) is not HarmonyChatOutput and not hasattr(out, "reasoning")


UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}
BOTH = [*TOOLS, {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}]


def test_forced_call_and_structured_outputs(llm: LLM) -> None:
    """The server's grammars over harmony's channels, through LLM.chat: a model that would answer in
    the final channel calls the named function; with a JSON schema its final message is that JSON."""
    script(llm, render_harmony(HI, BOTH).token_ids, ANSWER)
    named = {"type": "function", "function": {"name": "set_unit"}}
    [out] = llm.chat(HI, GREEDY, tools=BOTH, tool_choice=named)
    assert isinstance(out, HarmonyToolChatOutput)
    assert (out.reasoning, out.content, out.finish_reason) == ("Easy.", None, "tool_calls")
    [call] = out.tool_calls
    assert call.name == "set_unit" and json.loads(call.arguments_json)["unit"] in ("celsius", "fahrenheit")

    script(llm, render_harmony(HI).token_ids, ANSWER)
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    so = StructuredOutputsParams(json=schema)
    [plain] = llm.chat(HI, SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
    assert isinstance(plain, HarmonyChatOutput) and plain.reasoning == "Easy."
    assert isinstance(json.loads(plain.text)["sunny"], bool)


def test_chat_stream_splits_by_channel(llm: LLM) -> None:
    """Each streamed output is one token's: its deltas add up to the channels chat() splits whole."""
    ids = script(llm, render_harmony(HI).token_ids, ANSWER)
    outs = list(llm.chat_stream(HI, GREEDY))
    assert all(isinstance(o, HarmonyChatOutput) for o in outs)
    assert [t for o in outs for t in o.delta_token_ids] == ids  # <|return|> stopped it
    assert "".join(o.delta_text for o in outs) == outs[-1].text == "Sunny."
    assert "".join(o.delta_reasoning for o in outs) == "Easy."  # type: ignore[attr-defined]
    last = outs[-1]
    assert isinstance(last, HarmonyChatOutput) and last.reasoning == "Easy." and last.finished
    [whole] = llm.chat(HI, GREEDY)
    assert (whole.text, whole.reasoning) == (last.text, last.reasoning)  # type: ignore[attr-defined]
