"""The environment a chat template runs in: jinja2's immutable sandbox, configured like Hugging Face's
apply_chat_template so real templates render the same text, strict about unsafe attributes, and bounded
in render time and size (text/template_limits.py; jinja2 3.1.6 or later: earlier releases have escapes).

    trim_blocks, lstrip_blocks       HF's whitespace handling
    loopcontrols                     {% break %} / {% continue %}
    {% generation %}                 HF's assistant-mask marker; rendered as its body
    namespace(), dict()              as HF hardens them: no underscore names, no `dict` type exposed
    raise_exception(msg)             -> TemplateError carrying msg
    strftime_now(fmt)                the local time, formatted (Llama 3 puts the date in its prompt)
    | tojson                         json.dumps with ensure_ascii=False (Jinja's own HTML-escapes)

Unlike plain jinja2, touching an unsafe attribute (`''.__class__`, `cycler.__init__`) raises at once
instead of quietly rendering an empty string.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.utils import Namespace

from onecall.errors import TemplateError
from onecall.text.template_limits import BoundedSandbox, bounded_text


class TemplateSandbox(BoundedSandbox):
    """The environment of every chat template: see the module docstring."""

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[loopcontrols, GenerationBlock],
            filters={"tojson": _tojson},
            globals={
                "raise_exception": _raise_exception,
                "strftime_now": _strftime_now,
                "namespace": _SafeNamespace,
                "dict": _make_dict,
            },  # fmt: skip
        )

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _SafeNamespace(Namespace):
    """`namespace()` that refuses underscore-prefixed names (as HF's does), so nothing private is stored."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        Namespace.__init__(self, attrs)

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


class GenerationBlock(Extension):
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
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if indent is None:  # one C call: its output is a few times the value's checked size at most
        return encoder.encode(value)
    return bounded_text(encoder.iterencode(value), "filter tojson")  # indentation grows with depth
