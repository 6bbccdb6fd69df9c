"""What chat and text completions share: one Generation of n choices, usage, logprob pieces.

A Generation is the n engine requests of one HTTP request (choice i is request `<id>-<i>`), added
all or nothing. Its outputs come back as Deltas, the n streams interleaved as tokens arrive:

    Delta.token_ids / logprobs      what this output added (from delta_token_ids and the output's
                                    snapshot of logprobs; RequestOutput.token_ids is the live list)
    Delta.is_last                   the final output of the last choice to finish

`trace()` is the engine's RequestTrace.to_dict() plus what only the tokenizer knows: `prompt_tokens`
(each prompt token decoded alone, special tokens keeping their text, so a viewer can draw the
prompt token by token) and, at a cache divergence, the two differing tokens as text. A divergence
read in the namespace tenants share (--shared-prefix-cache: tenants.SHARED_CACHE_SALT, which the
trace names by its hash) goes out with `cached_token` and `cached_token_text` null: the cached path
may be another tenant's prompt, and its next token is theirs. The index and the requester's own
`prompt_token` stay, as do the counts (`cached_tokens` is what sharing the cache means).

`close()` aborts every request still running (idempotent, a no-op for finished ones); each
consumer calls it in a `finally`, so a client that disconnects, a cancelled task or an error
mid-stream frees the KV blocks at once. The abort of each stream is queued before any await
(AsyncEngine's guarantee), so a second cancellation cannot skip one.

The OTLP hook (`onecall serve --otlp-traces-endpoint`): a route whose server exports traces sets
`Generation.spans` (ServerState.request_spans; None otherwise). The first close() then starts one
export task, off the response's path, which waits until every abort is confirmed (a disconnect
cancels the streaming task, and the close() in it, midway) and hands the trace dicts (trace_dicts(),
redacted exactly as trace()'s, without the per-token prompt texts; a choice abandoned after an output
keeps its trace), the usage and the close time to server/otel.py, whose batch processor sends them
from its own thread. Every route closes its Generation, streamed or not, finished or abandoned, so
every one of them is exported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from onecall.engine.engine import RequestOutput
from onecall.sampling_params import SamplingParams
from onecall.server.async_engine import AsyncEngine, Prompt, RequestStream
from onecall.server.otel import RequestSpans
from onecall.server.protocol import PromptTokensDetails, Trace, Usage
from onecall.server.tenants import SHARED_CACHE_SALT_SHA256
from onecall.text.tokenizer import Tokenizer

T = TypeVar("T")

logger = logging.getLogger("onecall.server")
_EXPORTS: set[asyncio.Task[None]] = set()  # span exports in flight (Generation._schedule_export)

# vLLM's floor for a logprob: JSON has no -inf.
MIN_LOGPROB = -9999.0


def random_id() -> str:
    return uuid.uuid4().hex


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready; nothing is sent."""


@dataclass
class Delta:
    index: int  # the choice
    output: RequestOutput
    token_ids: list[int]
    logprobs: list[float | None]  # for token_ids; empty unless logprobs were asked for
    top_logprobs: list[list[tuple[int, float]] | None]
    is_last: bool

    @property
    def text(self) -> str:
        return self.output.delta_text

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output.finished else None


