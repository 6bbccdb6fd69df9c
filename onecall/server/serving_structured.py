"""Structured outputs in the server: one constraint per request, deferred past reasoning, compiled
before the request is queued.

    1. what the output must match, and the field that asked for it (named in every 400):
           response_format / structured_outputs    params.requested_structured_outputs
           tool_choice "required" or a function    tools/calling.ChatTools.enforced ("tools")
    2. with_reasoning: for a thinking template the grammar waits for the reasoning to end
       (StructuredOutputsParams' reasoning_start / reasoning_end, see sampling/grammar_constraint.py):

           the rendered prompt...           reasoning_start   reasoning_end   the grammar applies
           opened the block (<think>\\n)     -                 </think>        after </think>
           did not, <think> is one token    <think>           </think>        after </think>, or at once
                                                                              if the output skips the block
           did not, <think> is not a token  -                 -               at once (no block possible)

    3. compile_structured_outputs: llguidance compiles in a worker thread (thread-safe, bounded in time
       and size), never on the engine thread or the event loop; a schema, regex or grammar that does not
       compile, or is over a limit, is a 400 naming the field, with llguidance's message, before any
       token. The caller holds the CompiledGrammar until the request is queued, so the engine's
       add_request finds it (a weak pin) and never compiles on the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from onecall.engine.engine import Engine
from onecall.errors import InvalidParameterError
from onecall.sampling_params import StructuredOutputsParams
from onecall.text.reasoning import ReasoningFormat
from onecall.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from onecall.sampling.grammar import CompiledGrammar


def with_reasoning(
    so: StructuredOutputsParams,
    fmt: ReasoningFormat | None,
    *,
    starts_in_reasoning: bool,
    tokenizer: Tokenizer,
) -> StructuredOutputsParams:
    """`so` with the reasoning markers of a thinking template set as the table above says."""
    if fmt is None:
        return so
    if starts_in_reasoning:
        return dataclasses.replace(so, reasoning_start=None, reasoning_end=fmt.end)
    if is_one_token(tokenizer, fmt.start):
        return dataclasses.replace(so, reasoning_start=fmt.start, reasoning_end=fmt.end)
    return dataclasses.replace(so, reasoning_start=None, reasoning_end=None)


def is_one_token(tokenizer: Tokenizer, text: str) -> bool:
    return len(tokenizer.encode(text)) == 1


async def compile_structured_outputs(
    engine: Engine, so: StructuredOutputsParams, field: str
) -> CompiledGrammar:
    """Compile (or find in the cache) the grammar of `so` off the engine thread; a 400 naming
    `field` if it cannot be compiled. Hold the result until the request is queued: while it is held
    the engine finds it whatever the cache evicted, so add_request never compiles on the engine
    thread (sampling/grammar.py)."""
    try:
        compiled, _ = await asyncio.to_thread(engine.grammar.compile, so)
        return compiled
    except InvalidParameterError as e:
        if e.param.startswith(field):  # structured_outputs.<kind>: already the field's own name
            raise
        message = str(e).removeprefix(f"{e.param}: ")
        raise InvalidParameterError(field, message) from None
