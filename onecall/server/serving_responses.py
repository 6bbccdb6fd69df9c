"""POST /v1/responses: the Responses API on the chat pipeline.

    input items + instructions  ->  a ChatCompletionRequest (to_chat_request)
                                ->  serving_chat's start_chat: the same render, params, Generation
    the chat choice             ->  output items: a `message` with its output_text, then one
                                    `function_call` item per tool call

Input items: messages (`role` user / system / developer / assistant; text content as a string or
input_text / output_text parts), earlier `function_call` items (replayed as the assistant's
tool_calls) and `function_call_output` items (tool messages). `text.format` (text / json_object /
json_schema) becomes response_format; function `tools` and `tool_choice` become chat's. The server is
stateless: `previous_response_id` and `background` are refused by name. `stream: true` sends the
Responses events (created, in_progress, output_text deltas and a tool call's argument fragments as
generated, the done events, then completed or incomplete with usage). Not yet: non-function tools,
non-text input parts (each refused by name).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from onecall.errors import InvalidParameterError
from onecall.server.http_errors import http_error
from onecall.server.protocol import ChatCompletionRequest
from onecall.server.protocol_responses import (
    FunctionCallItem,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from onecall.server.serving_chat import ChatSetup, chat_choice, parsed_delta, start_chat
from onecall.server.serving_common import Generation, cancel_on_disconnect
from onecall.server.sse import SSEResponse
from onecall.server.state import ServerState

_TEXT_PARTS = ("input_text", "output_text", "text")


async def create_response(state: ServerState, request: Request, request_id: str) -> Response:
    # 1. request: what a stateless server cannot do is refused by name
    req = await state.parse_body(request, ResponsesRequest)
    if req.previous_response_id is not None:
        raise InvalidParameterError(
            "previous_response_id",
            "is not supported: onecall keeps nothing between calls; send the whole conversation as input",
        )
    if req.background:
        raise InvalidParameterError("background", "is not supported")
    chat = to_chat_request(req)
    engine = state.ready_engine()
    state.check_model(chat.model)
    tokenizer = engine.engine.tokenizer
    # 2. the chat pipeline: tools, template, structured outputs, params, add
    response_id = f"resp_{request_id}"
    chat, setup, gen = await start_chat(engine, chat, response_id, prompt_param="input")
    gen.spans = state.request_spans(request, "chat", response_id, stream=bool(req.stream))
    # 3. the answer: events as the engine makes them, or the whole response
    head = _Head(response_id, f"msg_{request_id}", int(time.time()), state.model_name, req)
    if req.stream:
        await gen.first_outputs(request)
        return SSEResponse(_events(gen, head, setup), cleanup=gen.close)
    (final,) = await cancel_on_disconnect(request, gen.collect())
    choice = chat_choice(0, final, chat, tokenizer, setup.new_parser())
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    response = head.response(gen, choice.message.content or "", calls, choice.finish_reason)
    return Response(response.model_dump_json(), media_type="application/json")


class _Head:
    """What the response object repeats from the request, and how it is built at each stage."""

    def __init__(
        self, response_id: str, message_id: str, created: int, model: str, req: ResponsesRequest
    ) -> None:
        self.id, self.message_id, self.created, self.model, self.req = (
            response_id,
            message_id,
            created,
            model,
            req,
        )

    def response(
        self, gen: Generation | None, text: str, calls: list[tuple[str, str, str]], finish_reason: str | None
    ) -> ResponseObject:
        """The response: in progress (gen None), or final with its output items and usage."""
        incomplete = finish_reason == "length"
        status: Any = "in_progress" if gen is None else "incomplete" if incomplete else "completed"
        output: list[OutputMessage | FunctionCallItem] = []
        if text:
            output.append(OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)]))
        output += [
            FunctionCallItem(id=f"fc_{cid}", call_id=cid, name=name, arguments=args)
            for cid, name, args in calls
        ]
        req = self.req
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if gen is not None and incomplete else None,
            model=self.model,
            output=output,
            instructions=req.instructions,
            tools=req.tools or [],
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            max_output_tokens=req.max_output_tokens,
            text=req.text,
            metadata=req.metadata or {},
            usage=None if gen is None else _usage(gen),
            trace=gen.trace() if gen is not None and req.trace else None,
        )


def _usage(gen: Generation) -> ResponseUsage:
    usage = gen.usage()
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


async def _events(gen: Generation, head: _Head, setup: ChatSetup) -> AsyncGenerator[bytes, None]:
    """The Responses stream: created, in_progress; the message item's text deltas and each tool call's
    argument fragments as the engine makes them (a call's item opens once the parser has its id and
    name; under tool_choice auto the parser holds a call until it validates, so its arguments come
    in one piece); the done events; completed (with usage). Items are numbered in the order they
    open, and the final response lists its output in that order."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **fields})
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def dump(model: ResponseObject | OutputMessage | FunctionCallItem) -> Any:
        return json.loads(model.model_dump_json())

    def open_call(index: int) -> Iterator[bytes]:
        """Open call `index`'s item (id and name known) and send the arguments it has so far."""
        cid, name, args = calls[index]
        opened_calls[index] = [len(order), 0]
        order.append(f"fc_{cid}")
        item = FunctionCallItem(id=f"fc_{cid}", call_id=cid, name=name, arguments="", status="in_progress")
        yield event("response.output_item.added", output_index=opened_calls[index][0], item=dump(item))
        yield from send_arguments(index)

    def send_arguments(index: int) -> Iterator[bytes]:
        position, sent = opened_calls[index]
        cid, _, args = calls[index]
        if len(args) > sent:
            opened_calls[index][1] = len(args)
            ids = {"item_id": f"fc_{cid}", "output_index": position}
            yield event("response.function_call_arguments.delta", delta=args[sent:], **ids)

    parser = setup.new_parser()
    text, finish = "", None
    order: list[str] = []  # output item ids in the order their items opened
    calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments so far]
    opened_calls: dict[int, list[int]] = {}  # call index -> [output index, argument characters sent]
    part = {"type": "output_text", "text": "", "annotations": []}
    msg: dict[str, Any] = {"item_id": head.message_id, "content_index": 0}
    try:
        first = dump(head.response(None, "", [], None))
        yield event("response.created", response=first)
        yield event("response.in_progress", response=first)
        async for d in gen.deltas():
            delta, finish = parsed_delta(parser, d)
            if delta.content:
                if head.message_id not in order:  # the message item opens with its first text
                    msg["output_index"] = len(order)
                    order.append(head.message_id)
                    empty = OutputMessage(id=head.message_id, status="in_progress", content=[])
                    yield event(
                        "response.output_item.added", output_index=msg["output_index"], item=dump(empty)
                    )
                    yield event("response.content_part.added", part=part, **msg)
                text += delta.content
                yield event("response.output_text.delta", delta=delta.content, logprobs=[], **msg)
            for c in delta.tool_calls or ():  # a call's id and name first, its argument fragments after
                entry = calls.setdefault(c.index, ["", "", ""])
                if c.id:
                    entry[0] = c.id
                if c.function is not None:
                    entry[1] = c.function.name or entry[1]
                    entry[2] += c.function.arguments or ""
                if c.index in opened_calls:
                    for chunk in send_arguments(c.index):
                        yield chunk
                elif entry[0] and entry[1]:
                    for chunk in open_call(c.index):
                        yield chunk
        for index in sorted(calls):  # calls the stream never opened (no id or name until the end)
            if index not in opened_calls:
                for chunk in open_call(index):
                    yield chunk
        whole = [(cid, name, args) for cid, name, args in (calls[k] for k in sorted(calls))]
        final = head.response(gen, text, whole, finish)
        by_id = {item.id: item for item in final.output}
        final = final.model_copy(update={"output": [by_id[i] for i in order if i in by_id]})
        for position, item in enumerate(final.output):
            if isinstance(item, OutputMessage):
                yield event("response.output_text.done", text=text, logprobs=[], **msg)
                yield event("response.content_part.done", part={**part, "text": text}, **msg)
            else:
                ids = {"item_id": item.id, "output_index": position}
                yield event("response.function_call_arguments.done", arguments=item.arguments, **ids)
            yield event("response.output_item.done", output_index=position, item=dump(item))
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield event(kind, response=dump(final))
    except Exception as e:  # after the 200 went out: the error is an event
        error = http_error(e, head.id)
        yield event("error", message=str(e), code=error.status, param=None)
    finally:
        await gen.close()


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for; bad items are a 400 naming `input[i]`."""
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "trace": req.trace,
        "cache_salt": req.cache_salt,
    }
    if req.tools is not None:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if isinstance(req.tool_choice, dict):
        if req.tool_choice.get("type") != "function" or not isinstance(req.tool_choice.get("name"), str):
            raise InvalidParameterError(
                "tool_choice", "must be auto, none, required or {type: function, name}"
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    # through the wire path: the same strict validation (and 400s) as a chat request's body
    try:
        return ChatCompletionRequest.model_validate_json(
            json.dumps({k: v for k, v in chat.items() if v is not None})
        )
    except ValueError as e:
        raise InvalidParameterError("input", f"does not make a valid chat request: {e}") from None


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": req.instructions}] if req.instructions else []
    )
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidParameterError("input", "is empty: give a string or at least one item")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidParameterError(
                    f"input[{i}].role", f"must be user, system, developer or assistant, got {role!r}"
                )
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text(i, item.get("content"))}
            )
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"))):
                raise InvalidParameterError(f"input[{i}]", "a function_call needs call_id and name strings")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise InvalidParameterError(
                    f"input[{i}]", "a function_call_output needs call_id and output strings"
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise InvalidParameterError(
                f"input[{i}].type",
                f"{kind!r} is not supported; message, function_call and function_call_output are",
            )
    return messages


def _text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameterError(f"input[{i}].content", "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidParameterError(
                f"input[{i}].content[{j}]", f"{kind!r} is not supported; only text parts are"
            )
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidParameterError(
            f"tools[{i}].type", f"{tool.get('type')!r} is not supported; only function tools are"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidParameterError("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
