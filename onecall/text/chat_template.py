"""Chat templates: a model's Jinja template, rendered in a sandbox, then tokenized.

A chat template is code shipped with the model, so it runs in text/template_sandbox.py's environment:
jinja2's immutable sandbox configured like Hugging Face's apply_chat_template (real templates render the
same text), strict about unsafe attributes and bounded in render time and size (text/template_limits.py). Every
failure a template or a request can cause surfaces as a TemplateError with a message that says what went
wrong: a syntax error, raise_exception() in the template, an attempt to leave the sandbox, a limit.

Messages are checked before rendering (role a string; content a string, None or a list of text parts).
List content is flattened to one string, parts joined by newlines as vLLM does, since many templates
(SmolLM2's, Qwen3's) only read string content; a template that loops over a message's content itself
(Qwen3.5's, Gemma 3's and 4's) gets the list, as transformers gives it. Keys whose value is None are
dropped, as transformers does (an OpenAI client sends `"content": null` beside tool calls; Qwen3's and
gpt-oss's templates test `'...' in message.content`, which a missing key passes and None fails).
tests/text/test_chat_templates_real.py renders real models' templates here and with transformers and
compares the text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols

from onecall.errors import TemplateError
from onecall.text.template_limits import LimitExceeded, RenderLimits, render_bounded
from onecall.text.template_sandbox import GenerationBlock, TemplateSandbox
from onecall.text.tokenizer import Tokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered conversation: its text, token ids, and which ids are control tokens."""

    text: str
    token_ids: list[int]
    is_control: list[bool]  # per id: is it a control (special) token


class ChatTemplate:
    """One chat template, compiled once, rendered per request."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        limits: RenderLimits | None = None,
    ) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
        self.source = source
        self.walks_content_lists = _walks_content_lists(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits or RenderLimits()

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
            "documents": None,  # transformers always defines it (RAG templates test `documents is not none`)
            **kwargs,
            "messages": _checked_messages(messages, flatten=not self.walks_content_lists),
            "tools": _checked_tools(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return render_bounded(self._template, self.limits, context)
        except TemplateError:
            raise  # raise_exception() inside the template
        except LimitExceeded as e:
            raise TemplateError(str(e)) from None
        except RecursionError:
            raise TemplateError("the chat template nests too deeply (recursive macros or values)") from None
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template tried to leave its sandbox: {e}") from e
        except Exception as e:  # the template is model-supplied code: any failure in it is a template error
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def _walks_content_lists(source: str) -> bool:
    """Does the template loop over a message's content itself (`for item in message['content']`, or over a
    name `content`, as Qwen3.5's render_content macro does)? Then list content reaches it as a list, as
    transformers passes it (vLLM decides its "openai" content format the same way)."""
    tree = jinja2.Environment(extensions=[loopcontrols, GenerationBlock]).parse(source)  # parsed, never run
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if (
            (isinstance(it, nodes.Name) and it.name == "content")
            or (isinstance(it, nodes.Getattr) and it.attr == "content")
            or (
                isinstance(it, nodes.Getitem)
                and isinstance(it.arg, nodes.Const)
                and it.arg.value == "content"
            )
        ):
            return True
    return False


def _checked_messages(messages: Any, *, flatten: bool = True) -> list[dict[str, Any]]:
    """Validate the conversation; return copies with list content flattened to a string (`flatten`) or
    kept as a list of text-part copies."""
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
            content = (
                "\n".join(part["text"] for part in content) if flatten else [{**part} for part in content]
            )
        elif content is not None and not isinstance(content, str):
            raise TemplateError(
                f"messages[{i}].content must be a string, null or a list of text parts, got {type(content).__name__}"
            )
        # keys set to None are left out, as transformers' apply_chat_template does: templates test a missing
        # key (`'x' in message.content`, `message.tool_calls is defined`) where None would crash or render "None"
        message = {**message, "content": content} if "content" in message else message
        checked.append(_with_reasoning_aliases({k: v for k, v in message.items() if v is not None}))
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


@functools.cache
def _environment() -> TemplateSandbox:
    """One sandbox for every template (it holds no per-render state: that is the render's budget)."""
    return TemplateSandbox()


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
