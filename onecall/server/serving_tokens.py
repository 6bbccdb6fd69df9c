"""POST /tokenize and /detokenize, with vLLM's bodies.

/tokenize    {"prompt": str}     -> the ids a completion with that prompt would send (BOS
                                    included where the tokenizer adds one; add_special_tokens
                                    false leaves it out)
             {"messages": [...]} -> the ids a chat completion would send: the model's template,
                                    rendered exactly as /v1/chat/completions renders it
             answer {"tokens", "count", "max_model_len"}
/detokenize  {"tokens": [int]}   -> {"prompt": str} (control tokens kept, so ids round-trip)
GET /tokenizer_info              -> TokenizerInfoResponse: bos/eos, the chat template, the window:
                                    with /tokenize and /detokenize, what evaluation harnesses need to
                                    use the server's tokenizer instead of a local copy
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from onecall.errors import InvalidParameterError
from onecall.server.params import template_messages
from onecall.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from onecall.server.state import ServerState
from onecall.text.chat_template import render_chat


async def tokenize(state: ServerState, request: Request, request_id: str) -> Response:
    req = await state.parse_body(request, TokenizeRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidParameterError("prompt", "send exactly one of 'prompt' or 'messages'")
    if req.messages is not None:
        rendered = await asyncio.to_thread(
            render_chat,
            tokenizer,
            template_messages(req.messages),
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=req.chat_template_kwargs,
        )
        ids = rendered.token_ids
    else:
        assert req.prompt is not None
        add_special = req.add_special_tokens is not False
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special)
    body = TokenizeResponse(count=len(ids), max_model_len=engine.engine.max_model_len, tokens=ids)
    return Response(body.model_dump_json(), media_type="application/json")


async def detokenize(state: ServerState, request: Request, request_id: str) -> Response:
    req = await state.parse_body(request, DetokenizeRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidParameterError(
            "tokens", f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})"
        )
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)  # a long list: off the event loop
    body = DetokenizeResponse(prompt=text)
    return Response(body.model_dump_json(), media_type="application/json")


async def tokenizer_info(state: ServerState, request: Request, request_id: str) -> Response:
    engine = state.ready_engine()
    tokenizer = engine.engine.tokenizer
    body = TokenizerInfoResponse(
        tokenizer_class=engine.engine.parts.files.kind,
        vocab_size=tokenizer.vocab_size,
        model_max_length=engine.engine.max_model_len,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        add_bos_token=tokenizer.add_bos_token,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        chat_template=tokenizer.chat_template,
    )
    return Response(body.model_dump_json(), media_type="application/json")
