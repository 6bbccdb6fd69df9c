"""Experiment 4: prefill against decode, and how close decode runs to the memory's speed.

    for each prompt length P (64 ... 2,048, capped by the context window):
        one request: P random token ids (never cached) -> prefill -> D decode steps (ignore_eos)
        prefill tokens/s = trace.num_prefilled_tokens / trace.prefill_time
        decode tokens/s  = decode steps / trace.decode_time
        decode bandwidth = sum over decode steps of (weight bytes + KV bytes read) / their time
    copy bandwidth: the best of 5 copies of a 256 MiB tensor (read + write), measured on the spot

Why the gap: prefill pushes all P tokens through every weight matrix at once (one weight read
shared by P rows, compute-bound), decode reads every weight for one token (bandwidth-bound).
A decode step at context c reads the weights once plus the K and V of c positions in every layer
(LLM.info: ModelInfo.decode_step_bytes):
    bytes(c) = weight_bytes + 2 * layers * kv_heads * head_dim * kv_cache_dtype_bytes * c

Prompts are seeded random ids from the non-control vocabulary with a distinct first token per
request, so the token-level prefix cache never matches (checked: trace.num_cached_tokens).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from onecall import LLM, ModelInfo, RequestOutput, SamplingParams
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import line_plot
from onecall.lab.report import md_table

NAME = "prefill_decode"
TITLE = "Prefill against decode: input tokens/s, output tokens/s and memory bandwidth"

FULL_LENGTHS = (64, 128, 256, 512, 1024, 2048)
QUICK_LENGTHS = (64, 256)
RATIO_LENGTH = 1024  # the seed's ratio is at a 1,024-token prompt
SEED_PREFILL_TPS, SEED_DECODE_TPS = 7672.0, 15.5
SEED_RATIO = "494x"  # as the seed states it
SEED_WEIGHT_GIB = 15.3  # "has to read all 15.3 GiB of weights each time"
COPY_BYTES, COPY_REPEATS = 256 * 2**20, 5


@dataclass
class LengthRun:
    """One prompt length's measurement (the best of `repeats` requests, each figure on its own)."""

    prompt_tokens: int
    num_cached_tokens: int  # 0 unless the cache matched (it should not)
    num_prefilled_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float
    decode_steps: int
    decode_s: float
    decode_tokens_per_s: float
    bytes_per_decode_step: float  # mean over the decode steps: weights + KV read
    decode_gb_per_s: float


def run(ctx: LabContext) -> ExperimentResult:
    llm = ctx.llm
    decode_tokens, repeats = (8, 1) if ctx.quick else (32, 2)
    lengths = [
        n
        for n in (QUICK_LENGTHS if ctx.quick else FULL_LENGTHS)
        if n + decode_tokens <= llm.info.max_model_len
    ]
    if not lengths:
        lengths = [llm.info.max_model_len - decode_tokens - 1]
    prompts = _PromptSource(llm)

    # 1. warm-up: a prompt and a few decode steps, so neither kernel's one-time setup is timed
    llm.generate(prompts.next(32), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    # 2. one request per length (and repeat), decode tokens fixed, greedy
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    runs: list[LengthRun] = []
    for n in lengths:
        ctx.progress(f"prefill_decode: {n}-token prompt, {decode_tokens} decode steps x{repeats}")
        measured = [_measure(llm.generate(prompts.next(n), params)[0], llm.info) for _ in range(repeats)]
        runs.append(_best(measured))

    # 3. the machine's copy bandwidth, measured now (the same load as the decode steps saw)
    ctx.progress("prefill_decode: copy bandwidth")
    copy_gb_per_s = copy_bandwidth(torch.device(llm.info.device)) / 1e9

    # 4. report
    at = max(
        (r for r in runs if r.prompt_tokens <= RATIO_LENGTH), key=lambda r: r.prompt_tokens, default=runs[0]
    )
    ratio = at.prefill_tokens_per_s / at.decode_tokens_per_s
    results: dict[str, Any] = {
        "runs": [asdict(r) for r in runs],
        "output_tokens": decode_tokens,
        "repeats": repeats,
        "ratio_prompt_tokens": at.prompt_tokens,
        "ratio": ratio,
        "weight_bytes_per_step": llm.info.weight_bytes_per_step,
        "kv_bytes_per_token": llm.info.kv_bytes_per_token,
        "copy_gb_per_s": copy_gb_per_s,
        "decode_gb_per_s_at_ratio_length": at.decode_gb_per_s,
        "fraction_of_copy_at_ratio_length": at.decode_gb_per_s / copy_gb_per_s,
        "max_model_len": llm.info.max_model_len,
    }
    plot = line_plot(
        ctx.out_dir / "prefill_decode.png",
        [r.prompt_tokens for r in runs],
        {
            "prefill tokens/s": [r.prefill_tokens_per_s for r in runs],
            "decode tokens/s": [r.decode_tokens_per_s for r in runs],
        },
        title=f"Prefill vs decode, {llm.info.model_name}",
        xlabel="prompt tokens",
        ylabel="tokens/s (log)",
        logy=True,
        logx=True,
    )
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        results=results,
        seed_rows=_seed_rows(ctx, at, ratio, copy_gb_per_s),
        markdown=_markdown(ctx, runs, results),
        plots=[plot],
    )