class Generation:
    """The n engine requests behind one HTTP request."""

    def __init__(
        self, streams: list[RequestStream], tokenizer: Tokenizer | None = None, *, per_prompt: int = 0
    ) -> None:
        self.streams = streams
        self.tokenizer = tokenizer  # None: the trace goes out without token texts
        self.finals: list[RequestOutput | None] = [None] * len(streams)
        # consecutive streams that share one prompt (n or best_of); 0: all of them (one prompt)
        self.per_prompt = per_prompt or max(1, len(streams))
        self.spans: RequestSpans | None = None  # set by the route when the server exports traces
        self._exported = False
        self._latest: dict[int, RequestOutput] = {}  # choice -> its last output read

    @classmethod
    async def start(
        cls, engine: AsyncEngine, request_id: str, prompt: Prompt, params: list[SamplingParams]
    ) -> Generation:
        """Add the requests; the engine's typed errors (400, 429, 503) are raised here, before any token."""
        tokenizer = engine.engine.tokenizer
        if len(params) == 1:
            return cls([await engine.add_request(f"{request_id}-0", prompt, params[0])], tokenizer)
        items = [(f"{request_id}-{i}", prompt, p) for i, p in enumerate(params)]
        return cls(await engine.add_requests(items), tokenizer)

    async def deltas(self) -> AsyncIterator[Delta]:
        remaining = len(self.streams)
        async for index, out in _merged(self.streams):
            ids = list(out.delta_token_ids)
            lps = out.logprobs[len(out.logprobs) - len(ids) :] if out.logprobs is not None else []
            tops = (
                out.top_logprobs[len(out.top_logprobs) - len(ids) :] if out.top_logprobs is not None else []
            )
            self._latest[index] = out
            if out.finished:
                self.finals[index] = out
                remaining -= 1
            yield Delta(index, out, ids, lps, tops, is_last=out.finished and remaining == 0)

    async def first_outputs(self, request: Request) -> None:
        """Wait until every choice has its first output (the prefill is done), then return; abort
        everything if the client disconnects first.

        A streaming response starts after this: its 200, its headers and its first events then go
        out together instead of during the prefill, where on a small CPU the server's and the
        client's work on them shares the cores the prefill runs on (the HTTP layer's cost, README)."""
        try:
            await cancel_on_disconnect(request, asyncio.gather(*(s.ready() for s in self.streams)))
        except BaseException:
            await self.close()
            raise

    async def collect(self) -> list[RequestOutput]:
        """Run every choice to its end; the final outputs in choice order."""
        try:
            async for _ in self.deltas():
                pass
        finally:
            await self.close()
        finals = [f for f in self.finals if f is not None]
        assert len(finals) == len(self.streams), "every stream ends with a finished output"
        return finals

    async def close(self) -> None:
        cancelled: BaseException | None = None
        for stream in self.streams:
            try:
                await stream.abort()
            except asyncio.CancelledError as e:  # the abort is queued already; abort the others too
                cancelled = e
        self._schedule_export()
        if cancelled is not None:
            raise cancelled

    def _schedule_export(self) -> None:
        """Once: export the spans from a task of their own (the response goes out first)."""
        if self.spans is None or self._exported:
            return
        self._exported = True
        task = asyncio.get_running_loop().create_task(self._export(self.spans, time.perf_counter()))
        _EXPORTS.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(_EXPORTS.discard)

    async def _export(self, spans: RequestSpans, closed_at: float) -> None:
        # A close() cancelled mid-way (a disconnect cancels the streaming task's scope) had its aborts
        # queued but not confirmed; this task is outside that scope: wait for them, so the traces
        # are final (a no-op for finished streams).
        for stream in self.streams:
            with contextlib.suppress(Exception):
                await stream.abort()
        try:
            usage = self.usage() if any(f is not None for f in self.finals) else None
            spans.export(self.trace_dicts(prompt_texts=False, unfinished=True), usage, closed_at)
        except Exception:  # telemetry never fails a request; the log says why it is missing
            logger.exception("onecall: exporting the request's spans failed")

    def usage(self) -> Usage:
        """Each prompt counted once (its first finished choice's, as OpenAI does for n > 1),
        completion tokens summed over every finished choice."""
        prompt = cached = completion = 0
        for k in range(0, len(self.finals), self.per_prompt):
            done = [f for f in self.finals[k : k + self.per_prompt] if f is not None]
            if done:
                prompt += done[0].num_prompt_tokens
                cached += done[0].num_cached_tokens
            completion += sum(len(f.token_ids) for f in done)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def trace(self) -> Trace:
        """The engine trace: a dict for one choice, a list of dicts (choice order) for n > 1."""
        traces = [t for t in self.trace_dicts() if t is not None]
        return traces[0] if len(traces) == 1 else traces

    def trace_dicts(
        self, *, prompt_texts: bool = True, unfinished: bool = False
    ) -> list[dict[str, Any] | None]:
        """Each engine request's trace dict in order (None: not finished), with the divergence's
        tokens as text, and redacted (the module doc); `prompt_texts`: also each prompt token's text.
        `unfinished`, once closed: a choice abandoned after an output still has its trace (the
        engine's RequestTrace, final once close() has aborted it); None only without any output."""
        outputs = [f or (self._latest.get(i) if unfinished else None) for i, f in enumerate(self.finals)]
        traces = [out.trace.to_dict() if out is not None else None for out in outputs]
        decoded: dict[tuple[int, ...], list[str]] = {}  # choices share their prompt: decode it once
        for t in traces:
            if t is None:
                continue
            if self.tokenizer is not None:
                if prompt_texts:
                    ids = tuple(t["prompt_token_ids"])
                    if ids not in decoded:
                        decoded[ids] = [token_text(self.tokenizer, i) for i in ids]
                    t["prompt_tokens"] = list(decoded[ids])
                _add_divergence_texts(t, self.tokenizer)
            _hide_shared_cached_token(t)
        return traces


def _add_divergence_texts(trace: dict[str, Any], tokenizer: Tokenizer) -> None:
    """The divergence's two tokens as text."""
    divergence = trace.get("divergence")
    if divergence:  # a new dict beside the engine's fields, which keep their meaning
        trace["divergence"] = {
            **divergence,
            "prompt_token_text": token_text(tokenizer, divergence["prompt_token"]),
            "cached_token_text": token_text(tokenizer, divergence["cached_token"]),
        }


def _hide_shared_cached_token(trace: dict[str, Any]) -> None:
    """Null the cached side of a divergence read in the namespace tenants share (module doc)."""
    divergence = trace.get("divergence")
    if divergence and trace["sampling"].get("cache_salt_sha256") == SHARED_CACHE_SALT_SHA256:
        trace["divergence"] = {**divergence, "cached_token": None, "cached_token_text": None}


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:  # EngineDeadError: hand it to the reader
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientDisconnected).

    A non-streaming request would otherwise run to max_tokens for nobody; cancelling the work runs
    its `finally`, which aborts the engine requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- logprob pieces ----------------------------------------------------------------------------------
def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as text, from its own bytes: a SentencePiece "▁Paris" is " Paris" (decoding it alone
    would drop the space), a partial UTF-8 character comes out as U+FFFD (`token_bytes` has the bytes)."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    return list(tokenizer.token_bytes(token_id))


def clamp_logprob(value: float | None) -> float:
    return MIN_LOGPROB if value is None else max(value, MIN_LOGPROB)
