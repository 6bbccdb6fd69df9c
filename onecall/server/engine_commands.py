"""The commands the event loop sends the engine thread (server/async_engine.py -> engine_loop.py),
and what the thread needs of a stream to answer. Each command carries the future its caller awaits:

    command                  what the engine thread does with it                  answered by
    Add(requests, streams)   engine.add_request for each, all or nothing;         its future: None,
                             max_waiting checked first; then the streams are      or the typed error
                             registered, so outputs reach them
    Abort(request_id)        engine.abort: KV blocks freed; the stream ends       its future
    ResetPrefixCache()       engine.reset_prefix_cache between steps              its future
    Shutdown()               abort every open request, end the thread             (the thread join)

Once the engine is dead every command taken or queued is answered: adds and resets with
EngineDeadError, aborts with None (nothing runs any more). While the engine is rebuilt in place
(engine_loop.py's supervisor) commands still queue: they are handled on the fresh engine; the
requests in flight then get EngineRestartingError (onecall/errors.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from onecall.engine.engine import RequestOutput
from onecall.sampling.types import TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import RenderedPrompt

Prompt = str | list[int] | RenderedPrompt
Item = RequestOutput | BaseException  # what a stream receives: outputs, then maybe an error


class StreamSink(Protocol):
    """What the engine thread needs of a stream (RequestStream): its id, and a way to hand it an item
    on the event loop."""

    request_id: str

    def _deliver(self, item: Item) -> None: ...


@dataclass
class NewRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    constraint: TokenConstraint | None
    arrival_time: float


@dataclass
class Add:
    requests: list[NewRequest]
    streams: list[StreamSink]
    future: Future[None] = field(default_factory=Future)


@dataclass
class Abort:
    request_id: str
    future: Future[None] = field(default_factory=Future)


@dataclass
class ResetPrefixCache:
    future: Future[None] = field(default_factory=Future)


@dataclass
class Shutdown:
    pass


Command = Add | Abort | ResetPrefixCache | Shutdown
