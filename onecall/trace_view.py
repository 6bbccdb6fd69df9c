"""Human-readable views of a RequestTrace: the table `onecall run --trace` prints.

With trace_level "full", a short per-token table follows: the chosen token's rank after
each sampler stage (sampling/provenance.py), the ids left after truncation, its probability.

Control tokens are shown distinctly: wrapped in ⟦ ⟧ (and coloured when the
output is a terminal), so the template's scaffolding is visible next to the text.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from onecall.engine.trace import RequestTrace, StepRecord
from onecall.sampling_params import SamplingParams
from onecall.text.tokenizer import Tokenizer

_CTRL_ON, _CTRL_OFF = "\x1b[1;35m", "\x1b[0m"


def render_prompt_tokens(trace: RequestTrace, tokenizer: Tokenizer, color: bool = False) -> str:
    """The prompt with every control token shown as ⟦token⟧; plain text decoded in runs."""
    parts: list[str] = []
    run: list[int] = []
    for tok, is_ctrl in zip(
        trace.prompt_token_ids, trace.prompt_is_control or [False] * len(trace.prompt_token_ids)
    ):
        if not is_ctrl:
            run.append(tok)
            continue
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
        piece = f"⟦{tokenizer.decode([tok], skip_special_tokens=False)}⟧"
        parts.append(f"{_CTRL_ON}{piece}{_CTRL_OFF}" if color else piece)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    return "".join(parts)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} tok/s"


def format_trace(trace: RequestTrace, tokenizer: Tokenizer, color: bool = False, max_steps: int = 12) -> str:
    tok = lambda i: repr(tokenizer.decode([i], skip_special_tokens=False))  # noqa: E731
    ctrl = Counter(
        tokenizer.decode([t], skip_special_tokens=False)
        for t, c in zip(trace.prompt_token_ids, trace.prompt_is_control)
        if c
    )
    decode_steps = [s.duration for s in trace.steps if s.kind == "decode"]
    rows: list[tuple[str, str]] = [
        ("model", f"{trace.model} on {trace.device}, {trace.dtype.replace('torch.', '')}"),
        (
            "template",
            f"{trace.num_prompt_tokens} prompt tokens, {sum(ctrl.values())} control: "
            + (", ".join(f"{k} x{v}" for k, v in ctrl.items()) or "none"),
        ),
        ("prefix cache", _cache_line(trace, tok)),
        ("queue", _ms(trace.queue_time)),
        (
            "prefill",
            f"{trace.num_prefilled_tokens} tokens in {_ms(trace.prefill_time)} ({_rate(trace.prefill_tokens_per_s)})"
            + (f", {trace.num_preemptions} preemption(s)" if trace.num_preemptions else ""),
        ),
        ("first token", f"{_ms(trace.time_to_first_token)} after arrival"),
        (
            "decode",
            f"{len(decode_steps)} steps in {_ms(trace.decode_time)} ({_rate(trace.decode_tokens_per_s)})"
            + (
                f"; per step p50 {_ms(statistics.median(decode_steps))}, max {_ms(max(decode_steps))}"
                if decode_steps
                else ""
            ),
        ),
        (
            "finish",
            f"{trace.finish_reason}"
            + (f" ({_stop_str(trace.stop_reason, tok)})" if trace.stop_reason is not None else ""),
        ),
        ("sampler", _sampler_line(trace.sampling)),
        *([("grammar", _grammar_line(trace))] if trace.grammar is not None else []),
        ("total", _ms(trace.e2e_time)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [
        "prompt as the model sees it (⟦control tokens⟧):",
        render_prompt_tokens(trace, tokenizer, color),
        "",
    ]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", _steps_table(trace, tok, max_steps)]
    if any(s.provenance for s in trace.steps):
        lines += ["", _provenance_table(trace, tok, max_steps)]
    return "\n".join(lines)


def _sampler_line(sampling: dict[str, object]) -> str:
    """The resolved settings that differ from SamplingParams' defaults (greedy/sample always shown)."""
    defaults = SamplingParams()
    shown = [str(sampling.get("mode", ""))]
    for k, v in sampling.items():
        if k != "mode" and v not in (None, [], {}) and v != getattr(defaults, k, None):
            shown.append(f"{k}={v}")
    return ", ".join(shown)


