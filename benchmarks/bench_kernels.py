"""The native CPU kernels one by one, on the embedded model's own weights and shapes.

    python benchmarks/bench_kernels.py              # every kernel, batch 1 and 16, contexts 400 and 4,000
    python benchmarks/bench_kernels.py --rows 1,4   # other batch sizes
    python benchmarks/bench_kernels.py --against HEAD~1   # A/B the GEMMs against another revision's

What it times (the best of --repeats calls after a warm-up: on a shared machine the minimum is the
figure that repeats; each kernel called the way the engine calls it), and the bytes each call must read, so each line is also an achieved bandwidth:

  q4 gemm         each projection shape of one layer (the file's own 4-bit groups), M rows
  q8 logits       the tied embedding kept as the GGUF's Q8_0 int8, M rows
  attention       one layer's decode attention at a context of 400 and 4,000 positions, float32 and
                  float16 cache; beside it SDPA over a view of the cache (the prompt path's read)
  prefill attn    one layer's causal prompt attention: a fresh 1,024-token prompt and a 512-row chunk
                  after 512 cached positions (the engine's default chunking), the native kernel
                  (float32 and float16 cache) against SDPA's flash kernel over a view of the cache,
                  called in turn (interleaved) so both see the same machine; GMAC/s of useful
                  causal work (the two products, the masked half not counted)
  decode step     the whole native decode forward (loading/native_step.py: every layer, one call) and
                  the per-op path (the same kernels called from Python), M rows, context 12
  copy            a 512 MiB float32 copy (read + write), the machine's bandwidth yardstick

The weights of the four projection shapes are read from L3/DRAM in a loop over 30 layers' worth of
copies, so the figure is not a cache-resident one. The last line is one JSON object.

--against REV builds REV's onecall/kernels/cpu/csrc (git archive, same compiler and flags) beside this
tree's kernels and times the q4 and q8 GEMMs of both in turn (a, b, a, b, ...), so both see the same
moments of the machine: on a shared machine whose speed drifts by 25% between runs, two separate
runs cannot show a 10% change, an interleaved A/B can. It also says whether the two gave the same bits.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onecall import LLM
from onecall.kernels.cpu import native, native_build
from onecall.kernels.cpu.fast_linear import FastLinear
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.kv_cache import PagedKVCache


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Best (minimum) seconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timed_pair(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Best seconds of each fn, called in turn (a, b, a, b, ...) after a warm-up of each: an A/B
    where both sides see the same moments of a noisy machine."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def copy_bandwidth(num_bytes: int = 512 * 2**20) -> float:
    x = torch.ones(num_bytes // 4)
    y = torch.zeros_like(x)
    return 2 * num_bytes / timed(lambda: y.copy_(x), 3)


def _q4_layers(lib: Any, mods: list[FastLinear], x: torch.Tensor) -> None:
    for mod in mods:
        assert mod.q4 is not None
        native.q4_gemm(lib, x, mod.q4, mod.bias, torch.get_num_threads())


def bench_q4(model: Any, rows: list[int], repeats: int, lib: Any) -> list[dict[str, Any]]:
    """Each projection of every layer in turn (so weights stream from memory, as in a real step)."""
    out = []
    layers = list(model.model.layers)
    for owner, name in (
        ("self_attn", "qkv_proj"),
        ("self_attn", "o_proj"),
        ("mlp", "gate_up_proj"),
        ("mlp", "down_proj"),
    ):
        mods: list[FastLinear] = [getattr(getattr(layer, owner), name) for layer in layers]
        q4 = mods[0].q4
        assert q4 is not None, "the embedded model's projections are 4-bit"
        nbytes = q4.nbytes
        for m in rows:
            x = torch.randn(m, mods[0].in_features)
            s = timed(functools.partial(_q4_layers, lib, mods, x), repeats) / len(mods)
            out.append({"kernel": f"q4 {name} {mods[0].out_features}x{mods[0].in_features}", "rows": m,
                        "us": s * 1e6, "gb_per_s": nbytes / s / 1e9})  # fmt: skip
    return out


_CSRC_PATHS = ("onecall/kernels/cpu/csrc", "onecall/model/csrc")  # where the sources are, newest first


def other_revision(rev: str, tmp: Path) -> Any:
    """REV's kernel sources (where that revision keeps them), built and loaded (native_build.load_from)."""
    repo = Path(__file__).resolve().parent.parent
    for path in _CSRC_PATHS:
        tar = subprocess.run(["git", "-C", str(repo), "archive", rev, path], capture_output=True)
        if tar.returncode == 0:
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=tar.stdout, check=True)
            return native_build.load_from(tmp / path, tmp)
    raise SystemExit(f"{rev} has no kernel sources at {' or '.join(_CSRC_PATHS)}")


