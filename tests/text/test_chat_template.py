"""Chat template tests: real and Qwen3-style templates rendered like Hugging Face's renderer (the reference),
template errors, sandbox escapes, message validation, and control-token marking of the rendered prompt."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import pytest

from onecall.errors import TemplateError
from onecall.text.chat_template import ChatTemplate, RenderedPrompt, render_chat
from onecall.text.tokenizer import Tokenizer

# A small template shaped like Qwen3's: tools in the system turn, reasoning kept only for assistant turns
# after the last user message (earlier <think> blocks are dropped), enable_thinking=False pre-fills an
# empty think block.
QWEN3_STYLE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must come first.') }}{%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = message.reasoning_content or '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Température actuelle d'une ville",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# `tok`: the embedded SmolLM2-135M-Instruct's tokenizer, built once per session (tests/conftest.py)


def hf_render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Hugging Face's own chat-template renderer, the reference."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered: Any = render_jinja_template([messages], chat_template=source, **kwargs)
    return str(rendered[0][0])  # (texts, generation indices)


def test_smollm2_template(tok: Tokenizer) -> None:
    assert tok.chat_template is not None
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    text = template.render(messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == hf_render(tok.chat_template, messages, add_generation_prompt=True)
    no_system = template.render([{"role": "user", "content": "Hi!"}], add_generation_prompt=False)
    assert no_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert no_system.endswith("<|im_start|>user\nHi!<|im_end|>\n")


def test_render_chat_marks_control_tokens(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say <hi> 😀"}]
    prompt = render_chat(tok, messages)
    assert isinstance(prompt, RenderedPrompt) and prompt.text.endswith("<|im_start|>assistant\n")
    assert prompt.token_ids == tok.encode(prompt.text)  # no extra BOS: the template wrote <|im_start|>
    assert len(prompt.is_control) == len(prompt.token_ids)
    assert [i for i, c in zip(prompt.token_ids, prompt.is_control, strict=True) if c] == [1, 2, 1, 2, 1]
    assert all(c == (i in (1, 2)) for i, c in zip(prompt.token_ids, prompt.is_control, strict=True))
    # list content of text parts is flattened for templates that only read strings
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    assert "user\nSay\nhi<|im_end|>" in render_chat(tok, [{"role": "user", "content": parts}]).text


def test_qwen3_style_template_drops_old_reasoning() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    text = ChatTemplate(QWEN3_STYLE).render(messages)
    assert "add them" not in text and "<|im_start|>assistant\n4<|im_end|>" in text
    assert text.endswith("<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert text == hf_render(QWEN3_STYLE, messages, add_generation_prompt=True)
    no_think = ChatTemplate(QWEN3_STYLE).render(messages, enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    assert no_think == hf_render(QWEN3_STYLE, messages, add_generation_prompt=True, enable_thinking=False)


def test_qwen3_style_template_with_tools() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I need the tool.",  # an alias: templates read it as reasoning_content
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "18°C"},
    ]
    text = ChatTemplate(QWEN3_STYLE).render(messages, tools=[WEATHER_TOOL])
    assert text.startswith(
        "<|im_start|>system\nUse tools.\n\n# Tools\n<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    )
    assert "Température" in text  # tojson keeps non-ASCII as is, like HF's
    assert (
        '<think>\nI need the tool.\n</think>\n\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in text
    )
    assert "<tool_response>\n18°C\n</tool_response>" in text
    assert text == hf_render(QWEN3_STYLE, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)


def test_template_globals_and_filters() -> None:
    assert (
        ChatTemplate("{{ bos_token }}x{{ eos_token }}", bos_token="<s>", eos_token="</s>").render([])
        == "<s>x</s>"
    )
    value = {"k": "é<&>", "n": [1, 2]}
    assert ChatTemplate("{{ v | tojson(indent=2) }}").render([], v=value) == json.dumps(
        value, ensure_ascii=False, indent=2
    )
    assert ChatTemplate("{{ v | tojson }}").render([], v=value) == json.dumps(value, ensure_ascii=False)
    loops = "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert ChatTemplate(loops).render([]) == "023"
    assert ChatTemplate("{% generation %}kept{% endgeneration %}").render([]) == "kept"
    before = datetime.now().strftime("%d %b %Y")
    today = ChatTemplate("{{ strftime_now('%d %b %Y') }}").render([])
    assert today in (before, datetime.now().strftime("%d %b %Y"))


def test_raise_exception_message() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}ok"
    )
    with pytest.raises(TemplateError, match="Conversations must start with a user"):
        template.render([{"role": "assistant", "content": "hi"}])
    assert template.render([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(TemplateError, match="System message must come first"):
        ChatTemplate(QWEN3_STYLE).render(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ messages.__class__ }}",
        "{{ '{0.__class__}'.format(1) }}",
        "{{ ('{0.__class__}'|attr('format'))(1) }}",  # CVE-2025-27516: |attr reached the plain str.format
        "{% set x = [] %}{{ x.append(1) }}",  # the sandbox is immutable too
        "{% set ns = namespace(_secret=1) %}",
    ],
)
def test_sandbox_refuses_escapes(source: str) -> None:
    with pytest.raises(TemplateError, match="sandbox"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_jinja2_has_no_known_sandbox_escape() -> None:
    """pyproject.toml requires jinja2>=3.1.6: 3.1.5 and earlier let a template reach str.format unsandboxed."""
    import jinja2

    assert tuple(int(part) for part in jinja2.__version__.split(".")[:3]) >= (3, 1, 6)


def test_template_errors() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}no end")
    with pytest.raises(TemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ({"role": "user", "content": "hi"}, "must be a list"),
        ([{"role": "user", "content": "hi"}, {"content": "no role"}], r"messages\[1\]"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, "text"], r"messages\[2\]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
            r"messages\[0\]\.content\[1\]",
        ),
        ([{"role": 7, "content": "x"}], r"messages\[0\]"),
    ],
)
def test_bad_messages_name_the_index(tok: Tokenizer, messages: Any, where: str) -> None:
    with pytest.raises(TemplateError, match=where):
        render_chat(tok, messages)


def test_no_chat_template(tok: Tokenizer) -> None:
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        render_chat(bare, [{"role": "user", "content": "hi"}])
    with pytest.raises(TemplateError, match="tools"):
        render_chat(tok, [{"role": "user", "content": "hi"}], tools={"not": "a list"})  # type: ignore[arg-type]
