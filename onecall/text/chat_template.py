"""Chat templates: a model's Jinja template, rendered in a sandbox, then tokenized.

A chat template is code shipped with the model, so it runs in jinja2's ImmutableSandboxedEnvironment,
configured like Hugging Face's apply_chat_template so real templates render the same text:

    trim_blocks, lstrip_blocks       HF's whitespace handling
    loopcontrols                     {% break %} / {% continue %}
    {% generation %}                 HF's assistant-mask marker; rendered as its body
    namespace(), dict()              as HF hardens them: no underscore names, no `dict` type exposed
    raise_exception(msg)             -> TemplateError carrying msg
    strftime_now(fmt)                the local time, formatted (Llama 3 puts the date in its prompt)
    | tojson                         json.dumps with ensure_ascii=False (Jinja's own HTML-escapes)

Unlike plain jinja2, touching an unsafe attribute (`''.__class__`, `cycler.__init__`) raises at once
instead of quietly rendering an empty string. Every failure a template or a request can cause surfaces
as a TemplateError with a message that says what went wrong.

Messages are checked before rendering (role a string; content a string, None or a list of text parts)
and list content is flattened to one string, parts joined by newlines as vLLM does, since many templates
(SmolLM2's, Qwen3's) only read string content.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from onecall.errors import TemplateError
from onecall.text.tokenizer import Tokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered conversation: its text, token ids, and which ids are control tokens."""

    text: str
    token_ids: list[int]
    is_control: list[bool]  # per id: is it a control (special) token


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute is an error, not a silent Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed names (as HF's does), so nothing private is stored."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the private name {name!r}")


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    """The template's `dict(...)`: builds a dict without exposing the `dict` type itself."""
    return dict(*args, **kwargs)


class _GenerationBlock(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training): just the body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"chat template raised an error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """One chat template, compiled once, rendered per request."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = _StrictSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _SafeNamespace
        env.globals["dict"] = _make_dict
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text. kwargs reach the template as variables (e.g. enable_thinking=False)."""
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": _checked_messages(messages),
            "tools": _checked_tools(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except TemplateError:
            raise  # raise_exception() inside the template
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template tried to leave its sandbox: {e}") from e
        except Exception as e:  # the template is model-supplied code: any failure in it is a template error
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate the conversation; return copies with list content flattened to a string."""
    if not isinstance(messages, list):
        raise TemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise TemplateError(f"messages[{i}] needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise TemplateError(
                        f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': str}}"
                    )
            content = "\n".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise TemplateError(
                f"messages[{i}].content must be a string, null or a list of text parts, got {type(content).__name__}"
            )
        checked.append(
            _with_reasoning_aliases({**message, "content": content} if "content" in message else message)
        )
    return checked


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """Reasoning sent as reasoning_content, thinking or reasoning is visible under the first two names
    (what Qwen3-style and gpt-oss templates read), as HF does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _checked_tools(tools: Any) -> list[dict] | None:
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TemplateError("tools must be a list of tool objects")
    return tools


@functools.lru_cache(maxsize=16)
def _compiled(source: str, bos_token: str | None, eos_token: str | None) -> ChatTemplate:
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> RenderedPrompt:
    """Render with the model's template and tokenize like HF's apply_chat_template(tokenize=True):
    control tokens in the text are matched whole and no BOS is added (the template writes its own).

    `template` (Jinja source, e.g. from onecall.text.templates) replaces the model's own template for
    this call; it runs in the same sandbox. Only the Python API passes one: the server does not."""
    source = template if template is not None else tokenizer.chat_template
    if source is None:
        raise TemplateError("this model has no chat template; send a plain prompt instead")
    compiled = _compiled(source, tokenizer.bos_token, tokenizer.eos_token)
    text = compiled.render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    special = tokenizer.special_ids
    return RenderedPrompt(text=text, token_ids=token_ids, is_control=[i in special for i in token_ids])
