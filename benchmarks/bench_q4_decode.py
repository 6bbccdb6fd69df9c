"""The q4 GEMM at decode's one row, per shape, against a pure memory read of the same bytes.

    python benchmarks/bench_q4_decode.py                       # torch's thread count
    python benchmarks/bench_q4_decode.py --threads 1 --clock cpu   # one thread's CPU time: steadier when shared

For each (N, K) (default: a 1B Llama's projections, hidden 2048, intermediate 8192), Q4_K-like weights
(scale d x 6-bit sub-scale, offset -dmin x 6-bit min, per super-block of 8 groups of 32) are packed two
ways: float32 scales and offsets (native.pack_q4, what Q4_K projections read before) and super-block
factors (native.pack_q4_super, what they read now). Enough copies of each are made that one pass over
them (each copy multiplied by one activation row, in turn) reads at least --mib MiB, far more than the
L3 cache, so every pass streams from memory as a decode step does. The rounds alternate: factors, float32
scales, then a plain read of a buffer of the factors' bytes (torch's int64 sum over it, on the same
threads: what streaming those bytes costs with no arithmetic). Per variant the best round is kept.

Printed per shape: MB per copy and microseconds per call for each form, GB/s (bytes read / time), and
the time ratio float32 / factors (above 1: the factors are faster); then one JSON line. On a shared
machine compare ratios from one run, not GB/s across runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from functools import partial

import torch

from onecall.kernels.cpu import native

SHAPES = ((2048, 2048), (8192, 2048), (16384, 2048), (2048, 8192))


def _q4_k_like(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d, dmin = ((torch.rand(n, k // 256, 1, generator=gen) * 1e-2 + 1e-4).half().float() for _ in range(2))
    sc = torch.randint(0, 64, (n, k // 256, 8), generator=gen).float()
    mn = torch.randint(0, 64, (n, k // 256, 8), generator=gen).float()
    sc[..., 0], mn[..., 0] = 63, 63  # llama.cpp's quantizer maps a super-block's largest to 63
    return q, (d * sc).reshape(n, -1), -(dmin * mn).reshape(n, -1)


def _pass(lib: ctypes.CDLL, x: torch.Tensor, ws: list[native.Q4Packed], threads: int) -> None:
    """One activation row through every copy in turn: a decode step's stream over that many bytes."""
    for w in ws:
        native.q4_gemm(lib, x, w, None, threads)


def _time(fn: Callable[[], object], rounds: list[float], clock: Callable[[], float]) -> None:
    start = clock()
    fn()
    rounds.append(clock() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib", type=int, default=96, help="bytes one pass reads, per form")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (with --threads 1)",
    )
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures one thread's time: use it with --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    lib = native.load()
    if lib is None:
        raise SystemExit("the native kernels are unavailable")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    print(
        "| N | K | MB (f32 / factors) | us f32 | us factors | GB/s f32 | GB/s factors | GB/s read | f32 / factors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        q, scale, offset = _q4_k_like(n, k, gen)
        one = native.pack_q4_super(q, scale, offset)
        assert one is not None
        copies = max(2, -(-args.mib * 2**20 // one.nbytes))
        plain = [native.pack_q4(q, scale, offset) for _ in range(copies)]
        factors = [one] + [native.pack_q4(q, scale, offset) for _ in range(copies - 1)]
        factors[1:] = [native.Q4Packed(p.qs, one.scale.clone(), one.offset, n, k) for p in factors[1:]]
        read = torch.ones(sum(w.nbytes for w in factors) // 8, dtype=torch.int64)
        x = torch.randn(1, k)

        times: dict[str, list[float]] = {"factors": [], "f32": [], "read": []}
        passes = {
            "factors": partial(_pass, lib, x, factors, args.threads),
            "f32": partial(_pass, lib, x, plain, args.threads),
        }
        passes["read"] = read.sum
        for fn in passes.values():  # warm: pages touched, threads started
            fn()
        for _ in range(args.rounds):
            for key, fn in passes.items():
                _time(fn, times[key], clock)
        t = {key: min(v) for key, v in times.items()}
        mb_f32, mb_fac = plain[0].nbytes / 1e6, one.nbytes / 1e6
        row = {
            "n": n, "k": k, "copies": copies, "mb_f32": mb_f32, "mb_factors": mb_fac,
            "us_f32": t["f32"] / copies * 1e6, "us_factors": t["factors"] / copies * 1e6,
            "gbps_f32": mb_f32 * copies / t["f32"] / 1e3, "gbps_factors": mb_fac * copies / t["factors"] / 1e3,
            "gbps_read": read.numel() * 8 / t["read"] / 1e9, "ratio": t["f32"] / t["factors"],
        }  # fmt: skip
        results.append(row)
        print(
            f"| {n} | {k} | {mb_f32:.2f} / {mb_fac:.2f} | {row['us_f32']:.0f} | {row['us_factors']:.0f} | "
            f"{row['gbps_f32']:.1f} | {row['gbps_factors']:.1f} | {row['gbps_read']:.1f} | {row['ratio']:.2f}x |"
        )
    print(
        json.dumps({"threads": args.threads, "rounds": args.rounds, "clock": args.clock, "shapes": results})
    )


if __name__ == "__main__":
    main()
