"""Engine: add_request() / step() / abort(), the one loop every entry point drives.

    request -> token ids -> add_request -> step(): schedule -> run model -> sample
            -> postprocess (append, detokenize, stop checks, prefix-cache insert, free)
            -> RequestOutputs (text deltas + trace)

The LLM facade, the CLI, the server and the lab all call `step()` in a loop;
nothing else advances a request. Loading (files -> model + tokenizer + KV pool)
lives in engine/engine_parts.py; this module is the loop.

Faults. A step that raises after scheduling (in the grammar, the model forward, the
sampler or the detokenizer) fails only the requests of its batch:

    each request of the batch   finished output, finish_reason "error", `error` an
                                EngineStepError naming the stage and the cause
    its KV blocks               freed; nothing of it enters the prefix cache (the forward
                                may have written half its KV), pending slot copies dropped
    the engine                  serves on; requests outside the batch never notice

If the step right after such a recovery fails too, or the bookkeeping does not add up
after it, step() raises EngineDeadError, and does on every later call: a fault that
repeats is not the requests' fault, and state that drifted cannot be trusted. Under tensor
parallel, a rank that dies (or a step that fails while the ranks run it) raises
TensorParallelError, an EngineDeadError, at once: the ranks are out of step, nothing is
recovered (engine/tp_workers.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import torch

from onecall.config import EngineConfig
from onecall.engine.block_manager import BlockManager
from onecall.engine.decode_graphs import BUCKETS, DecodeGraphs
from onecall.engine.engine_parts import LoadedEngineParts, load_engine_parts
from onecall.engine.model_runner import ModelRunner, PromptLogprobs
from onecall.engine.postprocess import postprocess_token
from onecall.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from onecall.engine.sequence import FinishReason, Sequence, TextState
from onecall.engine.trace import RequestTrace, StepRecord
from onecall.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineStepError,
    InvalidParameterError,
)
from onecall.model.attention import default_backend
from onecall.sampling.mask_prefetch import MaskPrefetcher
from onecall.sampling.sampler import sample
from onecall.sampling.types import SampleResult, SamplingRequest, TokenConstraint
from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import RenderedPrompt
from onecall.text.detokenizer import IncrementalDetokenizer
from onecall.text.stop import StopStringMatcher

if TYPE_CHECKING:
    from onecall.sampling.grammar import GrammarBackend


@dataclass
class RequestOutput:
    """What a request produced so far. `text`/`token_ids` are cumulative; `delta_*` is this step's.

    `token_ids`, `logprobs` and `top_logprobs` are snapshots taken lazily: the output keeps a
    reference to the sequence's append-only lists and how long they were at this step, so making an
    output costs O(1) per token, and reading it later still gives this step's view.

    `prompt_logprobs` / `prompt_top_logprobs` (SamplingParams.prompt_logprobs): one entry per prompt
    token, the first None, on every output once the whole prompt is computed (None before, and
    when not asked for). `cumulative_logprob`: the sum of `logprobs` (None when not asked for).
    """

    request_id: str
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    trace: RequestTrace
    _all_token_ids: list[int] = field(repr=False)  # prompt + output, append-only
    _num_tokens: int = field(repr=False)  # its length at this step
    _logprobs: list[float | None] | None = field(default=None, repr=False)  # when asked for
    _top_logprobs: list[list[tuple[int, float]] | None] | None = field(default=None, repr=False)
    error: EngineStepError | None = None  # finish_reason "error": the step that ran it raised
    prompt_logprobs: list[float | None] | None = None  # complete lists only; never appended to
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    cumulative_logprob: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self._all_token_ids[self.num_prompt_tokens : self._num_tokens]

    @property
    def logprobs(self) -> list[float | None] | None:
        """Per output token, when asked for (SamplingParams.logprobs)."""
        n = self._num_tokens - self.num_prompt_tokens
        return None if self._logprobs is None else self._logprobs[:n]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        n = self._num_tokens - self.num_prompt_tokens
        return None if self._top_logprobs is None else self._top_logprobs[:n]


@dataclass
class EngineStats:
    """Counters for metrics; monotonically increasing totals plus current gauges."""

    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_prefix_cache_query_tokens_total: int = 0
    num_prefix_cache_hit_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, parts: LoadedEngineParts | None = None) -> None:
        self.config = config or EngineConfig()
        self.parts = parts or load_engine_parts(self.config)
        p = self.parts
        self.tokenizer = p.tokenizer
        self.model_config = p.model_config
        self.device = p.device
        self.max_model_len = p.max_model_len
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._step_counter = 0
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()  # a server may reach `grammar` from another thread
        self._masks = MaskPrefetcher(self.model_config.vocab_size)
        self._stage = ""  # the phase of the step now running, to name it if it raises
        self._last_fault: EngineStepError | None = None  # set by a recovered step, cleared by a good one
        self.dead_reason: str | None = None  # set once the engine refuses to go on (see the docstring)
        backend = default_backend(self.device, self.config.kernels)
        if self.config.cuda_graphs and backend == "triton" and p.tp_group is None:  # fast kernels, CUDA
            self.enable_static_decode(capture=self.device.type == "cuda", backend=backend)
        else:
            self._build_runner(backend, p.num_blocks)

    def _build_runner(self, backend: str, num_blocks: int) -> None:
        p = self.parts
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.runner = ModelRunner(
            p.model, p.kv_cache, self.block_manager, self.device, backend, tp_group=p.tp_group
        )
        if backend == "triton" and self.config.kernels == "fast":
            from onecall.model import triton_ops  # Triton loads only with its backend (CUDA)

            triton_ops.install(p.model)  # norms, RoPE + K/V writes, SiLU: one kernel each

    def enable_static_decode(self, capture: bool, backend: str | None = None) -> None:
        """Run pure-decode steps on static, bucketed buffers (engine/decode_graphs.py), captured as
        CUDA graphs when `capture` (CUDA only). The pool's last block becomes the padding rows'
        scratch block, so the block manager is rebuilt one block smaller: call it before any request.
        `backend` overrides the attention backend (tests run "triton" on CPU under the interpreter)."""
        assert not self._seqs, "enable_static_decode() before any request"
        assert self.parts.tp_group is None, "static decode steps run in one process, not under TP"
        p = self.parts
        backend = backend or self.runner.attention_backend  # the constructor passes its own
        assert backend == "triton", "static decode steps need the Triton backend (metadata as tensors only)"
        self._build_runner(backend, p.num_blocks - 1)
        self.runner.decode_graphs = DecodeGraphs(
            model=p.model,
            kv_cache=p.kv_cache,
            max_bucket=min(self.config.max_num_seqs, BUCKETS[-1]),
            max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
            scratch_block=p.num_blocks - 1,
            backend=backend,
            capture=capture,
        )

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit); a no-op otherwise."""
        if self.parts.tp_group is not None:
            self.parts.tp_group.close()

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-outputs backend (llguidance), built on first use and kept for the model.
        Its compile() is thread-safe: a server may warm the grammar cache off the engine thread."""
        with self._grammar_lock:
            if self._grammar is None:
                from onecall.sampling.grammar import GrammarBackend  # llguidance loads only when used

                self._grammar = GrammarBackend(self.tokenizer)
            return self._grammar

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | RenderedPrompt,
        params: SamplingParams | None = None,
        *,
        constraint: TokenConstraint | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next step. Validates everything a
        caller can get wrong (typed errors, a bad structured_outputs grammar included), so a bad
        request never reaches the step loop. `constraint` (any TokenConstraint) overrides the grammar."""
        params = params or SamplingParams()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._seqs:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        params.validate_vocab(self.tokenizer.vocab_size)
        trace = RequestTrace(request_id=request_id, arrival_time=arrival_time or time.perf_counter())
        ids = self._prompt_ids(prompt, trace)
        self._check_length(len(ids), params.max_tokens)
        if constraint is None and params.structured_outputs is not None:
            grammar = self.grammar.new_constraint(params.structured_outputs)
            trace.record_grammar(grammar.trace)
            constraint = grammar
        trace.record_request(
            params.trace_dict(), str(self.device), str(self.parts.dtype), self.parts.model_name
        )
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed % 2**64)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_total_tokens=self.max_model_len,
            trace=trace,
            generator=gen,
            constraint=constraint,
        )
        seq.text_state = TextState(
            # the prompt's last ids as context: a SentencePiece output's first token keeps its space
            IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, context=ids
            ),
            StopStringMatcher(params.stop) if params.stop else None,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def prompt_token_ids(self, prompt: str | list[int] | RenderedPrompt) -> list[int]:
        """The token ids this engine runs for `prompt` (a str gets the tokenizer's BOS, if any);
        InvalidParameterError for an empty prompt, ids outside the vocabulary, or another type."""
        if isinstance(prompt, RenderedPrompt):
            ids = list(prompt.token_ids)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise InvalidParameterError(
                    "prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.tokenizer.vocab_size})"
                )
        else:
            raise InvalidParameterError(
                "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidParameterError("prompt", "is empty: at least one token is needed")
        return ids

    def _prompt_ids(self, prompt: str | list[int] | RenderedPrompt, trace: RequestTrace) -> list[int]:
        ids = self.prompt_token_ids(prompt)
        special = self.tokenizer.special_ids
        if isinstance(prompt, RenderedPrompt):
            trace.record_prompt(ids, prompt.text, list(prompt.is_control))
        else:
            trace.record_prompt(ids, prompt if isinstance(prompt, str) else None, [i in special for i in ids])
        return ids

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len or (
            max_tokens > 0 and num_prompt_tokens == self.max_model_len
        ):
            raise ContextLengthExceededError(num_prompt_tokens, self.max_model_len)
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(num_prompt_tokens, self.max_model_len, max_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request now: its KV blocks are freed before this returns."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        seq.trace.record_finish(FinishReason.ABORT.value, time.perf_counter())
        return self._output(seq, "", [])

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache (its blocks go back to the pool once no request holds them)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, postprocess. Returns outputs of requests that
        produced a token or finished in this step. A step that raises fails only its batch (their
        outputs carry `error`); EngineDeadError when it cannot go on (see the module docstring)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self._step_counter += 1
        self.stats.num_steps_total += 1
        self.stats.num_preemptions_total += len(sched.preempted)
        t0 = time.perf_counter()
        self._note_first_schedule(sched, t0)
        try:
            outputs = self._run_step(sched, t0)
        except EngineDeadError as e:  # a tensor-parallel rank died: nothing to recover (tp_workers.py)
            self.dead_reason = str(e)
            raise
        except Exception as e:
            return self._recover(sched, self._step_error(e))
        self._last_fault = None
        return outputs

    def _run_step(self, sched: SchedulerOutput, t0: float) -> list[RequestOutput]:
        self._stage = "grammar"  # the masks start filling on the worker
        sampling = [s for s in sched.scheduled if s.samples]
        prefetched = self._prefetch_masks(sampling)
        self._stage = "model forward"
        ran = self.runner.execute(sched.scheduled)
        logits = ran.logits
        result = None
        if sampling:  # the logits are this step's own (inference) tensor: masked rows edited in place
            self._stage = "sampler"
            requests = [self._sampling_request(s.seq, prefetched.get(s.seq.seq_id)) for s in sampling]
            with torch.inference_mode():
                result = sample(logits, requests, inplace=True)
        duration = time.perf_counter() - t0
        self._stage = "postprocess"  # postprocess_token names the grammar or the detokenizer itself
        return self._postprocess(sched, sampling, result, ran.prompt_logprobs, duration)

    def _step_error(self, e: Exception) -> EngineStepError:
        if isinstance(e, EngineStepError):  # postprocess named the stage
            return e
        stage = self._stage
        if stage == "sampler" and self._masks.raised(e):
            stage = "grammar"  # a mask fill raised on the prefetch worker; the sampler re-raised it
        return EngineStepError(stage, e)

    def _recover(self, sched: SchedulerOutput, error: EngineStepError) -> list[RequestOutput]:
        """Fail every request of the step that raised and free its KV (nothing committed); raise
        EngineDeadError instead of serving on if this repeats a fault or the books do not add up."""
        try:
            outputs = self._fail_batch(sched, error)
            self._check_books()
        except Exception as e:
            self._stop(f"{error}, and failing its batch left the bookkeeping inconsistent: {e!r}", error)
        if self._last_fault is not None:
            self._stop(f"{error}, in the step right after another fault ({self._last_fault})", error)
        self._last_fault = error
        return outputs

    def _fail_batch(self, sched: SchedulerOutput, error: EngineStepError) -> list[RequestOutput]:
        self._masks.wait()  # no fill may still run on a failed request's constraint
        self.block_manager.take_copy_ops()  # queued only by this step's admissions: their blocks go
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        for item in sched.scheduled:
            seq = item.seq
            self._seqs.pop(seq.request_id, None)
            self.scheduler.finish(seq, FinishReason.ERROR)  # frees without committing; no-op if retired
            seq.trace.record_finish(FinishReason.ERROR.value, now)
            outputs.append(self._output(seq, "", [], EngineStepError(error.stage, error.cause)))
        return outputs

    def _stop(self, reason: str, error: EngineStepError) -> NoReturn:
        self.dead_reason = reason
        raise EngineDeadError(reason) from error

    def _check_books(self) -> None:
        """Every unfinished request is known to the scheduler once, and the KV books add up."""
        live = [*self.scheduler.running, *self.scheduler.waiting]
        assert len({id(s) for s in live}) == len(live), "a sequence is queued twice"
        assert {s.request_id for s in live} == set(self._seqs), "the scheduler and the requests disagree"
        self.block_manager.check_invariants()

    def _prefetch_masks(self, sampling: list[ScheduledSeq]) -> dict[int, TokenConstraint]:
        """Start this step's grammar masks on the prefetch worker: they depend only on tokens already
        sampled, so they fill while the forward runs. Returns seq_id -> the stand-in constraint."""
        pairs = [(s.seq.seq_id, s.seq.constraint) for s in sampling if s.seq.constraint is not None]
        if not pairs:
            return {}
        stand_ins = self._masks.start([c for _, c in pairs if c is not None])
        return {seq_id: c for (seq_id, _), c in zip(pairs, stand_ins, strict=True)}

    def _note_first_schedule(self, sched: SchedulerOutput, now: float) -> None:
        for item in sched.scheduled:
            seq = item.seq
            if seq.trace.record_scheduled(now):
                self.stats.num_prompt_tokens_total += seq.num_prompt_tokens
                self.stats.num_prefix_cache_query_tokens_total += seq.num_prompt_tokens
                self.stats.num_prefix_cache_hit_tokens_total += seq.num_cached_tokens

    def _sampling_request(self, seq: Sequence, constraint: TokenConstraint | None = None) -> SamplingRequest:
        banned: Iterable[int] = ()
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = sorted(self.tokenizer.eos_token_ids | set(seq.params.stop_token_ids))
        return SamplingRequest(
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_view,
            generator=seq.generator,
            constraint=constraint or seq.constraint,
            banned_token_ids=list(banned),
        )

    def _postprocess(
        self,
        sched: SchedulerOutput,
        sampling: list[ScheduledSeq],
        result: SampleResult | None,
        prompt_logprobs: dict[int, PromptLogprobs],
        duration: float,
    ) -> list[RequestOutput]:
        now = time.perf_counter()
        batch_size, num_batched = len(sched.scheduled), sched.num_batched_tokens
        row = {id(s.seq): i for i, s in enumerate(sampling)}
        outputs: list[RequestOutput] = []
        for index, item in enumerate(sched.scheduled):
            seq = item.seq
            kind = "prefill" if seq.is_prefilling else "decode"
            seq.num_computed_tokens += item.num_new_tokens
            record = StepRecord(
                self._step_counter, kind, item.num_new_tokens, batch_size, num_batched, duration
            )
            seq.trace.record_step(record)
            if index in prompt_logprobs:
                chunk = prompt_logprobs[index]
                assert chunk.first_token == len(seq.prompt_logprobs), "prompt logprobs out of order"
                seq.prompt_logprobs += chunk.logprobs
                seq.prompt_top_logprobs += chunk.top_logprobs
            if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_prompt_tokens:
                outputs.append(self._score_only_done(seq, now))
                continue
            if id(seq) not in row:
                continue
            if seq.num_output_tokens == 0 and seq.trace.prefill_done_time is None:
                seq.trace.record_prefill_done(now)
                self.scheduler.commit_prompt(seq)
            assert result is not None, "a sampling row always has a sample result"
            delta_text, finish = postprocess_token(
                seq, result, row[id(seq)], record, self.tokenizer.eos_token_ids
            )
            self.stats.num_generation_tokens_total += 1
            seq.trace.record_token(now)
            if finish is not None:
                self._retire(seq, finish, now)
            outputs.append(self._output(seq, delta_text, [seq.token_ids[-1]]))
        return outputs

    def _score_only_done(self, seq: Sequence, now: float) -> RequestOutput:
        """A max_tokens 0 request whose prompt is computed: it ends here, with no token sampled."""
        seq.trace.record_prefill_done(now)
        self.scheduler.commit_prompt(seq)
        self._retire(seq, FinishReason.LENGTH, now)
        return self._output(seq, "", [])

    def _retire(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.trace.record_finish(reason.value, now)
        self._seqs.pop(seq.request_id, None)

    def _output(
        self, seq: Sequence, delta_text: str, delta_ids: list[int], error: EngineStepError | None = None
    ) -> RequestOutput:
        want_lp = seq.params.logprobs is not None
        ts = seq.text_state
        return RequestOutput(
            request_id=seq.request_id,
            text=ts.text if ts else "",
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            trace=seq.trace,
            _all_token_ids=seq.token_ids,
            _num_tokens=seq.num_tokens,
            _logprobs=seq.output_logprobs if want_lp else None,
            _top_logprobs=seq.output_top_logprobs if want_lp else None,
            error=error,
            prompt_logprobs=seq.prompt_logprobs if seq.has_prompt_logprobs else None,
            prompt_top_logprobs=seq.prompt_top_logprobs if seq.has_prompt_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if want_lp else None,
        )
