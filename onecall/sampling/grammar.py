"""Structured outputs on llguidance: one tokenizer per model, compiled grammars cached, a matcher per request.

    StructuredOutputsParams --grammar_text()--> llguidance grammar text (the cache key)
        --compile, bounded--> a pristine LLMatcher (cached, LRU)
        --deep_copy--> GrammarConstraint, one per request (grammar_constraint.py)

The llguidance tokenizer (every id's bytes, the special ids, EOS) is built once
per model, on first use (about 0.6 s for a 49,152-token vocabulary). `compile`
is thread-safe, so a server can warm the cache off the engine thread; the
engine's add_request then only pays a cache hit and a deep copy of the matcher.

Compilation is bounded, so no request can stall or crash the process:
  1. the grammar text is capped (max_grammar_bytes) before llguidance sees it;
  2. llguidance's own limits (LLParserLimits: lexer fuel, grammar size, Earley
     items per step) turn an over-limit grammar into a compile error;
  3. llguidance builds a grammar recursively, one stack frame per nesting
     level of rules or $refs: a chain of 3,000 rules overflowed the default
     8 MiB thread stack (a segfault, llguidance 1.9.1). Compiles run in a thread
     with a 256 MiB stack (virtual: only touched pages cost memory), which held
     chains of 30,000 rules, more than max_grammar_bytes allows;
  4. a compile that outlives compile_timeout_s is refused at once (its thread
     finishes in the background; a caller is never kept waiting longer), and
     the refusal is remembered for timeout_memory_s, so the same grammar sent
     again meanwhile starts no second thread; after that it is tried again (it
     may only have been slow on a busy machine);
  5. at most max_compile_threads compile threads exist at once, running or timed out
     (each holds a slot until its thread ends): a compile waits up to compile_timeout_s
     for a slot, then is refused (GrammarBusyError, a 429).
Every refusal but the last is an InvalidParameterError naming "structured_outputs.<kind>".

Compiling never has to happen on the engine thread. The server compiles off it and holds
the CompiledGrammar it gets until the request is queued; while anyone holds one it stays
findable by its text (a weak pin), whatever the LRU cache has evicted meanwhile, so the
engine's add_request finds it and only deep-copies. compile() also takes a grammar already
compiled for a later variant of the same request (a schema as written, after its closed
form) without compiling the earlier one again.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from onecall.errors import InvalidParameterError, QueueFullError
from onecall.sampling.grammar_constraint import GrammarConstraint, GrammarTrace
from onecall.sampling.json_schema import close_objects
from onecall.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from onecall.text.tokenizer import Tokenizer

# JSON is generated compact with one space after ',' and ':' (as json.dumps writes it): free
# whitespace lets a small model pad forever ("{\n\n\n  ..."); a schema's "x-guidance" overrides it.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on compiling a grammar (see the module docstring); llguidance's own defaults kept."""

    max_grammar_bytes: int = 256 * 1024
    compile_timeout_s: float = 10.0
    compile_stack_bytes: int = 256 * 1024 * 1024
    cache_size: int = 256
    max_compile_threads: int = 4  # compile threads alive at once, timed-out ones included
    timeout_memory_s: float = 60.0  # how long a timed-out grammar is refused without a new compile
    # llguidance.LLParserLimits, at llguidance's defaults
    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
        )


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar in its start state; every request gets a deep copy of `matcher`."""

    kind: str
    text: str  # llguidance's grammar text: the cache key
    matcher: llguidance.LLMatcher
    compile_time: float  # seconds the compile took when it ran


def grammar_texts(so: StructuredOutputsParams) -> list[str]:
    """The llguidance grammar for `so`, to try in order: for a JSON schema with objects closed
    (json_schema.py) and, if closing changed it, as written (cheap: serialization only)."""
    if so.kind != "json" or so.allow_additional_properties:
        return [grammar_text(so)]
    closed, as_written = grammar_text(so, close=True), grammar_text(so)
    return [closed] if closed == as_written else [closed, as_written]


def grammar_text(so: StructuredOutputsParams, *, close: bool = False) -> str:
    """The llguidance grammar for `so`, nothing checked yet; `close`: a JSON schema's objects closed."""
    m = llguidance.LLMatcher
    if so.kind in ("json", "json_object"):
        schema = so.json_schema if so.kind == "json" else {"type": "object"}
        if close:
            schema = close_objects(schema)
        try:
            return m.grammar_from_json_schema(schema or {}, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        except ValueError as e:
            raise InvalidParameterError(f"structured_outputs.{so.kind}", str(e)) from e
    if so.kind == "regex":
        return m.grammar_from_regex(so.regex or "")
    if so.kind == "choice":  # each choice a Lark string literal (JSON's string escapes are Lark's)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice or ()))
    return m.grammar_from_lark(so.grammar or "")


class GrammarBackend:
    """llguidance for one model's tokenizer: builds the llguidance tokenizer lazily, compiles and caches."""

    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self._parser_limits = self.limits.parser_limits()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # guards the lazy tokenizer and the cache
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()  # text -> grammar or error
        # text -> a compiled grammar someone still holds (the server, until the request is queued)
        self._pinned: weakref.WeakValueDictionary[str, CompiledGrammar] = weakref.WeakValueDictionary()
        self._slots = threading.BoundedSemaphore(self.limits.max_compile_threads)  # one per compile thread
        self.num_compile_threads = 0  # alive now (running, or timed out and still running)
        self._timed_out: dict[str, tuple[str, float]] = {}  # text -> (refusal, monotonic time it expires)
        self.num_compiles = 0  # compiles actually run (cache misses that reached llguidance)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_ll_tokenizer(self.tokenizer)
            return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams) -> tuple[CompiledGrammar, bool]:
        """(compiled grammar, cache hit). Thread-safe; raises InvalidParameterError if it cannot compile
        (with the error of the schema as written, when a closed variant was tried first)."""
        param = f"structured_outputs.{so.kind}"
        texts = grammar_texts(so)
        for text in texts:  # a variant compiled already wins over compiling an earlier one
            found = self._lookup(text)
            if isinstance(found, CompiledGrammar):
                return found, True
        error: InvalidParameterError | None = None
        for text in texts:
            try:
                return self._compile_text(so.kind, text, param)
            except InvalidParameterError as e:
                error = e
        assert error is not None
        raise error

    def _compile_text(self, kind: str, text: str, param: str) -> tuple[CompiledGrammar, bool]:
        if len(text) > self.limits.max_grammar_bytes:
            raise InvalidParameterError(
                param,
                f"is too large: {len(text):,} bytes as a grammar (limit {self.limits.max_grammar_bytes:,})",
            )
        tokenizer = self.ll_tokenizer
        cached = self._lookup(text)
        if cached is None:
            compiled = self._compile_bounded(kind, text, tokenizer, param)
            if isinstance(compiled, _TimedOut):
                with self._lock:
                    self._timed_out[text] = (compiled.message, time.monotonic() + self.limits.timeout_memory_s)
                raise InvalidParameterError(param, compiled.message)
            with self._lock:
                # a grammar compiled meanwhile by another thread wins: its holders keep finding it
                cached = self._pinned.get(text) or compiled
                self._cache[text] = cached
                if isinstance(cached, CompiledGrammar):
                    self._pinned[text] = cached
                while len(self._cache) > self.limits.cache_size:
                    self._cache.popitem(last=False)
            hit = False
        else:
            hit = True
        if isinstance(cached, str):
            raise InvalidParameterError(param, cached)
        return cached, hit

    def _lookup(self, text: str) -> CompiledGrammar | str | None:
        """The cached grammar (or error) for `text`, refreshed in the LRU; else one still pinned."""
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                return cached
            refused = self._timed_out.get(text)
            if refused is not None:
                if time.monotonic() < refused[1]:
                    return refused[0]
                del self._timed_out[text]
            return self._pinned.get(text)

    def new_constraint(self, so: StructuredOutputsParams) -> GrammarConstraint:
        """A fresh per-request matcher for `so` (compiled or from the cache), with its GrammarTrace."""
        vocab_size = self.ll_tokenizer.vocab_size  # built once per model, outside the compile time
        start_id = None
        if so.reasoning_start is not None:
            ids = self.tokenizer.encode_continuation(so.reasoning_start)
            if len(ids) != 1:
                raise InvalidParameterError(
                    "structured_outputs.reasoning_start",
                    f"must be one token of this model's vocabulary; {so.reasoning_start!r} is {len(ids)}",
                )
            start_id = ids[0]
        compiled, hit = self.compile(so)
        # compile_time is the compile's own duration even on a cache hit: the server compiles a
        # request's grammar off the engine thread just before admission, so the hit is the norm there.
        trace = GrammarTrace(so.kind, compiled.compile_time, hit, so.reasoning_start, so.reasoning_end)
        return GrammarConstraint(
            compiled.matcher.deep_copy(), vocab_size, self.tokenizer.token_bytes, trace, start_id
        )

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _compile_bounded(
        self, kind: str, text: str, tokenizer: llguidance.LLTokenizer, param: str
    ) -> CompiledGrammar | str | _TimedOut:
        """Compile in a big-stack thread under a timeout. Returns the grammar, or llguidance's error text
        (cached like a grammar: the same bad schema is refused again without recompiling), or _TimedOut."""
        if not self._slots.acquire(timeout=self.limits.compile_timeout_s):
            raise GrammarBusyError(self.limits.max_compile_threads)
        box: dict[str, Any] = {}

        def work() -> None:
            t0 = time.perf_counter()
            try:
                box["matcher"] = llguidance.LLMatcher(
                    tokenizer, text, log_level=0, limits=self._parser_limits
                )
            except Exception as e:  # llguidance reports grammar errors on the matcher; this is the API's
                box["error"] = f"{kind} could not be compiled: {e}"
            finally:
                box["seconds"] = time.perf_counter() - t0
                with self._lock:
                    self.num_compile_threads -= 1
                self._slots.release()  # the slot goes with the thread, however late it ends

        # stack_size() applies to threads started after it: set, start, restore.
        with self._lock:
            self.num_compile_threads += 1
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(self.limits.compile_stack_bytes)
            try:
                thread = threading.Thread(target=work, name="onecall-grammar-compile", daemon=True)
                thread.start()
            except BaseException:
                with self._lock:
                    self.num_compile_threads -= 1
                self._slots.release()
                raise
            finally:
                threading.stack_size(previous)
        thread.join(self.limits.compile_timeout_s)
        with self._lock:
            self.num_compiles += 1
            if thread.is_alive():  # it runs on in the background, holding its slot
                return _TimedOut(f"{kind} took longer than {self.limits.compile_timeout_s:g} s to compile; simplify it")
        matcher = box.get("matcher")
        if matcher is None:
            return _short(box["error"])
        if matcher.is_error():
            return _short(matcher.get_error())
        return CompiledGrammar(kind, text, matcher, box["seconds"])


@dataclass(frozen=True)
class _TimedOut:
    message: str


class GrammarBusyError(QueueFullError):
    """Every compile slot stayed taken (compiles running, or timed out and still running): retry later
    (a 429)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, num_slots)
        self.args = (f"the grammar compiler is busy: all {num_slots} compile slots are taken; retry later",)


_STACK_SIZE_LOCK = threading.Lock()


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."


class _TokenizerView:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads: every id's bytes, EOS/BOS, special ids."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [_token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes once; text is what we encode
            raise TypeError("encode takes str")
        # text the grammar forces mid-output: no SentencePiece space prefix ("{" is "{", not "▁{")
        return self._tokenizer.encode_continuation(text)


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    try:
        return tokenizer.token_bytes(token_id)
    except InvalidParameterError:  # a hole in the vocabulary: no bytes, never allowed
        return b""


def _build_ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise InvalidParameterError(
            "structured_outputs", "this model's tokenizer names no EOS token, so a grammar could never end"
        )
    wrapper = llguidance.TokenizerWrapper(_TokenizerView(tokenizer, eos[0]))
    return llguidance.LLTokenizer(wrapper, eos_token=eos)