class _PromptSource:
    """Seeded random prompts of non-control ids; request k starts with the k-th id of the pool, so
    no two prompts share a first token and the prefix cache can never match one."""

    def __init__(self, llm: LLM) -> None:
        special = llm.tokenizer.special_ids
        self._pool = [i for i in range(llm.tokenizer.vocab_size) if i not in special]
        self._rng = random.Random(0)
        self._count = 0

    def next(self, num_tokens: int) -> list[int]:
        first = self._pool[self._count % len(self._pool)]
        self._count += 1
        return [first, *self._rng.choices(self._pool, k=num_tokens - 1)]


def _measure(out: RequestOutput, info: ModelInfo) -> LengthRun:
    t = out.trace
    decode = [s for s in t.steps if s.kind == "decode"]
    assert decode and t.prefill_time > 0, "ignore_eos with max_tokens > 1 gives a prefill and decode steps"
    # decode step j feeds the token at position P + j: it attends over P + j + 1 positions
    step_bytes = [info.decode_step_bytes(t.num_prompt_tokens + j + 1) for j in range(len(decode))]
    decode_s = sum(s.duration for s in decode)
    return LengthRun(
        prompt_tokens=t.num_prompt_tokens,
        num_cached_tokens=t.num_cached_tokens,
        num_prefilled_tokens=t.num_prefilled_tokens,
        prefill_s=t.prefill_time,
        prefill_tokens_per_s=t.num_prefilled_tokens / t.prefill_time,
        decode_steps=len(decode),
        decode_s=decode_s,
        decode_tokens_per_s=len(decode) / decode_s,
        bytes_per_decode_step=sum(step_bytes) / len(step_bytes),
        decode_gb_per_s=sum(step_bytes) / decode_s / 1e9,
    )


def _best(runs: list[LengthRun]) -> LengthRun:
    """Prefill figures from the fastest prefill, decode figures from the fastest decode."""
    p = max(runs, key=lambda r: r.prefill_tokens_per_s)
    d = max(runs, key=lambda r: r.decode_tokens_per_s)
    return LengthRun(
        **{k: v for k, v in asdict(p).items() if not k.startswith(("decode", "bytes"))},
        **{k: v for k, v in asdict(d).items() if k.startswith(("decode", "bytes"))},
    )


