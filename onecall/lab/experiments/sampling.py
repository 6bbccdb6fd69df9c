"""Experiment 5: one prompt's next-token distribution at temperatures 0.2, 0.7, 1.0 and 1.5.

    chat-rendered prompt, for each T: `draws` one-token requests (seeds 0..draws-1, one batch,
    trace_level "full") -> each request's logit provenance (sampling/provenance.py) at the sampler's
    temperature stage: the ten likeliest tokens with their probabilities under softmax(logits / T)
    over the whole vocabulary, and the drawn token's own probability there
    entropy H(T) = -sum p_T log2 p_T over the whole vocabulary (the stage's own `entropy`, in nats)

Everything comes through the public API: SamplingParams(trace_level="full") and the trace.
The ten probabilities and the entropy are exact (logprobs, which stop at 20, could not give the
entropy: at T != 1 they miss the tail, which grows with T). The mean surprisal of the draws,
-log2 p_T(x), is an independent Monte Carlo estimate of the same entropy, reported beside it
as a check of the sampler: the draws must agree with the distribution they were drawn from. Temperature is a monotone transform, so the ten likeliest
tokens are the same ten at every T: only their probabilities move.
"""

from __future__ import annotations

import math
from typing import Any

from onecall import LLM, RequestOutput, SamplingParams
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import bar_plot
from onecall.lab.report import md_table

PROMPT = "Write one word that describes the sea."
TEMPERATURES = (0.2, 0.7, 1.0, 1.5)
NUM_SHOWN = 10
FULL_DRAWS, QUICK_DRAWS = 200, 32  # one-token samples per temperature

NAME = "sampling"
TITLE = (
    "Temperature: the next-token distribution at T = "
    f"{', '.join(map(str, TEMPERATURES[:-1]))} and {TEMPERATURES[-1]}"
)


def run(ctx: LabContext) -> ExperimentResult:
    messages = [{"role": "user", "content": PROMPT}]
    draws = QUICK_DRAWS if ctx.quick else FULL_DRAWS

    # 1. each temperature: `draws` seeded one-token samples, with their provenance
    per_t: list[dict[str, Any]] = []
    for temperature in TEMPERATURES:
        ctx.progress(f"sampling: T = {temperature}, {draws} one-token draws")
        per_t.append(measure_temperature(ctx.llm, messages, temperature, draws))

    # 2. the same ten tokens in every column (the T = 1 order; temperature keeps it, ties aside)
    t1 = per_t[TEMPERATURES.index(1.0)]
    ids = [c["token_id"] for c in t1["top"]][:NUM_SHOWN]
    for row in per_t:
        by_id = {c["token_id"]: c["prob"] for c in row.pop("top")}
        row["probs"] = [by_id.get(t, 0.0) for t in ids]  # 0.0 only if a tie pushed t out of the top ten
        row["drawn"] = [row["counts"].get(t, 0) / draws for t in ids]
        row["drawn_outside_top10"] = 1.0 - sum(row["drawn"])
        del row["counts"]

    # 3. report
    tokens = [ctx.llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    results: dict[str, Any] = {
        "prompt": PROMPT,
        "token_ids": ids,
        "tokens": tokens,
        "entropy_unit": "bits",
        "entropy_method": "exact over the whole vocabulary (the trace's temperature stage); "
        "entropy_estimate_bits: mean surprisal of the draws, a Monte Carlo check",
        "draws_per_temperature": draws,
        "temperatures": per_t,
    }
    plot = bar_plot(
        ctx.out_dir / "sampling.png",
        [repr(t) for t in tokens],
        {f"T = {row['temperature']}": row["probs"] for row in per_t},
        title=f"Next-token probability by temperature, {ctx.llm.info.model_name}",
        xlabel="token",
        ylabel="probability",
    )
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        results=results,
        seed_rows=_seed_rows(ctx, per_t),
        markdown=_markdown(ctx, results),
        plots=[plot],
    )


