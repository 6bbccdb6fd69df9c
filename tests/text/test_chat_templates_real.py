"""Real models' chat templates (tests/data/chat_templates/, provenance in its README.md) rendered by onecall's
sandbox and by transformers' own apply_chat_template, which is the reference: the two texts must be equal.

Each template is rendered over a set of conversations (system + user; several turns; reasoning kept in the
history; tool definitions with an assistant tool call and its result; the generation prompt on and off;
thinking on and off where the template has a switch). Where the reference refuses a conversation (a template's
raise_exception, a type error in the template), onecall must refuse it too, with a TemplateError.

The tokenizer the reference renders with is a tiny word-level one: apply_chat_template(tokenize=False) only
reads its special tokens (bos_token, eos_token) and its chat_template, so the vocabulary does not matter.

Loading is covered at the end: the same template reaches the renderer unchanged from a Hugging Face folder
(tokenizer_config.json's chat_template, or chat_template.jinja) and from a GGUF file's tokenizer.chat_template.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from onecall.errors import TemplateError
from onecall.text.chat_template import ChatTemplate
from onecall.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # ~10 s: hundreds of renders through transformers; make test runs it

DATA = Path(__file__).parent.parent / "data" / "chat_templates"


@dataclass(frozen=True)
class RealTemplate:
    """One template file and the special tokens its model's tokenizer_config.json declares."""

    file: str
    bos_token: str | None
    eos_token: str
    has_tools: bool = True
    thinking_kwarg: str | None = None  # the template variable that switches reasoning, if any
    json_arguments: bool = False  # tool-call arguments are a JSON string in the history, not an object
    has_system: bool = True

    @property
    def source(self) -> str:
        return (DATA / self.file).read_text(encoding="utf-8")


TEMPLATES = {
    "qwen3": RealTemplate("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>", thinking_kwarg="enable_thinking"),
    "qwen3.5": RealTemplate("Qwen-Qwen3.5.jinja", None, "<|im_end|>", thinking_kwarg="enable_thinking"),
    "gemma4": RealTemplate(
        "google-gemma-4-31B-it-interleaved.jinja", "<bos>", "<eos>", thinking_kwarg="enable_thinking"
    ),
    "gpt-oss": RealTemplate("openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>"),
    "deepseek-v3.1": RealTemplate(
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        thinking_kwarg="thinking",
        json_arguments=True,
    ),
    "llama3.1": RealTemplate("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": RealTemplate("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": RealTemplate("google-gemma-3.jinja", "<bos>", "<eos>", has_tools=False),
    "gemma2": RealTemplate("google-gemma-2-2b-it.jinja", "<bos>", "<eos>", has_tools=False, has_system=False),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def _conversations(t: RealTemplate) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """name -> (messages, render arguments) for the features this template has."""
    system = [{"role": "system", "content": "You are a terse assistant."}] if t.has_system else []
    turns = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    cases: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
        "user": ([{"role": "user", "content": "Hello there."}], {}),
        "system-user": ([*system, {"role": "user", "content": "Hello there."}], {}),
        "multi-turn": ([*system, *turns], {}),
        "multi-turn-no-generation-prompt": ([*system, *turns[:2]], {"add_generation_prompt": False}),
        "reasoning-in-history": (
            [
                *system,
                turns[0],
                {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
                turns[2],
            ],
            {},
        ),
        "reasoning-after-last-user": (
            [*system, turns[0], {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}],
            {"add_generation_prompt": False},
        ),
        "one-text-part": ([{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}], {}),
        "two-text-parts": (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there."}],
                }
            ],
            {},
        ),
    }
    if t.has_tools:
        arguments: Any = {"city": "Paris", "unit": "celsius"}
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps(arguments) if t.json_arguments else arguments,
            },
        }
        asked = {"role": "user", "content": "Weather in Paris?"}
        cases["tools-defined"] = ([*system, asked], {"tools": [WEATHER_TOOL]})
        result = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}
        for content, case in (("", "tool-call-and-result"), (None, "tool-call-null-content")):
            called = {"role": "assistant", "content": content, "tool_calls": [call]}
            cases[case] = ([*system, asked, called, result], {"tools": [WEATHER_TOOL]})
        cases["tool-history-without-tools"] = (cases["tool-call-and-result"][0], {})
        cases["tool-result-then-answer"] = (
            [*system, asked, {"role": "assistant", "content": "", "tool_calls": [call]}, result,
             {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "Thanks."}],
            {"tools": [WEATHER_TOOL]},
        )  # fmt: skip
    if t.thinking_kwarg is not None:
        for on in (False, True):
            cases[f"{t.thinking_kwarg}={on}"] = ([*system, *turns], {t.thinking_kwarg: on})
    return cases


