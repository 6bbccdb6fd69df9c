"""POST /v1/chat/completions: messages -> the model's template -> n engine requests -> a response or SSE.

1. parse and validate the body (400/413), check the engine (503) and the model (404)
2. prepare (prepare_chat): validate the tools and what the output must match (response_format,
   structured_outputs, or the enforced tool call: serving_tools.py), render the conversation with
   the model's own template in a worker thread (a long conversation must not stall the event loop),
   defer the grammar past a thinking template's reasoning and compile it off the engine thread
   (serving_structured.py); every mistake is a 400 naming its field, before any token
3. one SamplingParams per choice (server/params.py), then add all choices at once: the engine's
   typed errors (context length, queue full) are answered before any byte of a stream
4. stream: per choice a first chunk with the role, then deltas as tokens arrive (content, or with a
   thinking template or tools: reasoning_content, content and tool_calls from a ChoiceParser),
   exactly one finish_reason ("tool_calls" when the output ended with calls); usage (and the
   trace) in a last chunk with no choices when asked for
   not streaming: wait for every choice, cancelled if the client disconnects, then parse each

A gpt-oss model (text/harmony.py's speaks_harmony: <|channel|> a special token at o200k_harmony's
id) is rendered by openai-harmony instead of a template, its output parsed from token ids by a
HarmonyChoiceParser, and <|return|> and <|call|> stop it. A forced call (tool_choice "required" or
a named function) and structured outputs get a grammar over harmony's channels (an optional bounded
analysis message, then the call or the final answer: tools/harmony_grammar.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import ContextLengthExceededError, InvalidParameterError
from onecall.sampling_params import StructuredOutputsParams
from onecall.server.async_engine import AsyncEngine
from onecall.server.http_errors import HTTPError, http_error
from onecall.server.params import requested_structured_outputs, template_messages, to_sampling_params
from onecall.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    TokenLogprob,
    TopLogprob,
    Trace,
    Usage,
)
from onecall.server.serving_common import (
    Delta,
    Generation,
    cancel_on_disconnect,
    clamp_logprob,
    token_bytes,
    token_text,
)
from onecall.server.serving_structured import compile_structured_outputs, with_reasoning
from onecall.server.serving_tools import (
    AnyChoiceParser,
    ChoiceParser,
    HarmonyChoiceParser,
    chat_tools,
    markers_are_special,
)
from onecall.server.sse import DONE, SSEResponse, sse_event
from onecall.server.state import ServerState
from onecall.text.chat_template import RenderedPrompt, render_chat
from onecall.text.harmony import render_harmony, speaks_harmony, stop_token_ids
from onecall.text.reasoning import ReasoningFormat
from onecall.text.tokenizer import Tokenizer
from onecall.tools.calling import ChatTools
from onecall.tools.harmony_grammar import harmony_constraint


async def create_chat_completion(state: ServerState, request: Request, request_id: str) -> Response:
    # 1. request, engine, model
    req = await state.parse_body(request, ChatCompletionRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    # 2.-3. tools, render, structured outputs, params, add
    chat_id = f"chatcmpl-{request_id}"
    req, setup, gen = await start_chat(engine, req, chat_id, prompt_param="messages")
    gen.spans = state.request_spans(request, "chat", chat_id, stream=bool(req.stream), n=req.n)
    # 4. answer
    head = _Head(chat_id, int(time.time()), state.model_name)
    if req.stream:
        await gen.first_outputs(request)
        return SSEResponse(_chat_events(gen, req, head, tokenizer, setup), cleanup=gen.close)
    finals = await cancel_on_disconnect(request, gen.collect())
    response = ChatCompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[chat_choice(i, out, req, tokenizer, setup.new_parser()) for i, out in enumerate(finals)],
        usage=gen.usage(),
        trace=gen.trace() if req.trace else None,
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def start_chat(
    engine: AsyncEngine, req: ChatCompletionRequest, request_id: str, *, prompt_param: str
) -> tuple[ChatCompletionRequest, ChatSetup, Generation]:
    """A chat request queued: tools, the rendered prompt and structured outputs (prepare_chat), its
    params, its Generation. Returns the request as the params were made from it (the parsers'
    markers kept in the text when they are special tokens). A prompt longer than the window is a 400
    naming `prompt_param` (chat: messages; the Responses API: input)."""
    setup = await prepare_chat(engine.engine, req)
    if setup.keep_special_text:  # the parsers' markers are special tokens: keep them in the text
        req = req.model_copy(update={"skip_special_tokens": False})
    room = engine.engine.max_model_len - len(setup.rendered.token_ids)
    params = to_sampling_params(
        req, default_max_tokens=max(1, room), structured_outputs=setup.structured_outputs
    )
    if setup.stop_token_ids:  # harmony's <|return|> and <|call|>
        params = [
            dataclasses.replace(
                p,
                stop_token_ids=p.stop_token_ids
                + tuple(sorted(set(setup.stop_token_ids) - set(p.stop_token_ids))),
            )
            for p in params
        ]
    try:
        gen = await Generation.start(engine, request_id, setup.rendered, params)
    except ContextLengthExceededError as e:  # OpenAI names the messages, not a prompt, for chat
        raise HTTPError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
    return req, setup, gen


@dataclass(frozen=True)
class ChatSetup:
    """What is decided about a chat request before it is queued."""

    rendered: RenderedPrompt
    structured_outputs: StructuredOutputsParams | None  # compiled already (a cache hit at add_request)
    tools: ChatTools
    reasoning: ReasoningFormat | None  # the template thinks in these markers
    starts_in_reasoning: bool  # the prompt opened the reasoning block
    keep_special_text: bool
    grammar: object = None  # the CompiledGrammar, held until the request is queued (serving_structured)
    harmony: bool = False  # gpt-oss: rendered and parsed by openai-harmony (text/harmony.py)
    stop_token_ids: tuple[int, ...] = ()  # added to the request's own

    def new_parser(self) -> AnyChoiceParser | None:
        """A fresh parser for one choice; None when the text goes out as it is (no reasoning, no tools)."""
        if self.harmony:
            return HarmonyChoiceParser(max_calls=None if self.tools.parallel else 1)
        tools = self.tools.new_parser()
        if self.reasoning is None and tools is None:
            return None
        reasoning = (
            self.reasoning.parser(starts_in_reasoning=self.starts_in_reasoning) if self.reasoning else None
        )
        return ChoiceParser(reasoning, tools, max_calls=None if self.tools.parallel else 1)


async def prepare_chat(engine: Engine, req: ChatCompletionRequest) -> ChatSetup:
    tokenizer = engine.tokenizer
    # 1. the tools, and what the output must match (400s before anything is rendered)
    tools = chat_tools(req, tokenizer)
    asked = requested_structured_outputs(req)
    enforced = tools.enforced()
    if enforced is not None:
        # a forced call (tool_choice "required" or a named function) is the whole output: a
        # response_format governs text outside calls, and there is none (OpenAI accepts both; instructor's
        # Responses mode sends the same schema as the tool and as text.format)
        asked = None
    if speaks_harmony(tokenizer):
        return await _prepare_harmony(engine, req, tools, asked)
    # 2. render (tools through the template, or the json convention's system prompt)
    messages, template_tools = tools.template_inputs(template_messages(req.messages))
    rendered = await asyncio.to_thread(
        render_chat,
        tokenizer,
        messages,
        tools=template_tools,
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=req.chat_template_kwargs,
    )
    # 3. reasoning, the constraint deferred past it, compiled off the engine thread
    reasoning = ReasoningFormat.for_template(tokenizer.chat_template)
    opens = reasoning is not None and reasoning.prompt_opens_reasoning(rendered.text)
    so, field = asked if asked is not None else (enforced, "tools")
    if so is not None:
        so = with_reasoning(so, reasoning, starts_in_reasoning=opens, tokenizer=tokenizer)
    grammar = await compile_structured_outputs(engine, so, field) if so is not None else None
    keep_special = markers_are_special(tokenizer, tools, reasoning)
    return ChatSetup(rendered, so, tools, reasoning, opens, keep_special, grammar)


async def _prepare_harmony(
    engine: Engine,
    req: ChatCompletionRequest,
    tools: ChatTools,
    asked: tuple[StructuredOutputsParams, str] | None,
) -> ChatSetup:
    """A gpt-oss request: rendered by openai-harmony, parsed from its tokens, stopped at <|return|> or
    <|call|>. A forced call or structured outputs get a grammar over harmony's channels
    (tools/harmony_grammar.py), compiled off the engine thread like any other."""
    kwargs = req.chat_template_kwargs or {}
    effort = kwargs.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidParameterError(
            "chat_template_kwargs", "reasoning_effort must be 'low', 'medium' or 'high'"
        )
    rendered = await asyncio.to_thread(
        render_harmony, template_messages(req.messages), tools.tools, reasoning_effort=effort
    )
    room = max(1, engine.max_model_len - len(rendered.token_ids))
    constraint = harmony_constraint(tools, asked, req.max_completion_tokens or req.max_tokens or room)
    so, grammar = None, None
    if constraint is not None:
        so, field = constraint
        grammar = await compile_structured_outputs(engine, so, field)
    return ChatSetup(
        rendered, so, tools, None, False, False, grammar, harmony=True, stop_token_ids=stop_token_ids()
    )


def chat_choice(
    index: int,
    out: RequestOutput,
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    parser: AnyChoiceParser | None,
) -> ChatChoice:
    logprobs = _logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs) if req.logprobs else None
    if parser is None:
        message, finish_reason = ChatResponseMessage(content=out.text), out.finish_reason
    else:
        parsed = (
            parser.whole_tokens(out.token_ids)
            if isinstance(parser, HarmonyChoiceParser)
            else parser.whole(out.text)
        )
        message = ChatResponseMessage(
            content=parsed.content, reasoning_content=parsed.reasoning_content, tool_calls=parsed.tool_calls
        )
        finish_reason = parser.finish_reason(out.finish_reason)
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason)


class _Head:
    """What every chunk of one response repeats."""

    def __init__(self, id: str, created: int, model: str) -> None:
        self.id, self.created, self.model = id, created, model

    def chunk(
        self, choices: list[ChatChunkChoice], *, usage: Usage | None = None, trace: Trace | None = None
    ) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage, trace=trace
            )
        )


async def _chat_events(
    gen: Generation, req: ChatCompletionRequest, head: _Head, tokenizer: Tokenizer, setup: ChatSetup
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    parsers = [setup.new_parser() for _ in range(req.n)]
    # The role chunks go out with the first token's chunk, in one write: sent at once, they would have
    # the server serialize and the client parse them in the middle of the prefill, which on a small
    # CPU shares its cores with them (a measurable part of the HTTP layer's cost at concurrency 1).
    pending = b"".join(
        head.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(req.n)
    )
    try:
        async for d in gen.deltas():
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            delta, finish_reason = parsed_delta(parsers[d.index], d)
            logprobs = _delta_logprobs(tokenizer, d) if req.logprobs and d.token_ids else None
            if delta == ChatDelta() and finish_reason is None and logprobs is None:
                continue  # the parser holds the text back (a marker may be starting)
            choice = ChatChunkChoice(
                index=d.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
            )
            # the trace rides on the last chunk: this one, unless a usage chunk follows
            trace = gen.trace() if req.trace and d.is_last and not include_usage else None
            event, pending = pending + head.chunk([choice], trace=trace), b""
            yield event
        if pending:  # no token at all (e.g. aborted before the first one)
            event, pending = pending, b""
            yield event
        if include_usage:
            yield head.chunk([], usage=gen.usage(), trace=gen.trace() if req.trace else None)
    except Exception as e:  # after the 200 went out: the error is an event, then [DONE]
        yield pending + sse_event(http_error(e, head.id).body())
    finally:
        await gen.close()
    yield DONE


def parsed_delta(parser: AnyChoiceParser | None, d: Delta) -> tuple[ChatDelta, str | None]:
    """The delta of one engine output, and the choice's finish_reason if it ended."""
    if parser is None:
        return ChatDelta(content=d.text), d.finish_reason
    pieces = [
        parser.feed_tokens(d.token_ids) if isinstance(parser, HarmonyChoiceParser) else parser.feed(d.text)
    ]
    if d.finish_reason is not None:
        pieces.append(parser.finish())
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
    calls = [c for p in pieces for c in p.tool_calls]
    delta = ChatDelta(reasoning_content=reasoning or None, content=content or None, tool_calls=calls or None)
    return delta, parser.finish_reason(d.finish_reason)


def _delta_logprobs(tokenizer: Tokenizer, d: Delta) -> ChatChoiceLogprobs:
    return _logprobs(tokenizer, d.token_ids, d.logprobs, d.top_logprobs)


def _logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None] | None,
    top_logprobs: list[list[tuple[int, float]] | None] | None,
) -> ChatChoiceLogprobs:
    """OpenAI's chat format: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    content = []
    lps = logprobs or []
    tops = top_logprobs or []
    for k, tid in enumerate(token_ids):
        alternatives = tops[k] if k < len(tops) else None
        content.append(
            TokenLogprob(
                token=token_text(tokenizer, tid),
                logprob=clamp_logprob(lps[k] if k < len(lps) else None),
                bytes=token_bytes(tokenizer, tid),
                top_logprobs=[
                    TopLogprob(
                        token=token_text(tokenizer, t),
                        logprob=clamp_logprob(v),
                        bytes=token_bytes(tokenizer, t),
                    )
                    for t, v in alternatives or ()
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)
