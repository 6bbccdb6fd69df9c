"""After sampling: append one token to a sequence and decide whether it stops.

Stop checks, in order (the first that fires wins):
    1. a stop token id (params.stop_token_ids)        -> "stop", token kept in ids, not in text
    2. EOS, unless ignore_eos (and min_tokens reached) -> "stop"
    3. a stop string in the detokenized text          -> "stop", text cut before it
    4. the request's constraint (grammar) is complete -> "stop" (nothing may follow, so the
       request ends without sampling an EOS; a grammar that *may* end allows EOS: step 2)
    5. max_tokens, or the context window is full      -> "length"
Text is produced incrementally (never half a UTF-8 character) and passes through
the stop-string matcher, which holds back anything that may start a stop string.
A grammar or a detokenizer that raises comes out as a RequestFaultError naming it
("grammar", "detokenizer"): it belongs to this request alone, which the engine ends;
the rest of the batch goes on.
"""

from __future__ import annotations

from collections.abc import Set

from onecall.engine.sequence import FinishReason, Sequence
from onecall.engine.trace import StepRecord
from onecall.errors import RequestFaultError
from onecall.sampling.types import SampleResult


def postprocess_token(
    seq: Sequence, result: SampleResult, row: int, record: StepRecord, eos_ids: Set[int]
) -> tuple[str, FinishReason | None]:
    """Append the sampled token of `row`; returns (text delta, finish reason or None)."""
    # 1. append and record; the grammar takes the token
    token = result.token_ids[row]
    seq.token_ids.append(token)
    record.token_id = token
    record.num_masked = result.num_masked[row]
    record.num_allowed = result.num_allowed[row]
    record.mask_time = result.mask_time[row]
    provenance = result.provenance[row] if result.provenance else None  # trace_level "full" only
    if provenance is not None:
        record.provenance = provenance.to_dict()
    if seq.params.logprobs is not None:
        logprob = result.logprobs[row]
        seq.output_logprobs.append(logprob)
        seq.output_top_logprobs.append(result.top_logprobs[row])
        if logprob is not None:
            seq.cumulative_logprob += logprob  # what best_of ranks candidates by
    grammar_done = False
    if seq.constraint is not None:
        try:
            seq.constraint.advance(token)
            grammar_done = seq.constraint.is_finished()
        except Exception as e:
            raise RequestFaultError("grammar", e, "structured_outputs") from e

    # 2. token-level stops
    params = seq.params
    finish: FinishReason | None = None
    if token in params.stop_token_ids or token in eos_ids and not params.ignore_eos:
        finish = FinishReason.STOP
        seq.trace.record_stop(token)
    try:
        return _text_and_limits(seq, token, finish, grammar_done)
    except Exception as e:
        raise RequestFaultError("detokenizer", e) from e


def _text_and_limits(
    seq: Sequence, token: int, finish: FinishReason | None, grammar_done: bool
) -> tuple[str, FinishReason | None]:
    """Steps 3.-6. of the module docstring: the text delta and the stops that depend on it."""
    params = seq.params
    ts = seq.text_state
    assert ts is not None, "engine attaches text state at add_request"
    # 3. text, unless the token itself stopped the request (EOS/stop ids never reach the text)
    delta = ""
    if finish is None:
        delta = ts.detokenizer.add(token)
        if ts.stop_matcher is not None:
            delta, matched = ts.stop_matcher.feed(delta)
            if matched is not None:
                finish = FinishReason.STOP
                seq.trace.record_stop(matched)
    # 4.-5. grammar completion and length limits
    if finish is None and grammar_done:
        finish = FinishReason.STOP
    if finish is None and (
        seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= seq.max_total_tokens
    ):
        finish = FinishReason.LENGTH

    # 6. on finish, release whatever text was held back (unless a stop string cut it)
    if finish is not None and not isinstance(seq.trace.stop_reason, str):
        tail = ts.detokenizer.flush()
        if ts.stop_matcher is not None:
            tail, _ = ts.stop_matcher.feed(tail)
            tail += ts.stop_matcher.flush()
        delta += tail
    ts.text += delta
    return delta, finish
