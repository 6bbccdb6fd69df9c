"""Experiment 6: asking for JSON three ways, and what the grammar mask does at each step.

    method                  conversation                                constraint
    naive prompt            user: "Reply in JSON: ..."                  none
    strict system prompt    system: "You are a JSON API ... no fences"  none
                            user: the same
    grammar                 user: the same                              StructuredOutputsParams(json=PERSON)

N calls each (--calls; quick: 3) at temperature 0.7 with seeds 0..N-1, all 3N in one batch.
Counted per method: json.loads failures on the raw text, replies wrapped in a Markdown fence
(and how many of those would parse once the fence is stripped), replies cut by max_tokens.
For the grammar run, from the trace: tokens allowed and masked (set to -inf) at every step,
the first step's figures (the seed's "151,934 of 151,936 masked"), and the compile time.
"""

from __future__ import annotations

import json
import re
from statistics import mean
from typing import Any

from onecall import RequestOutput, SamplingParams, StructuredOutputsParams
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import bar_plot, line_plot
from onecall.lab.report import md_code, md_table

NAME = "json"
TITLE = "JSON three ways: a naive prompt, a strict system prompt, and a grammar mask"

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
}
ASK = "Reply in JSON: a fictional person with a name, an age and a city."
STRICT_SYSTEM = (
    "You are a JSON API. Reply with exactly one JSON object with the keys name (string), "
    "age (integer) and city (string). No Markdown, no code fences, no explanations."
)
METHODS: dict[str, tuple[list[dict[str, str]], StructuredOutputsParams | None]] = {
    "naive prompt": ([{"role": "user", "content": ASK}], None),
    "strict system prompt": (
        [{"role": "system", "content": STRICT_SYSTEM}, {"role": "user", "content": ASK}],
        None,
    ),
    "grammar": ([{"role": "user", "content": ASK}], StructuredOutputsParams(json=PERSON)),
}
QUICK_CALLS = 3
MAX_TOKENS, QUICK_MAX_TOKENS = 128, 64  # a grammar reply takes about 20 tokens
TEMPERATURE = 0.7
SEED_CALLS, SEED_VOCAB, SEED_FIRST_STEP_ALLOWED = 80, 151_936, 2  # the seed's runs, on Qwen3-8B
_FENCED = re.compile(r"^\s*```[a-zA-Z]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def fenced_body(text: str) -> str | None:
    """The text inside a reply that is one Markdown code fence, else None."""
    m = _FENCED.match(text)
    return m.group(1) if m else None


def run(ctx: LabContext) -> ExperimentResult:
    n = QUICK_CALLS if ctx.quick else ctx.calls
    max_tokens = QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS
    vocab = ctx.llm.info.vocab_size

    # 1. every call of every method in one batch (distinct seeds within a method)
    ctx.progress(f"json: {len(METHODS)} methods x {n} calls, temperature {TEMPERATURE}, one batch")
    conversations = [messages for messages, _ in METHODS.values() for _ in range(n)]
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=max_tokens, structured_outputs=so)
        for _, so in METHODS.values()
        for seed in range(n)
    ]
    outputs = ctx.llm.chat(conversations, params)

    # 2. per method: failures, fences, truncation, an example
    methods = {name: _count(outputs[k * n : (k + 1) * n]) for k, name in enumerate(METHODS)}

    # 3. the grammar run's masks, from the trace
    grammar = _mask_figures(outputs[2 * n :], vocab)

    results: dict[str, Any] = {
        "calls_per_method": n,
        "temperature": TEMPERATURE,
        "max_tokens": max_tokens,
        "schema": PERSON,
        "methods": methods,
        "grammar": grammar,
    }
    plots = [
        bar_plot(
            ctx.out_dir / "json_failures.png",
            list(methods),
            {
                "json.loads failures": [m["failures"] for m in methods.values()],
                "in a Markdown fence": [m["fenced"] for m in methods.values()],
            },
            title=f"json.loads failures, {n} calls per method, {ctx.llm.info.model_name}",
            xlabel="method",
            ylabel="replies",
        ),
        line_plot(
            ctx.out_dir / "json_allowed_per_step.png",
            list(range(1, len(grammar["allowed_per_step_first_call"]) + 1)),
            {"tokens allowed": grammar["allowed_per_step_first_call"]},
            title=f"Grammar mask: tokens allowed per step, first call (vocabulary {vocab:,})",
            xlabel="output token",
            ylabel="allowed tokens (log)",
            logy=True,
        ),
    ]
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        results=results,
        seed_rows=_seed_rows(ctx, methods, grammar, n),
        markdown=_markdown(ctx, results),
        plots=plots,
    )


def _count(outputs: list[RequestOutput]) -> dict[str, Any]:
    texts = [out.text for out in outputs]
    bodies = [fenced_body(t) for t in texts]
    return {
        "failures": sum(not parses(t) for t in texts),
        "fenced": sum(b is not None for b in bodies),
        "fenced_parse_when_stripped": sum(b is not None and parses(b) for b in bodies),
        "cut_by_max_tokens": sum(out.finish_reason == "length" for out in outputs),
        "example": texts[0],
    }


