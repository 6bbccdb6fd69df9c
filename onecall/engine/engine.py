"""Engine: add_request() / step() / abort(), the one loop every entry point drives.

    request -> token ids -> add_request -> step(): schedule -> run model -> sample
            -> postprocess (append, detokenize, stop checks, prefix-cache insert, free)
            -> RequestOutputs (text deltas + trace)

The LLM facade, the CLI, the server and the lab all call `step()` in a loop;
nothing else advances a request. Loading (files -> model + tokenizer + KV pool)
lives in engine/engine_parts.py, validating a request and building its Sequence in
engine/intake.py, the RequestOutput a step hands out in engine/outputs.py; this module
is the loop.

Faults. A fault that is one request's own (its parameters leave no token allowed, its
grammar or its detokenizer raises: a RequestFaultError) ends that request alone, with
finish_reason "error" and nothing of it committed; the rest of the batch goes on, and
such a fault never counts toward the engine's death. A step that raises otherwise
(in the model forward or the sampler) fails only the requests of its batch:

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
recovered (engine/tp/workers.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NoReturn

import torch

from onecall.config import EngineConfig
from onecall.engine.block_manager import BlockManager
from onecall.engine.decode_graphs import BUCKETS, DecodeGraphs
from onecall.engine.engine_parts import LoadedEngineParts, load_engine_parts
from onecall.engine.intake import Prompt, RequestIntake
from onecall.engine.model_runner import ModelRunner, PromptLogprobs
from onecall.engine.outputs import EngineStats, RequestOutput, make_output
from onecall.engine.postprocess import postprocess_token
from onecall.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from onecall.engine.sequence import FinishReason, Sequence, SequenceStatus
from onecall.engine.state_slots import StateSlots
from onecall.engine.trace import StepRecord
from onecall.errors import EngineDeadError, EngineStepError, InvalidParameterError, RequestFaultError
from onecall.kernels.cpu import native
from onecall.model.attention_metadata import default_backend
from onecall.sampling.mask_prefetch import MaskPrefetcher
from onecall.sampling.sampler import sample
from onecall.sampling.types import SampleResult, SamplingRequest, TokenConstraint
from onecall.sampling_params import SamplingParams

if TYPE_CHECKING:
    from onecall.sampling.grammar import GrammarBackend

# RequestOutput and EngineStats live in engine/outputs.py; they stay importable from here.
__all__ = ["Engine", "EngineStats", "RequestOutput"]


def _load_parts(config: EngineConfig) -> LoadedEngineParts:
    """Load the model; with tensor_parallel_size > 1 start the other ranks first (engine/tp/)."""
    if config.tensor_parallel_size == 1:
        return load_engine_parts(config)
    from onecall.engine.tp.workers import start_group  # torch.distributed loads only when asked for

    group = start_group(config)
    try:
        return load_engine_parts(config, group)
    except BaseException:
        group.close()  # the workers wait for a first step that will never come
        raise


class Engine:
    def __init__(self, config: EngineConfig | None = None, parts: LoadedEngineParts | None = None) -> None:
        self.config = config or EngineConfig()
        self.parts = parts or _load_parts(self.config)
        p = self.parts
        self.tokenizer = p.tokenizer
        self.model_config = p.model_config
        self.device = p.device
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._intake = RequestIntake(p, lambda: self.grammar)
        self._step_counter = 0
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()  # a server may reach `grammar` from another thread
        self._masks = MaskPrefetcher(self.model_config.vocab_size)
        self._stage = ""  # the phase of the step now running, to name it if it raises
        self._last_fault: EngineStepError | None = None  # set by a recovered step, cleared by a good one
        self.dead_reason: str | None = None  # set once the engine refuses to go on (see the docstring)
        latent = p.model_config.deepseek is not None
        backend = default_backend(self.device, self.config.kernels, latent_attention=latent)
        # static steps: fast kernels on CUDA, one process, and a model whose forward has no host syncs (a
        # MoE layer reads its expert counts on the host, .tolist(), which no CUDA graph can capture)
        static = self.config.cuda_graphs and backend == "triton" and p.tp_group is None
        # (a hybrid model's state is gathered and scattered per sequence on the host: eager steps too)
        if static and p.model_config.moe is None and p.kv_cache.state is None:
            self.enable_static_decode(capture=self.device.type == "cuda", backend=backend)
            if self.device.type == "cuda":  # the common layouts captured now, not by the first requests
                graphs = self.runner.decode_graphs
                assert graphs is not None
                graphs.prepare_common(self.config.block_size)
        else:
            self._build_runner(backend, p.num_blocks)

    def _build_runner(self, backend: str, num_blocks: int) -> None:
        p = self.parts
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        state_slots = None
        if p.kv_cache.state is not None:  # a hybrid model: live state slots, then prefix snapshots
            state_slots = StateSlots(self.config.max_num_seqs, self.config.num_state_snapshots)
            assert state_slots.num_slots == p.kv_cache.state.num_slots
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, state_slots
        )
        self.runner = ModelRunner(
            p.model, p.kv_cache, self.block_manager, self.device, backend, tp_group=p.tp_group,
            state_slots=state_slots,
        )  # fmt: skip

    def enable_static_decode(self, capture: bool, backend: str | None = None) -> None:
        """Run decode steps, and steps with one short prompt chunk beside decode rows, on static,
        bucketed buffers (engine/decode_graphs.py), captured as CUDA graphs when `capture` (CUDA only). The pool's last block becomes the padding rows'
        scratch block, so the block manager is rebuilt one block smaller: call it before any request.
        `backend` overrides the attention backend (tests run "triton" on CPU under the interpreter)."""
        assert not self._seqs, "enable_static_decode() before any request"
        assert self.parts.tp_group is None, "static decode steps run in one process, not under TP"
        assert self.parts.kv_cache.state is None, "a hybrid model's state runs eager steps only"
        p = self.parts
        backend = backend or self.runner.attention_backend  # the constructor passes its own
        assert backend == "triton", "static decode steps need the Triton backend (metadata as tensors only)"
        self._build_runner(backend, p.num_blocks - 1)
        # one sequence must still fit the smaller pool, or it would wait at the head of the queue forever
        room = (p.num_blocks - 1) * self.config.block_size
        self._intake.max_model_len = min(self._intake.max_model_len, room)
        self.runner.decode_graphs = DecodeGraphs(
            model=p.model,
            kv_cache=p.kv_cache,
            max_bucket=min(self.config.max_num_seqs, BUCKETS[-1]),
            max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
            scratch_block=p.num_blocks - 1,
            backend=backend,
            capture=capture,
        )

    def restart(self) -> list[RequestOutput]:
        """Start over on the same loaded weights: every request still known is ended (finish_reason
        "error", `error` an EngineStepError of stage "engine restart" whose cause is an EngineDeadError
        saying so), then a fresh block manager,
        scheduler and model runner (an empty prefix cache; the KV pool's bytes are reused, nothing in
        them is trusted) replace the old ones and `dead_reason` is cleared. Returns the ended
        requests' outputs. Refused (EngineDeadError) under tensor parallel: the other ranks hold their
        own state, which one rank cannot rebuild."""
        if self.parts.tp_group is not None:
            raise EngineDeadError(f"a tensor-parallel engine cannot restart in place: {self.dead_reason}")
        cause = EngineDeadError(
            f"the engine restarted after a fault ({self.dead_reason or 'on request'}); retry"
        )
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        for seq in self._seqs.values():
            seq.trace.record_finish(FinishReason.ERROR.value, now)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ERROR
            outputs.append(make_output(seq, "", [], EngineStepError("engine restart", cause)))
        self._seqs.clear()
        self._masks.wait()
        listener = self.block_manager.tree.listener  # KV events (server/kv_events.py) go on after it
        backend = self.runner.attention_backend
        if self.runner.decode_graphs is not None:
            self.enable_static_decode(capture=self.device.type == "cuda", backend=backend)
        else:
            self._build_runner(backend, self.parts.num_blocks)
        self.block_manager.tree.listener = listener
        if listener is not None:
            listener.cleared()  # a router forgets every block this engine had cached
        self._last_fault = None
        self.dead_reason = None
        return outputs

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit); a no-op otherwise."""
        if self.parts.tp_group is not None:
            self.parts.tp_group.close()

    @property
    def max_model_len(self) -> int:
        """The context window: the model's, capped by what the KV pool can hold for one sequence."""
        return self._intake.max_model_len

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
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        constraint: TokenConstraint | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next step. Validates everything a
        caller can get wrong (typed errors, a bad structured_outputs grammar included; engine/intake.py),
        so a bad request never reaches the step loop. `constraint` (any TokenConstraint) overrides the
        grammar."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._seqs:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        seq = self._intake.new_sequence(
            request_id, prompt, params or SamplingParams(), constraint, arrival_time
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The token ids this engine runs for `prompt` (a str gets the tokenizer's BOS, if any);
        InvalidParameterError for an empty prompt, ids outside the vocabulary, or another type."""
        return self._intake.prompt_token_ids(prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request now: its KV blocks are freed before this returns."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        seq.trace.record_finish(FinishReason.ABORT.value, time.perf_counter())
        return make_output(seq, "", [])

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
        except EngineDeadError as e:  # a tensor-parallel rank died: nothing to recover (engine/tp/workers.py)
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
        self.scheduler.forward_done()
        logits = ran.logits
        result = None
        if sampling:  # the logits are this step's own (inference) tensor: masked rows edited in place
            self._stage = "sampler"
            requests = [self._sampling_request(s.seq, prefetched.get(s.seq.seq_id)) for s in sampling]
            with torch.inference_mode():
                result = sample(logits, requests, inplace=True, argmax=native.argmax)
        duration = time.perf_counter() - t0
        self._stage = "postprocess"  # postprocess_token names the grammar or the detokenizer itself
        return self._postprocess(sched, sampling, result, ran.prompt_logprobs, duration)

    def _step_error(self, e: Exception) -> EngineStepError:
        if isinstance(e, EngineStepError):  # postprocess named the stage
            return e
        return EngineStepError(self._stage, e)

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
            outputs.append(make_output(seq, "", [], EngineStepError(error.stage, error.cause)))
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
        """Two phases, so that a step that raises leaves nothing behind:
        1. advance every scheduled sequence: counts, trace, prompt logprobs, the sampled token and
           its text (postprocess_token). A row that failed for its own request's reasons (the
           sampler's `failed`, or a RequestFaultError from its grammar or detokenizer) is noted
           to end alone; anything else that raises fails the whole batch (step() -> _recover).
        2. nothing can raise any more: commit finished prompts to the prefix cache, retire the
           requests that finished or failed, and build the outputs."""
        now = time.perf_counter()
        batch_size, num_batched = len(sched.scheduled), sched.num_batched_tokens
        row = {id(s.seq): i for i, s in enumerate(sampling)}
        failed = result.failed if result is not None else {}
        prompts_done: list[Sequence] = []
        ended: list[tuple[Sequence, FinishReason]] = []
        emitted: list[tuple[Sequence, str, list[int], EngineStepError | None]] = []
        # 1. advance
        for index, item in enumerate(sched.scheduled):
            seq = item.seq
            kind = "prefill" if seq.is_prefilling else "decode"
            seq.num_computed_tokens += item.num_new_tokens
            record = StepRecord(
                self._step_counter, kind, item.num_new_tokens, batch_size, num_batched, duration, end_time=now
            )
            seq.trace.record_step(record)
            if index in prompt_logprobs:
                chunk = prompt_logprobs[index]
                assert chunk.first_token == len(seq.prompt_logprobs), "prompt logprobs out of order"
                seq.prompt_logprobs += chunk.logprobs
                seq.prompt_top_logprobs += chunk.top_logprobs
            if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_prompt_tokens:
                seq.trace.record_prefill_done(now)  # a score-only request: it ends with its prompt
                prompts_done.append(seq)
                ended.append((seq, FinishReason.LENGTH))
                emitted.append((seq, "", [], None))
                continue
            if id(seq) not in row:
                continue
            first_token = seq.num_output_tokens == 0 and seq.trace.prefill_done_time is None
            if first_token:
                seq.trace.record_prefill_done(now)
            assert result is not None, "a sampling row always has a sample result"
            fault = failed.get(row[id(seq)])
            try:
                if fault is not None:
                    raise fault
                delta_text, finish = postprocess_token(
                    seq, result, row[id(seq)], record, self.tokenizer.eos_token_ids
                )
            except RequestFaultError as e:  # this request's own: it ends alone, nothing committed
                ended.append((seq, FinishReason.ERROR))
                emitted.append((seq, "", [], e))
                continue
            if first_token:
                prompts_done.append(seq)
            self.stats.num_generation_tokens_total += 1
            seq.trace.record_token(now)
            if finish is not None:
                ended.append((seq, finish))
            emitted.append((seq, delta_text, [seq.token_ids[-1]], None))
        # 2. commit, retire, answer
        for seq in prompts_done:
            self.scheduler.commit_prompt(seq)
        for seq, reason in ended:
            self._retire(seq, reason, now)
        return [make_output(seq, text, ids, error) for seq, text, ids, error in emitted]

    def _retire(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.trace.record_finish(reason.value, now)
        self._seqs.pop(seq.request_id, None)
