"""Reasoning separation: a model's `<think>...</think>` block -> reasoning_content, the rest -> content.

Templates that think (Qwen3, DeepSeek-R1 style) put the model's reasoning in a leading block:

    <think>\\nLet me see...\\n</think>\\n\\nThe answer is 4.
    reasoning_content = "Let me see..."   content = "The answer is 4."

Two formats, chosen per template by ReasoningFormat.for_template():

    format   markers                                   templates
    THINK    <think> ... </think>                      Qwen3, Qwen3.5, DeepSeek
    GEMMA4   <|channel>thought\\n ... <channel|>        Gemma 4 (enable_thinking; off, its generation
                                                       prompt ends with an empty closed block)

Gemma 4's start marker is one token, `<|channel>`, followed by the channel's name as text: the
format's `label` ("thought"), dropped from the reasoning when the output writes it right after the
marker. So `start` stays one token, which structured outputs need to defer past a block
(server/serving_structured.py with_reasoning).

Three prompt shapes reach the parser:

    prompt ends                              output starts           parser built with
    <|im_start|>assistant\\n                  "<think>..." or text    starts_in_reasoning=False
    <|im_start|>assistant\\n<think>\\n         inside the reasoning    starts_in_reasoning=True
    ...<think>\\n\\n</think>\\n\\n (no think)    the content             starts_in_reasoning=False

`ReasoningFormat.prompt_opens_reasoning(prompt_text)` tells the second shape from the others. Only a
block at the very start of the output (after whitespace) is reasoning; a `<think>` later in the text is
content. If `</think>` never comes (max_tokens hit while thinking) everything is reasoning.

Whitespace rules (the same whole-text and streamed): the reasoning is stripped at both ends, the content
after `</think>` loses its leading whitespace, and output with no think block is content unchanged.

The streaming parser is fed the detokenizer's deltas, whose boundaries fall anywhere, so a marker can
arrive split ("</th" + "ink>"). It holds back the longest suffix that could still become a marker, and
never emits part of one. Invariant: concatenating every delta it returns (feeds, then finish()) gives
exactly split_reasoning(whole text); split_reasoning is implemented by feeding the text in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StrippedStream:
    """Streams text out stripped at both ends, without knowing where the end is.

    Leading whitespace is dropped until the first other character; trailing whitespace is held back
    until more non-whitespace follows (then it goes out) or the stream ends (then it is dropped). So
    the concatenated output of push() calls is always `"".join(inputs).strip()`.
    """

    def __init__(self) -> None:
        self.is_started = False  # has any non-whitespace gone out
        self._held = ""  # trailing whitespace not yet known to be inner

    def push(self, text: str) -> str:
        """Take more text; return what can go out now."""
        if not self.is_started:
            text = text.lstrip()
            if not text:
                return ""
            self.is_started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


class ReasoningDelta(NamedTuple):
    """What one feed adds: reasoning text and content text (either may be "")."""

    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers that delimit a reasoning block."""

    start: str = "<think>"
    end: str = "</think>"
    label: str = ""  # text right after `start` that names the block, not part of the reasoning

    @classmethod
    def for_template(cls, chat_template: str | None) -> ReasoningFormat | None:
        """THINK for a template that writes `<think>...</think>` blocks (Qwen3), GEMMA4 for one that
        writes `<|channel>thought...<channel|>` (Gemma 4), else None (SmolLM2)."""
        if not chat_template:
            return None
        if THINK.start in chat_template and THINK.end in chat_template:
            return THINK
        if GEMMA4.start + GEMMA4.label in chat_template and GEMMA4.end in chat_template:
            return GEMMA4
        return None

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """Does the rendered prompt end inside an open block (so the output starts in the reasoning)?"""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def parser(self, *, starts_in_reasoning: bool = False) -> ReasoningParser:
        return ReasoningParser(self, starts_in_reasoning=starts_in_reasoning)


THINK = ReasoningFormat()
GEMMA4 = ReasoningFormat(start="<|channel>", end="<channel|>", label="thought")