def ab_gemms(
    model: Any, rows: list[int], repeats: int, lib: Any, other: Any, rev: str
) -> list[dict[str, Any]]:
    """This tree's q4 and q8 GEMMs against REV's, interleaved, on the same weights and inputs."""
    out = []
    layers = list(model.model.layers)
    cases: list[tuple[str, Callable[[Any, torch.Tensor], Any], int]] = []
    for owner, name in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
        mods: list[FastLinear] = [getattr(getattr(layer, owner), name) for layer in layers]
        q4s = [m.q4 for m in mods]
        assert all(q is not None for q in q4s), "the embedded model's projections are 4-bit"

        def q4(lib: Any, x: torch.Tensor, q4s: list[Any] = q4s, mods: list[FastLinear] = mods) -> Any:
            return [native.q4_gemm(lib, x, q, m.bias, torch.get_num_threads()) for q, m in zip(q4s, mods)]

        cases.append(
            (
                f"q4 {name} {mods[0].out_features}x{mods[0].in_features} (x{len(mods)})",
                q4,
                mods[0].in_features,
            )
        )
    head = model.fast_lm_head
    if head is not None and head.q8 is not None:
        w = head.q8

        def q8(lib: Any, x: torch.Tensor) -> Any:
            return [native.q8_blocked_gemm(lib, x, w, None, torch.get_num_threads())]

        cases.append((f"q8 logits {w.out_features}x{w.in_features}", q8, w.in_features))
    for label, fn, k in cases:
        for m in rows:
            x = torch.randn(m, k)
            same = all(torch.equal(a, b) for a, b in zip(fn(lib, x), fn(other, x)))
            ours, theirs = timed_pair(
                [functools.partial(fn, lib, x), functools.partial(fn, other, x)], repeats
            )
            out.append({"kernel": label, "rows": m, "us": ours * 1e6, f"us_{rev}": theirs * 1e6,
                        "speedup": theirs / ours, "same_bits": same})  # fmt: skip
    return out


def bench_q8(model: Any, rows: list[int], repeats: int, lib: Any) -> list[dict[str, Any]]:
    head = model.fast_lm_head
    if head is None or head.q8 is None:
        return []
    w = head.q8
    out = []
    for m in rows:
        x = torch.randn(m, w.in_features)
        s = timed(
            functools.partial(native.q8_blocked_gemm, lib, x, w, None, torch.get_num_threads()), repeats
        )
        out.append({"kernel": f"q8 logits {w.out_features}x{w.in_features}", "rows": m, "us": s * 1e6,
                    "gb_per_s": w.nbytes / s / 1e9})  # fmt: skip
    return out