def _grammar_line(trace: RequestTrace) -> str:
    """Compile, first masked step (the seed's "151,934 of 151,936 masked") and total mask time."""
    g = trace.grammar
    assert g is not None
    line = f"{g.kind}, compiled in {_ms(g.compile_time)}" + (" (cache hit)" if g.cache_hit else "")
    first = next((s for s in trace.steps if s.num_allowed is not None), None)
    if first is not None:
        vocab = first.num_allowed + first.num_masked  # type: ignore[operator]
        line += (
            f"; first masked step: {first.num_allowed:,} allowed, {first.num_masked:,} of {vocab:,} masked"
        )
    line += f"; masks {_ms(trace.mask_time)} in all"
    if g.reasoning_end is not None:
        line += f"; applied after {g.reasoning_end!r}" + (
            f" (from output token {g.activated_at})" if g.activated_at is not None else " (not reached)"
        )
    return line + (f"; error: {g.error}" if g.error else "")


def _cache_line(trace: RequestTrace, tok) -> str:  # type: ignore[no-untyped-def]
    line = f"{trace.num_cached_tokens} of {trace.num_prompt_tokens} prompt tokens cached"
    d = trace.divergence
    if d is not None:
        line += f"; match broke at token {d['index']}: prompt {tok(d['prompt_token'])} vs cached {tok(d['cached_token'])}"
    elif trace.cache_match_capped:
        line += " (whole prompt cached; last token recomputed for its logits)"
    if trace.num_dropped_cache_tokens:
        line += f"; {trace.num_dropped_cache_tokens} more matched tokens recomputed (no room to copy their blocks)"
    return line


def _stop_str(reason: str | int | None, tok) -> str:  # type: ignore[no-untyped-def]
    return f"token {tok(reason)}" if isinstance(reason, int) else f"stop string {reason!r}"


def _steps_table(trace: RequestTrace, tok, max_steps: int) -> str:  # type: ignore[no-untyped-def]
    header = f"{'step':>5} {'kind':<8} {'tokens':>6} {'batch':>5} {'ms':>8}  token"
    lines = [header]
    steps = trace.steps
    shown: list[StepRecord | None] = list(steps)
    if len(steps) > max_steps:
        shown = [*steps[: max_steps // 2], None, *steps[-max_steps // 2 :]]
    for s in shown:
        if s is None:
            lines.append(f"{'...':>5} ({len(steps) - max_steps} more steps)")
            continue
        token = "" if s.token_id is None else tok(s.token_id)
        if s.num_allowed is not None:
            masked = f"  allowed {s.num_allowed:,}, masked {s.num_masked:,}"
        else:
            masked = f"  masked {s.num_masked}" if s.num_masked else ""
        lines.append(
            f"{s.step:>5} {s.kind:<8} {s.num_tokens:>6} {s.batch_size:>5} {s.duration * 1e3:>8.2f}  {token}{masked}"
        )
    return "\n".join(lines)


_STAGE_HEADS = {
    "raw": "raw",
    "penalties": "pen",
    "mask": "mask",
    "temperature": "temp",
    "truncation": "trunc",
}


def _provenance_table(trace: RequestTrace, tok, max_steps: int) -> str:  # type: ignore[no-untyped-def]
    """One line per generated token: its rank at each stage (- = skipped), ids kept, probability."""
    records = [s.provenance for s in trace.steps if s.provenance]
    lines = [
        "logit provenance: the chosen token's rank after each sampler stage (1 = top, - = skipped)",
        f"{'token':<16} " + " ".join(f"{h:>5}" for h in _STAGE_HEADS.values()) + f" {'kept':>7} {'p':>6}",
    ]
    shown: list[dict[str, Any] | None] = list(records)
    if len(records) > max_steps:
        shown = [*records[: max_steps // 2], None, *records[-max_steps // 2 :]]
    for p in shown:
        if p is None:
            lines.append(f"{'...':<16} ({len(records) - max_steps} more tokens)")
            continue
        stages = {st["stage"]: st for st in p["stages"]}
        ranks = [stages[name]["chosen_rank"] if name in stages else None for name in _STAGE_HEADS]
        kept = stages.get("truncation", {}).get("num_surviving")
        prob = p["probability"]
        lines.append(
            f"{tok(p['token_id'])[:16]:<16} "
            + " ".join(f"{'-' if r is None else r:>5}" for r in ranks)
            + f" {'-' if kept is None else f'{kept:,}':>7} {'-' if prob is None else f'{prob:.3f}':>6}"
        )
    return "\n".join(lines)