# Differences that are onecall's choice, not a bug: (template, case) -> reason.
_FLATTENED = (
    "onecall flattens list content to one string for a template that does not loop over a message's content "
    "(parts joined by a newline, as vLLM does), where transformers hands the list over; this template only "
    "reads string content: under transformers it fails on a list or prints the list's Python repr, where "
    "onecall renders the text"
)
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    (name, case): _FLATTENED
    for name in ("qwen3", "gpt-oss", "deepseek-v3.1", "llama3.1", "llama3.2", "gemma2")
    for case in ("one-text-part", "two-text-parts")
}


CASES = [
    pytest.param(
        name,
        case,
        id=f"{name}-{case}",
        marks=[pytest.mark.xfail(reason=KNOWN_DIFFERENCES[(name, case)], strict=True)]
        if (name, case) in KNOWN_DIFFERENCES
        else [],
    )
    for name, t in TEMPLATES.items()
    for case in _conversations(t)
]


def _reference_tokenizer(t: RealTemplate, source: str | None = None) -> PreTrainedTokenizerFast:
    words = {w: i for i, w in enumerate(["<unk>", t.eos_token, *([t.bos_token] if t.bos_token else [])])}
    backend = HFTokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=t.bos_token,
        eos_token=t.eos_token,
        unk_token="<unk>",
        chat_template=t.source if source is None else source,
    )