def _mask_figures(outputs: list[RequestOutput], vocab: int) -> dict[str, Any]:
    """Allowed / masked counts per constrained step, over all grammar calls, and the first call's."""
    steps = [[s for s in out.trace.steps if s.num_allowed is not None] for out in outputs]
    assert steps and steps[0], "a grammar request constrains its first output token"
    first = steps[0][0]
    assert first.num_allowed is not None
    every = [s for call in steps for s in call]
    traces = [out.trace.grammar for out in outputs if out.trace.grammar is not None]
    return {
        "vocab_size": vocab,
        "first_step_allowed": first.num_allowed,
        "first_step_masked": first.num_masked,
        "masked_per_step_mean": mean(s.num_masked for s in every),
        "allowed_per_step_max": max(s.num_allowed or 0 for s in every),
        "forced_steps": sum(s.num_allowed == 1 for s in every),  # one legal token: no choice at all
        "constrained_steps": len(every),
        "allowed_per_step_first_call": [s.num_allowed for s in steps[0]],
        "mask_ms_per_step_mean": 1e3 * mean(s.mask_time for s in every),
        "compile_ms": 1e3 * traces[0].compile_time if traces else None,
        "compile_cache_hits": sum(g.cache_hit for g in traces),
        "errors": [g.error for g in traces if g.error],
    }


def _seed_rows(
    ctx: LabContext, methods: dict[str, dict[str, Any]], grammar: dict[str, Any], n: int
) -> list[SeedRow]:
    why = (
        f"unconstrained, the format is the model's own habit (Qwen3 fences its JSON); {n} calls here "
        f"({ctx.llm.info.model_name}), {SEED_CALLS} in the seed"
    )
    naive, strict, gram = (methods[k] for k in METHODS)
    seed_masked = SEED_VOCAB - SEED_FIRST_STEP_ALLOWED
    return [
        SeedRow(
            "naive prompt: json.loads failures",
            f"{SEED_CALLS} of {SEED_CALLS}",
            f"{naive['failures']} of {n}",
            why,
        ),
        SeedRow(
            "naive prompt: replies in a Markdown fence",
            f"{SEED_CALLS} of {SEED_CALLS}",
            f"{naive['fenced']} of {n}",
            why,
        ),
        SeedRow(
            "strict system prompt: json.loads failures",
            f'0 of {SEED_CALLS} ("passed")',
            f"{strict['failures']} of {n}",
            why,
        ),
        SeedRow(
            "grammar: json.loads failures",
            f"0 of {SEED_CALLS} (impossible by construction)",
            f"{gram['failures']} of {n}",
            "the mask leaves only tokens that keep the output valid JSON of the schema",
        ),
        SeedRow(
            "tokens masked to -inf at the first step",
            f"{seed_masked:,} of {SEED_VOCAB:,}",
            f"{grammar['first_step_masked']:,} of {grammar['vocab_size']:,}",
            f"the vocabularies differ (Qwen3's {SEED_VOCAB:,}); at the first step only what can open the "
            f"object is legal: {grammar['first_step_allowed']} token(s) here, {SEED_FIRST_STEP_ALLOWED} in "
            "the seed",
        ),
    ]


def _markdown(ctx: LabContext, results: dict[str, Any]) -> str:
    n, g = results["calls_per_method"], results["grammar"]
    header = [
        "method",
        "json.loads failures",
        "in a Markdown fence",
        "fenced, parse once stripped",
        "cut by max_tokens",
    ]
    rows = [
        [
            name,
            f"{m['failures']} of {n}",
            m["fenced"],
            m["fenced_parse_when_stripped"],
            m["cut_by_max_tokens"],
        ]
        for name, m in results["methods"].items()
    ]
    examples = [
        f"**{name}** (seed 0):\n\n{md_code(m['example'], 'text')}" for name, m in results["methods"].items()
    ]
    compile_ms = "n/a" if g["compile_ms"] is None else f"{g['compile_ms']:.1f} ms"
    return "\n\n".join(
        [
            f"{ctx.setting}; {n} calls per method at temperature {results['temperature']} (seeds 0..{n - 1}), "
            f"max_tokens {results['max_tokens']}. Prompt: {ASK!r}",
            md_table(header, rows),
            *examples,
            f"The grammar masked {g['first_step_masked']:,} of {g['vocab_size']:,} tokens at the first step "
            f"({g['first_step_allowed']} allowed) and {g['masked_per_step_mean']:,.0f} per step on average "
            f"over {g['constrained_steps']} constrained steps; {g['forced_steps']} of those steps had exactly "
            f"one legal token. Compile: {compile_ms} (cache hits: {g['compile_cache_hits']} of {n}); mask: "
            f"{g['mask_ms_per_step_mean']:.2f} ms per step.",
        ]
    )
