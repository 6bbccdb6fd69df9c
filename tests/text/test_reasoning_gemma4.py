"""Gemma 4's reasoning blocks (`<|channel>thought\\n...<channel|>`, text/reasoning.py GEMMA4): chosen from
the real template, the prompt shapes its template renders (thinking on: the output opens the block; off:
the prompt ends with an empty closed block), the split whole and for every way of cutting the output, the
"thought" label, and what the server builds from it (ChoiceParser, and structured outputs deferred past
the block with `<|channel>` as the one-token start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from onecall.sampling_params import StructuredOutputsParams
from onecall.server.serving_structured import with_reasoning
from onecall.server.serving_tools import ChoiceParser
from onecall.text.chat_template import ChatTemplate
from onecall.text.reasoning import GEMMA4, THINK, ReasoningFormat, split_reasoning

DATA = Path(__file__).parent.parent / "data" / "chat_templates"
GEMMA4_TEMPLATE = (DATA / "google-gemma-4-31B-it-interleaved.jinja").read_text(encoding="utf-8")
HI = [{"role": "user", "content": "What is 2 + 2?"}]

# output -> (reasoning_content, content)
CASES = [
    ("<|channel>thought\nTwo and two.\n<channel|>The answer is 4.", ("Two and two.", "The answer is 4.")),
    ("<|channel>thought\nTwo and two.<channel|>\n\nFour.", ("Two and two.", "Four.")),
    ("\n<|channel>thought\nA\n\nB\n<channel|>Four.", ("A\n\nB", "Four.")),
    ("<|channel>thought<channel|>Four.", (None, "Four.")),  # an empty block
    ("<|channel>Just thinking.<channel|>Four.", ("Just thinking.", "Four.")),  # no label
    ("<|channel>thoughtful remark<channel|>Four.", ("thoughtful remark", "Four.")),  # not the label
    ("<|channel>thought\nstill thinking when max_tokens hit", ("still thinking when max_tokens hit", "")),
    ("<|channel>thought", (None, "")),  # cut right after the label
    ("<|channel>tho", ("tho", "")),  # cut inside what may have been the label
    ("The answer is 4.", (None, "The answer is 4.")),  # no block
    ("Four. <|channel>thought\nlater<channel|>", (None, "Four. <|channel>thought\nlater<channel|>")),
]


def test_the_real_templates_choose_their_format() -> None:
    assert ReasoningFormat.for_template(GEMMA4_TEMPLATE) == GEMMA4
    assert ReasoningFormat.for_template((DATA / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")) == THINK
    # gpt-oss writes <|channel|> (harmony, parsed elsewhere) and Gemma 3 no block at all
    for other in ("openai-gpt-oss-120b.jinja", "google-gemma-3.jinja"):
        assert ReasoningFormat.for_template((DATA / other).read_text(encoding="utf-8")) is None


@pytest.mark.parametrize(
    ("thinking", "ending"), [(True, "<|turn>model\n"), (False, "<|channel>thought\n<channel|>")]
)
def test_the_prompt_never_opens_the_block(thinking: bool, ending: str) -> None:
    """Thinking on, the model opens the block itself; off, the template closes an empty one."""
    text = ChatTemplate(GEMMA4_TEMPLATE, bos_token="<bos>", eos_token="<eos>").render(
        HI, add_generation_prompt=True, enable_thinking=thinking
    )
    assert text.endswith(ending)
    assert not GEMMA4.prompt_opens_reasoning(text)
    assert ("<|think|>" in text) is thinking


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split_whole_and_streamed(text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, fmt=GEMMA4) == expected
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        parser = GEMMA4.parser()
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        assert (reasoning or None, "".join(d.content for d in deltas)) == expected, pieces


def test_the_server_choice_parser_splits_gemma4_output() -> None:
    text = CASES[0][0]
    parsed = ChoiceParser(GEMMA4.parser(), None, max_calls=None).whole(text)
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == (*CASES[0][1], [])


class _OneTokenMarkers:
    """Only what with_reasoning asks of a tokenizer: `<|channel>` is one token (as in Gemma 4's vocabulary)."""

    def encode(self, text: str) -> list[int]:
        return [7] if text == "<|channel>" else list(text.encode())


def test_structured_outputs_wait_for_the_block_to_end() -> None:
    so = with_reasoning(
        StructuredOutputsParams(json_object=True),
        GEMMA4,
        starts_in_reasoning=False,
        tokenizer=_OneTokenMarkers(),  # type: ignore[arg-type]
    )
    assert (so.reasoning_start, so.reasoning_end) == ("<|channel>", "<channel|>")