def _render_both(t: RealTemplate, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(transformers' text or its exception, onecall's text or its exception)."""
    kwargs = {"add_generation_prompt": True, **kwargs}
    tools = kwargs.pop("tools", None)
    try:
        want: Any = _reference_tokenizer(t).apply_chat_template(
            copy.deepcopy(messages), tools=tools, tokenize=False, **kwargs
        )
    except Exception as e:  # the reference refuses this conversation
        want = e
    template = ChatTemplate(t.source, bos_token=t.bos_token, eos_token=t.eos_token)
    try:
        got: Any = template.render(copy.deepcopy(messages), tools=copy.deepcopy(tools), **kwargs)
    except TemplateError as e:
        got = e
    return want, got


@pytest.mark.parametrize(("name", "case"), CASES)
def test_renders_as_transformers(name: str, case: str) -> None:
    t = TEMPLATES[name]
    messages, kwargs = _conversations(t)[case]
    want, got = _render_both(t, messages, kwargs)
    if isinstance(want, Exception):
        assert isinstance(got, TemplateError), f"transformers refused ({want!r}); onecall rendered {got!r}"
    else:
        assert isinstance(want, str) and want, "the reference rendered nothing"
        assert got == want


def test_list_content_reaches_templates_that_loop_over_it() -> None:
    """Which real templates get list content as a list (they loop over a message's content) and which get
    it flattened: the split KNOWN_DIFFERENCES relies on."""
    walks = {name for name, t in TEMPLATES.items() if ChatTemplate(t.source).walks_content_lists}
    assert walks == {"qwen3.5", "gemma4", "gemma3"}


@pytest.mark.parametrize(
    "source",
    [
        "{{ documents is none }} {{ documents is defined }} {{ tools is none }}",
        "{% for m in messages %}{{ m.content is none }} {{ m.content is defined }} {{ m.tool_calls is defined }}{% endfor %}",
    ],
)
def test_variables_the_reference_always_defines(source: str) -> None:
    """`documents` and `tools` are defined (as none) when not given, and a None-valued message key is absent,
    under transformers: the same here, so a template's `is none` / `is defined` tests read alike."""
    t = RealTemplate("", None, "</s>")
    messages = [{"role": "assistant", "content": None, "tool_calls": None}]
    want = _reference_tokenizer(t, source).apply_chat_template(messages, tokenize=False)
    assert ChatTemplate(source).render(messages, add_generation_prompt=False) == want


def test_the_reference_refuses_only_what_the_templates_forbid() -> None:
    """Outside list content (see KNOWN_DIFFERENCES), transformers refuses just the tool-call turns whose content
    is null under the two templates that concatenate it (Qwen3-0.6B's, DeepSeek-V3.1's: a dropped key is
    undefined there), so everywhere else the equality test compares text, not two failures."""
    refused = set()
    for name, t in TEMPLATES.items():
        for case, (messages, kwargs) in _conversations(t).items():
            if case.endswith(("text-part", "text-parts")):
                continue
            want, _ = _render_both(t, messages, kwargs)
            if isinstance(want, Exception):
                refused.add((name, case))
    assert refused == {("qwen3", "tool-call-null-content"), ("deepseek-v3.1", "tool-call-null-content")}


def test_deepseek_v31_tool_history_needs_string_arguments() -> None:
    """DeepSeek-V3.1's template concatenates a tool call's arguments as a string: with an object (what the
    server's template_messages makes of the wire form) both renderers refuse the conversation."""
    t = TEMPLATES["deepseek-v3.1"]
    messages, kwargs = _conversations(t)["tool-call-and-result"]
    messages = copy.deepcopy(messages)
    function = messages[-2]["tool_calls"][0]["function"]
    function["arguments"] = json.loads(function["arguments"])
    want, got = _render_both(t, messages, kwargs)
    assert isinstance(want, Exception)
    assert isinstance(got, TemplateError) and "concatenate" in str(got)


def _word_level_folder(folder: Path, config: dict[str, Any]) -> None:
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, "<|im_end|>": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_hf_folder_hands_the_template_over_unchanged(tmp_path: Path, where: str) -> None:
    source = TEMPLATES["qwen3.5"].source
    if where == "chat_template.jinja":
        _word_level_folder(tmp_path, {})
        (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    else:
        _word_level_folder(tmp_path, {"chat_template": source})
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == source


def test_gguf_hands_the_template_over_unchanged() -> None:
    """tokenizer.chat_template from GGUF metadata is the template, byte for byte (a GPT-2 style vocabulary)."""
    source = TEMPLATES["deepseek-v3.1"].source
    tokens = ["<unk>", "<｜end▁of▁sentence｜>", "a", "b", "ab"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.chat_template": source,
    }
    assert Tokenizer.from_gguf_metadata(metadata).chat_template == source


# gpt-oss is served through openai-harmony (onecall/text/harmony.py), not through its Jinja template. Where the
# two disagree, the case is listed here.
_HARMONY_DIFFERENCES = {
    "system-user": "the template ends a developer message without tools with '\\n\\n'; harmony does not",
    "multi-turn": "the template ends a developer message without tools with '\\n\\n'; harmony does not",
    "multi-turn-no-generation-prompt": "render_harmony always ends with the model's turn "
    "(add_generation_prompt=False is not honoured; the last final message ends <|end|>, not <|return|>)",
    "reasoning-in-history": "the template ends a developer message without tools with '\\n\\n'; harmony does not",
    "reasoning-after-last-user": "render_harmony always ends with the model's turn and drops the last "
    "assistant turn's analysis; the template keeps it when add_generation_prompt=False",
    "tool-call-and-result": "harmony writes '<|constrain|>json' where the template writes 'json', and the "
    "template quotes the tool result with tojson where harmony writes it as sent",
    "tool-call-null-content": "as tool-call-and-result",
    "tool-result-then-answer": "as tool-call-and-result",
    "tool-history-without-tools": "as tool-call-and-result, and the template ends a developer message without "
    "tools with '\\n\\n'",
}
_DATE_LINE = re.compile(r"Current date: \d{4}-\d{2}-\d{2}\n")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=[pytest.mark.xfail(reason=_HARMONY_DIFFERENCES[case], strict=True)]
            if case in _HARMONY_DIFFERENCES
            else [],
        )
        for case in _conversations(TEMPLATES["gpt-oss"])
        if not case.endswith(("text-part", "text-parts"))
    ],
)
def test_gpt_oss_harmony_renders_as_the_template(case: str) -> None:
    """What the server sends a gpt-oss model (render_harmony) against its real template under transformers."""
    pytest.importorskip("openai_harmony")
    from onecall.text.harmony import render_harmony

    t = TEMPLATES["gpt-oss"]
    messages, kwargs = _conversations(t)[case]
    want, _ = _render_both(t, messages, kwargs)
    assert isinstance(want, str) and len(_DATE_LINE.findall(want)) == 1
    got = render_harmony(copy.deepcopy(messages), kwargs.get("tools")).text
    assert len(_DATE_LINE.findall(got)) == 1  # today's, as the template's strftime_now writes it
    assert got == want


