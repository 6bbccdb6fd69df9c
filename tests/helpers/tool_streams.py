"""Tool-call parsers fed a text in pieces, for the per-format tests (tests/tools/test_*_tool_calls.py):
the same calls and content must come out whatever the cut of the stream."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from onecall.tools.calls import ToolCallParser, assemble_tool_calls
from onecall.tools.specs import ToolFormat


def call_ids() -> Callable[[], str]:
    """Deterministic call ids: call_000, call_001, ..."""
    counter = itertools.count()
    return lambda: f"call_{next(counter):03d}"


def stream_parse(
    fmt: ToolFormat,
    tool_parameters: dict[str, Any],
    text: str,
    pieces: list[str],
    *,
    stream_arguments: bool = False,
) -> tuple[str | None, list[tuple[str, str]]]:
    """`pieces` (which must join to `text`) through one parser of `fmt`: (content or None, [(name,
    arguments_json)])."""
    parser = ToolCallParser(
        fmt, tool_parameters=tool_parameters, new_id=call_ids(), stream_arguments=stream_arguments
    )
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    assert "".join(pieces) == text
    content = "".join(d.content for d in deltas) or None
    return content, [(c.name, c.arguments_json) for c in assemble_tool_calls(deltas)]


def splits(text: str) -> list[list[str]]:
    """Every cut into two, one character at a time, and every cut into pieces of 2, 3 and 5."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    out += [[text[i : i + n] for i in range(0, len(text), n)] for n in (2, 3, 5)]
    return out