def bench_attention(model: Any, repeats: int, lib: Any) -> list[dict[str, Any]]:
    c = model.config
    h, kvh, d, bs = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 16
    out = []
    for ctx in (400, 4000):
        for dtype in (torch.float32, torch.float16):
            num_blocks = -(-ctx // bs)
            k = torch.randn(num_blocks * bs, kvh, d).to(dtype)
            v = torch.randn(num_blocks * bs, kvh, d).to(dtype)
            tables = torch.arange(num_blocks, dtype=torch.int32)[None]
            lens = torch.tensor([ctx], dtype=torch.int32)
            q = torch.randn(1, h, d)
            nbytes = 2 * ctx * kvh * d * k.element_size()
            attend = functools.partial(
                native.paged_decode_attention,
                lib,
                q,
                k,
                v,
                tables,
                lens,
                bs,
                d**-0.5,
                torch.get_num_threads(),
            )
            s = timed(attend, repeats)
            out.append({"kernel": f"attention native {str(dtype)[6:]} cache", "context": ctx, "us": s * 1e6,
                        "gb_per_s": nbytes / s / 1e9})  # fmt: skip
            if dtype == torch.float32:
                kv, vv = k[:ctx].transpose(0, 1)[None], v[:ctx].transpose(0, 1)[None]
                qg = q.view(1, kvh, h // kvh, d)
                s = timed(
                    functools.partial(F.scaled_dot_product_attention, qg, kv, vv, scale=d**-0.5), repeats
                )
                out.append({"kernel": "attention SDPA over a cache view", "context": ctx, "us": s * 1e6,
                            "gb_per_s": nbytes / s / 1e9})  # fmt: skip
    return out


def bench_prefill_attention(model: Any, repeats: int, lib: Any) -> list[dict[str, Any]]:
    c = model.config
    h, kvh, d, bs = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 16
    threads, scale = torch.get_num_threads(), d**-0.5
    out = []
    for query_len, seq_len in ((1024, 1024), (512, 1024)):
        k = torch.randn(seq_len, kvh, d)
        v = torch.randn(seq_len, kvh, d)
        k16, v16 = k.half(), v.half()
        q = torch.randn(query_len, h, d)
        cached = seq_len - query_len
        mask = None if cached == 0 else torch.ones(query_len, seq_len, dtype=torch.bool).tril(cached)
        sdpa = functools.partial(
            F.scaled_dot_product_attention, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )  # fmt: skip
        fns = [
            functools.partial(native.prefill_attention, lib, q, kk, vv, seq_len, 0, None, bs, scale, threads)
            for kk, vv in ((k, v), (k16, v16))
        ]
        macs = 2 * h * d * sum(cached + i + 1 for i in range(query_len))  # QK^T and PV, visible keys only
        names = (
            "prefill attn native f32 cache",
            "prefill attn native f16 cache",
            "prefill attn SDPA (flash)",
        )
        for name, s in zip(names, timed_pair([*fns, sdpa], repeats), strict=True):
            out.append(
                {
                    "kernel": name,
                    "rows": f"{query_len}/{seq_len}",
                    "us": s * 1e6,
                    "gmac_per_s": macs / s / 1e9,
                }
            )
    return out


def _forward(model: Any, ids: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, meta: Any) -> None:
    meta.num_decode = ids.shape[0]  # every row a decode row
    with torch.inference_mode():
        model(ids, pos, cache, meta)


def bench_step(llm: LLM, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    model = llm.engine.parts.model
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 64, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    cache.k.zero_(), cache.v.zero_()
    weight_bytes = llm.weight_bytes_read(1) - model.fast_lm_head.weight_bytes_read()
    out = []
    step = model.native_step
    for m in rows:
        tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(m)]
        meta = build_attention_metadata(tables, [12] * m, [1] * m, 16, "cpu")
        ids = torch.arange(m) + 100
        pos = torch.full((m,), 11)
        for name, s_ in (("native decode step (all layers)", step), ("per-op decode (same kernels)", None)):
            if name.startswith("native") and step is None:
                continue
            model.native_step = s_
            s = timed(functools.partial(_forward, model, ids, pos, cache, meta), repeats)
            out.append({"kernel": name, "rows": m, "us": s * 1e6, "gb_per_s": weight_bytes / s / 1e9})
        model.native_step = step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16", help="batch sizes (rows per call)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="REV", help="A/B the GEMMs against this git revision's kernels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    lib = native.load()
    if lib is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    llm = LLM(kv_cache_gib=0.1)
    model = llm.engine.parts.model
    results: dict[str, Any] = {"kernels": llm.engine.parts.kernels, "threads": args.threads}
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            other = other_revision(args.against, Path(tmp))
            ab = ab_gemms(model, rows, args.repeats, lib, other, args.against)
        print(
            f"{'kernel':44} {'rows':>5} {'this tree us':>13} {args.against + ' us':>14} {'speedup':>8}  bits"
        )
        for r in ab:
            same = "same" if r["same_bits"] else "DIFFER"
            print(f"{r['kernel']:44} {r['rows']:>5} {r['us']:>13.1f} {r[f'us_{args.against}']:>14.1f} "
                  f"{r['speedup']:>7.2f}x  {same}")  # fmt: skip
        print(json.dumps({**results, "against": args.against, "ab": ab}))
        return
    results["copy_gb_per_s"] = copy_bandwidth() / 1e9
    print(f"copy bandwidth (read + write): {results['copy_gb_per_s']:.1f} GB/s; {results['kernels']}")
    rows_out = bench_q4(model, rows, args.repeats, lib) + bench_q8(model, rows, args.repeats, lib)
    rows_out += bench_attention(model, args.repeats, lib) + bench_prefill_attention(model, args.repeats, lib)
    rows_out += bench_step(llm, rows, args.repeats)
    print(f"{'kernel':44} {'rows/ctx':>9} {'us':>10} {'rate':>14}")
    for r in rows_out:
        rate = f"{r['gb_per_s']:.2f} GB/s" if "gb_per_s" in r else f"{r['gmac_per_s']:.1f} GMAC/s"
        print(f"{r['kernel']:44} {r.get('rows', r.get('context')):>9} {r['us']:>10.1f} {rate:>14}")
    results["kernels_timed"] = rows_out
    print(json.dumps(results))


if __name__ == "__main__":
    main()
