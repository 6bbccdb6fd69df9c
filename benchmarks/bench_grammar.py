"""What a grammar mask costs: per-token mask time and decode speed with and without a JSON schema.

    python benchmarks/bench_grammar.py            # batch 1 and batch 8, 3 rounds each
    python benchmarks/bench_grammar.py --quick    # 1 round, fewer tokens

On the embedded model (SmolLM2-135M, 49,152-token vocabulary), all in one process and interleaved
round by round, so both sides see the same machine load:

  batch 1   one unconstrained request vs one constrained by a JSON schema: time per decode step
            (trace: decode time / decode steps) and the per-token mask time (fill + apply) p50/p99
  batch 8   8 unconstrained requests vs a mixed batch of 4 constrained + 4 unconstrained: the
            unconstrained requests' time per decode step in each (the issue's "unconstrained
            requests in a mixed batch no slower than in an unconstrained batch")

Goal (issue 4): under 10% time-per-token overhead at batch 1. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from onecall import LLM, SamplingParams, StructuredOutputsParams

# Long enough to keep a small model generating: a list of records with free-text fields.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "notes": {"type": "string"}},
                "required": ["name", "notes"],
            },
        },
    },
    "required": ["title", "items"],
}
PROMPT = "List the planets of the solar system with a note on each, as JSON."


def step_time(out: Any) -> float:
    """Seconds per decode step of one finished request (forward + sampling + masks, whole batch)."""
    steps = [s for s in out.trace.steps if s.kind == "decode"]
    return sum(s.duration for s in steps) / len(steps)


def mask_times(out: Any) -> list[float]:
    return [s.mask_time for s in out.trace.steps if s.num_allowed is not None]


def run_batch(llm: LLM, num_constrained: int, num_free: int, max_tokens: int) -> tuple[list[Any], list[Any]]:
    """One batch; returns (constrained outputs, unconstrained outputs)."""
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [
        [{"role": "user", "content": f"{PROMPT} (request {i})"}] for i in range(num_constrained + num_free)
    ]
    params = [constrained] * num_constrained + [free] * num_free
    outs = llm.chat(prompts, params)
    return outs[:num_constrained], outs[num_constrained:]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, max_tokens = (1, 32) if args.quick else (args.rounds, args.max_tokens)

    llm = LLM(enable_prefix_caching=False)
    run_batch(llm, 1, 1, 8)  # warm-up: builds llguidance's tokenizer and compiles the schema once

    r: dict[str, list[float]] = {
        k: [] for k in ("b1_free", "b1_json", "b8_free", "b8_mixed_free", "b8_mixed_json")
    }
    masks_b1: list[float] = []
    masks_b8: list[float] = []
    t0 = time.perf_counter()
    for _ in range(rounds):
        _, free = run_batch(llm, 0, 1, max_tokens)
        r["b1_free"].append(step_time(free[0]))
        con, _ = run_batch(llm, 1, 0, max_tokens)
        r["b1_json"].append(step_time(con[0]))
        masks_b1 += mask_times(con[0])
        _, free = run_batch(llm, 0, 8, max_tokens)
        r["b8_free"] += [step_time(o) for o in free]
        con, free = run_batch(llm, 4, 4, max_tokens)
        r["b8_mixed_free"] += [step_time(o) for o in free]
        r["b8_mixed_json"] += [step_time(o) for o in con]
        masks_b8 += [m for o in con for m in mask_times(o)]
    med = {k: statistics.median(v) for k, v in r.items()}

    print(
        f"\ngrammar mask cost, {llm.engine.parts.model_name}, {rounds} round(s), max_tokens {max_tokens}"
        f" ({time.perf_counter() - t0:.0f} s)"
    )
    print(f"{'':<44}{'ms/step':>10}{'tok/s':>10}")
    rows = [
        ("batch 1, unconstrained", "b1_free"),
        ("batch 1, JSON schema", "b1_json"),
        ("batch 8, all unconstrained", "b8_free"),
        ("batch 8 mixed, the unconstrained requests", "b8_mixed_free"),
        ("batch 8 mixed, the constrained requests", "b8_mixed_json"),
    ]
    for label, key in rows:
        per_seq = 1.0 / med[key] * (8 if key.startswith("b8") else 1)
        print(f"{label:<44}{med[key] * 1e3:>10.1f}{per_seq:>10.1f}")
    overhead_b1 = med["b1_json"] / med["b1_free"] - 1
    mixed_ratio = med["b8_mixed_free"] / med["b8_free"]
    print(
        f"\nmask time per token (fill + apply), batch 1: p50 {pct(masks_b1, 0.5) * 1e6:.0f} us,"
        f" p99 {pct(masks_b1, 0.99) * 1e6:.0f} us; in the mixed batch: p50 {pct(masks_b8, 0.5) * 1e6:.0f} us,"
        f" p99 {pct(masks_b8, 0.99) * 1e6:.0f} us"
    )
    print(
        f"batch-1 time-per-token overhead of the schema: {overhead_b1:+.1%} (goal < 10%:"
        f" {'met' if overhead_b1 < 0.10 else 'NOT met'})"
    )
    print(f"unconstrained requests, mixed batch vs unconstrained batch: {mixed_ratio:.3f}x time per step")
    print(json.dumps({
        "bench": "bench_grammar", "rounds": rounds, "max_tokens": max_tokens,
        "ms_per_step": {k: v * 1e3 for k, v in med.items()},
        "mask_us": {"b1_p50": pct(masks_b1, 0.5) * 1e6, "b1_p99": pct(masks_b1, 0.99) * 1e6,
                    "b8_p50": pct(masks_b8, 0.5) * 1e6, "b8_p99": pct(masks_b8, 0.99) * 1e6},
        "b1_overhead": overhead_b1, "mixed_vs_free": mixed_ratio,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