# ---- the server's path: a model folder's template, the wire form of the messages, render_chat ----------------
# gpt-oss is left out: the server renders it through harmony (test_gpt_oss_harmony_renders_as_the_template).
_SERVED = [name for name in TEMPLATES if name != "gpt-oss"]
_JSON_CONVENTION = (
    "the server offers tools to a template only when it writes <tool_call> blocks (tools/specs.py "
    "ToolFormat.for_template); this template has its own call syntax, so the server renders the tools as "
    "its JSON convention's system prompt, and the history's calls as that convention's JSON, instead"
)
_GEMMA4_TOOL_RESPONSES = (
    "the server hands Gemma 4's template the tools and the calls as they are, but the `tool` messages as "
    "the calling message's tool_responses, which is where this template reads results (it would render a "
    "`tool` message as a turn of a role Gemma 4 does not have); transformers, given the messages as they "
    "are, renders that turn. tests/tools/test_gemma4_tool_calls.py checks the server's text against "
    "transformers' rendering of the rewritten messages"
)
_SERVER_DIFFERENCES = {
    **{
        (name, case): _JSON_CONVENTION
        for name in ("deepseek-v3.1", "llama3.1", "llama3.2")
        for case in ("tool-call-and-result", "tool-result-then-answer", "tool-history-without-tools")
    },
    **{
        ("gemma4", case): _GEMMA4_TOOL_RESPONSES
        for case in ("tool-call-and-result", "tool-result-then-answer", "tool-history-without-tools")
    },
}


def _model_folder(folder: Path, t: RealTemplate) -> Tokenizer:
    specials = [s for s in (t.bos_token, t.eos_token) if s]
    backend = HFTokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *specials])}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": t.bos_token, "eos_token": t.eos_token, "chat_template": t.source}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_hf_folder(folder)


def _wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as an OpenAI client sends them: tool-call arguments as a JSON string."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or ():
            if not isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


@pytest.mark.parametrize(
    ("name", "case"),
    [
        pytest.param(
            name,
            case,
            id=f"{name}-{case}",
            marks=[pytest.mark.xfail(reason=_SERVER_DIFFERENCES[(name, case)], strict=True)]
            if (name, case) in _SERVER_DIFFERENCES
            else [],
        )
        for name in _SERVED
        for case in (
            "system-user",
            "multi-turn",
            "tool-call-and-result",
            "tool-result-then-answer",
            "tool-history-without-tools",
            "two-text-parts",
        )
        if case in _conversations(TEMPLATES[name]) and (name, case) not in KNOWN_DIFFERENCES
    ],
)
def test_the_server_renders_a_folders_template_as_transformers(tmp_path: Path, name: str, case: str) -> None:
    """A model folder's template, loaded as the server loads it, fed a chat request's messages and tools the
    way prepare_chat (server/serving_chat.py) feeds them (ChatTools.template_inputs over template_messages,
    then render_chat): transformers' text for the same conversation."""
    from onecall.server.params import template_messages
    from onecall.server.protocol import ChatCompletionRequest
    from onecall.server.serving_tools import chat_tools
    from onecall.text.chat_template import render_chat

    t = TEMPLATES[name]
    messages, kwargs = _conversations(t)[case]
    want, _ = _render_both(t, messages, kwargs)
    assert isinstance(want, str)
    tokenizer = _model_folder(tmp_path, t)
    assert tokenizer.chat_template == t.source
    body: dict[str, Any] = {"messages": _wire(messages)}
    if kwargs.get("tools"):
        body["tools"] = kwargs["tools"]
    req = ChatCompletionRequest.model_validate(body)
    rendered_messages, tools = chat_tools(req, tokenizer).template_inputs(template_messages(req.messages))
    assert render_chat(tokenizer, rendered_messages, tools=tools).text == want