class ReasoningParser:
    """Incremental splitter: feed(delta) -> ReasoningDelta, then finish() once.

    States:  PREAMBLE --output starts with <think>--> REASONING --</think>--> CONTENT
             PREAMBLE --anything else---------------> CONTENT (no reasoning; text passes unchanged)
    """

    _PREAMBLE, _REASONING, _CONTENT = "preamble", "reasoning", "content"

    def __init__(self, fmt: ReasoningFormat = THINK, *, starts_in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self._state = self._REASONING if starts_in_reasoning else self._PREAMBLE
        self._buf = ""  # undecided text: a possible marker prefix, or the preamble so far
        self._reasoning = StrippedStream()
        self._strip_content_start = False  # content after </think> loses its leading whitespace
        self._label_pending = False  # the output opened a block whose label may still follow
        self.saw_reasoning = False  # did a reasoning block start (emitted text or not)

    @property
    def is_in_content(self) -> bool:
        """True once the reasoning is over (or was never there): what follows is content."""
        return self._state == self._CONTENT

    def feed(self, delta: str) -> ReasoningDelta:
        self._buf += delta
        reasoning = content = ""
        if self._state == self._PREAMBLE:
            self._decide_preamble()
        if self._state == self._REASONING:
            reasoning = self._advance_reasoning()
        if self._state == self._CONTENT:
            content = self._content(self._buf)
            self._buf = ""
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """End of output: what was held back goes out as what it is (an unfinished marker is text)."""
        if self._state == self._REASONING and self._label_pending:
            self._drop_label(at_end=True)
        text, self._buf = self._buf, ""
        if self._state == self._REASONING:
            return ReasoningDelta(self._reasoning.push(text), "")
        return ReasoningDelta("", self._content(text))

    def _decide_preamble(self) -> None:
        """PREAMBLE -> REASONING if the output opens with the start marker, CONTENT once it cannot."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.fmt.start):
            self._state = self._REASONING
            self._buf = stripped[len(self.fmt.start) :]
            self._label_pending = bool(self.fmt.label)
        elif not self.fmt.start.startswith(stripped):  # "" (whitespace only) still may open a block
            self._state = self._CONTENT

    def _advance_reasoning(self) -> str:
        """Emit reasoning up to `</think>` (then switch to CONTENT) or up to a possible partial marker."""
        self.saw_reasoning = True
        if self._label_pending and not self._drop_label(at_end=False):
            return ""
        end = self._buf.find(self.fmt.end)
        if end >= 0:
            out = self._reasoning.push(self._buf[:end])  # its held trailing whitespace is dropped
            self._buf = self._buf[end + len(self.fmt.end) :]
            self._state, self._strip_content_start = self._CONTENT, True
            return out
        keep = partial_marker_len(self._buf, self.fmt.end)
        out = self._reasoning.push(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return out

    def _drop_label(self, *, at_end: bool) -> bool:
        """Drop the block's label ("thought") from the start of the buffer when it is the whole word
        (whitespace or the end marker follows); False while that cannot be decided yet."""
        label, buf = self.fmt.label, self._buf
        rest = buf[len(label) :] if buf.startswith(label) else None
        if rest is not None and (
            rest[:1].isspace() or rest.startswith(self.fmt.end) or (at_end and not rest)
        ):
            self._buf = rest
        elif not at_end and (label.startswith(buf) or (rest is not None and self.fmt.end.startswith(rest))):
            return False  # "tho", "thought", "thought<chan": not decided yet
        self._label_pending = False
        return True

    def _content(self, text: str) -> str:
        if self._strip_content_start:
            text = text.lstrip()
            self._strip_content_start = not text  # still only whitespace: keep stripping
        return text


def split_reasoning(
    text: str, *, starts_in_reasoning: bool = False, fmt: ReasoningFormat = THINK
) -> tuple[str | None, str]:
    """Whole output -> (reasoning_content or None when there is none, content)."""
    parser = ReasoningParser(fmt, starts_in_reasoning=starts_in_reasoning)
    parts = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    return (reasoning or None), "".join(p.content for p in parts)