def copy_bandwidth(device: torch.device, num_bytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """Bytes/s of copying a float32 tensor into a preallocated one, read + write counted, best of
    `repeats` after one warm-up copy. Both buffers are touched first, so no page faults are timed."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # (num_bytes / 4,)
    y = torch.zeros_like(x)
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        if i:  # copy 0 only warms up
            best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seed_rows(ctx: LabContext, at: LengthRun, ratio: float, copy_gb_per_s: float) -> list[SeedRow]:
    length = f"{at.prompt_tokens:,}-token prompt"
    seed_gb_per_s = SEED_WEIGHT_GIB * 2**30 * SEED_DECODE_TPS / 1e9
    mb_per_step = at.bytes_per_decode_step / 1e6
    device = torch.device(ctx.llm.info.device)
    compute = (
        f"one {torch.cuda.get_device_name(device)}"
        if device.type == "cuda"
        else f"{torch.get_num_threads()} CPU threads"
    )
    return [
        SeedRow(
            f"prefill tokens/s, {length}",
            f"{SEED_PREFILL_TPS:,.0f}",
            f"{at.prefill_tokens_per_s:,.0f}",
            f"prefill is compute-bound (every prompt token shares each weight read): an A100 against "
            f"{compute} here, and 8B parameters in the seed",
        ),
        SeedRow(
            f"decode tokens/s, {length}",
            f"{SEED_DECODE_TPS}",
            f"{at.decode_tokens_per_s:,.1f}",
            f"each decode step streams every weight: {mb_per_step:,.0f} MB per step here, "
            f"{SEED_WEIGHT_GIB} GiB in the seed",
        ),
        SeedRow(
            f"prefill / decode per token, {length}",
            SEED_RATIO,
            f"{ratio:,.0f}x",
            f"prefill shares each weight read across the prompt's tokens, decode cannot; how much that "
            f"buys depends on the compute available ({compute} here, an A100 in the seed)",
        ),
        SeedRow(
            "decode memory bandwidth achieved",
            f"~{seed_gb_per_s:,.0f} GB/s (derived: {SEED_WEIGHT_GIB} GiB x {SEED_DECODE_TPS} steps/s)",
            f"{at.decode_gb_per_s:,.2f} GB/s ({100 * at.decode_gb_per_s / copy_gb_per_s:.0f}% "
            f"of {copy_gb_per_s:,.1f} GB/s copy)",
            "the seed states no bandwidth; its figure is derived from its weight size and decode rate",
        ),
    ]


def _markdown(ctx: LabContext, runs: list[LengthRun], results: dict[str, Any]) -> str:
    copy = results["copy_gb_per_s"]
    header = [
        "prompt tokens",
        "cached",
        "prefill s",
        "prefill tok/s",
        "decode tok/s",
        "prefill/decode",
        "MB read per decode step",
        "decode GB/s",
        "of copy bandwidth",
    ]
    rows = [
        [
            f"{r.prompt_tokens:,}",
            r.num_cached_tokens,
            f"{r.prefill_s:.3f}",
            f"{r.prefill_tokens_per_s:,.0f}",
            f"{r.decode_tokens_per_s:,.1f}",
            f"{r.prefill_tokens_per_s / r.decode_tokens_per_s:,.0f}x",
            f"{r.bytes_per_decode_step / 1e6:,.1f}",
            f"{r.decode_gb_per_s:,.2f}",
            f"{100 * r.decode_gb_per_s / copy:.0f}%",
        ]
        for r in runs
    ]
    n = results["output_tokens"]
    return "\n\n".join(
        [
            f"{ctx.setting}; greedy, {n} output tokens (ignore_eos: the first from the prefill step, then "
            f"{n - 1} decode steps), best of {results['repeats']}; random prompt ids, so the prefix cache "
            "never helps.",
            md_table(header, rows),
            f"A decode step reads {results['weight_bytes_per_step'] / 1e6:,.1f} MB of weights (as the kernels "
            f"store them) plus {results['kv_bytes_per_token'] / 1e3:,.1f} KB of K and V per cached position. "
            f"The machine copies memory at {copy:,.1f} GB/s (a {COPY_BYTES // 2**20} MiB tensor, read + "
            f"write, best of {COPY_REPEATS}). Step times include sampling and Python dispatch, so the "
            "achieved figure is a lower bound on what the matmuls alone stream.",
        ]
    )