def measure_temperature(
    llm: LLM, messages: list[dict[str, Any]], temperature: float, draws: int
) -> dict[str, Any]:
    """`draws` one-token samples at `temperature`: the temperature stage's top candidates (from the
    first draw: every draw sees the same distribution), the count of each drawn id, and the
    entropy estimate with its standard error (bits)."""
    params = [
        SamplingParams(max_tokens=1, temperature=temperature, seed=seed, trace_level="full")
        for seed in range(draws)
    ]
    outputs = llm.chat([messages] * draws, params)  # one batch; later temperatures hit the prefix cache
    stages = [_temperature_stage(out) for out in outputs]
    exact = stages[0]["entropy"] / math.log(2)  # nats -> bits; every draw sees the same distribution
    surprisal = [-math.log2(s["chosen_prob"]) for s in stages]
    mean = sum(surprisal) / draws
    var = sum((s - mean) ** 2 for s in surprisal) / max(draws - 1, 1)
    counts: dict[int, int] = {}
    for out in outputs:
        counts[out.token_ids[0]] = counts.get(out.token_ids[0], 0) + 1
    return {
        "temperature": temperature,
        "top": [{"token_id": c["token_id"], "prob": c["prob"]} for c in stages[0]["top"]],
        "counts": counts,
        "entropy_bits": exact,
        "entropy_estimate_bits": mean,  # from the draws: agrees with entropy_bits within a few s.e.
        "entropy_stderr_bits": math.sqrt(var / draws),
    }


def _temperature_stage(out: RequestOutput) -> dict[str, Any]:
    """The temperature stage of the one sampled token's provenance (TokenProvenance.to_dict())."""
    step = next(s for s in out.trace.steps if s.token_id is not None)
    assert step.provenance is not None, "trace_level 'full' records the provenance of every token"
    stage: dict[str, Any] = next(s for s in step.provenance["stages"] if s["stage"] == "temperature")
    assert not stage["skipped"] and stage["chosen_prob"] is not None, (
        "a sampled row runs the temperature stage"
    )
    return stage


def _seed_rows(ctx: LabContext, per_t: list[dict[str, Any]]) -> list[SeedRow]:
    temps = " / ".join(str(row["temperature"]) for row in per_t)
    return [
        SeedRow(
            f"top token's probability at T = {temps}",
            "not stated (the seed shows temperature in its video, 7:41)",
            " / ".join(f"{row['probs'][0]:.2f}" for row in per_t),
            f"ours: {ctx.setting}",
        ),
        SeedRow(
            f"entropy (bits) at T = {temps}",
            "not stated",
            " / ".join(f"{row['entropy_bits']:.1f}" for row in per_t),
            "over the whole vocabulary; higher T flattens the distribution and the entropy rises with it",
        ),
    ]


def _markdown(ctx: LabContext, results: dict[str, Any]) -> str:
    per_t = results["temperatures"]
    n = results["draws_per_temperature"]
    header = ["token", *(f"T = {row['temperature']}" for row in per_t)]
    rows: list[list[str]] = [
        [repr(token), *(f"{row['probs'][k]:.3f} ({row['drawn'][k]:.2f})" for row in per_t)]
        for k, token in enumerate(results["tokens"])
    ]
    shown = len(results["tokens"])
    rows.append([f"the {shown} tokens' total", *(f"{sum(row['probs']):.3f}" for row in per_t)])
    rows.append([f"drawn outside the {shown}", *(f"{row['drawn_outside_top10']:.2f}" for row in per_t)])
    rows.append(
        [
            "entropy, bits (exact)",
            *(f"{row['entropy_bits']:.2f}" for row in per_t),
        ]
    )
    rows.append(
        [
            "mean surprisal of the draws (± s.e.)",
            *(f"{row['entropy_estimate_bits']:.2f} ± {row['entropy_stderr_bits']:.2f}" for row in per_t),
        ]
    )
    return "\n\n".join(
        [
            f"Prompt (chat template): {results['prompt']!r}. {ctx.setting}. Each cell: p_T over the whole "
            f"vocabulary, then (in brackets) the share of {n} seeded draws that picked the token.",
            md_table(header, rows),
            "The probabilities are exact: the sampler's temperature stage as the trace records it "
            '(`trace_level: "full"`), entropy included. The mean surprisal -log2 p_T(x) of the drawn tokens '
            "estimates the same entropy from the draws alone: agreement within a few standard errors "
            "says the sampler draws from the distribution it reports.",
        ]
    )
