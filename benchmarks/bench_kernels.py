"""The native CPU kernels one by one, on the embedded model's own weights and shapes.

    python benchmarks/bench_kernels.py              # every kernel, batch 1 and 16, contexts 400 and 4,000
    python benchmarks/bench_kernels.py --rows 1,4   # other batch sizes
    python benchmarks/bench_kernels.py --against HEAD~1   # A/B the GEMMs against another revision's
    python benchmarks/bench_kernels.py --gemm 896x4864 --kinds q4,q5,q8b --rows 1,64   # one shape

What it times (the best of --repeats calls after a warm-up: on a shared machine the minimum is the
figure that repeats; each kernel called the way the engine calls it), and the bytes each call must read, so each line is also an achieved bandwidth:

  q4 gemm         each projection shape of one layer (the file's own 4-bit groups), M rows
  q8 logits       the tied embedding kept as the GGUF's Q8_0 int8, M rows
  gemm kinds      every stored-weight GEMM at the model's down_proj shape, random weights of each form,
                  called in turn (interleaved): q4 (Q4_0-style, half scales), q5 (Q5_0-style, half
                  scales), q5k (Q5_K-style, float32 scales), q8b (Q8_0), iq4 (IQ4_NL-style codebook
                  indices, half scales), f16, bf16 (the half GEMM),
                  and f32 (oneDNN on a prepacked float32 weight: what a weight without them runs)
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

--gemm NxK (out x in features) times only the `--kinds` GEMMs at that shape on random weights, interleaved
(a, b, c, a, b, c, ...), each kind's weights in enough copies (--copy-mib in all) that every call
reads them from memory, not a cache; it loads no model.

--against REV builds REV's onecall/kernels/cpu/csrc (git archive, same compiler and flags) beside this
tree's kernels and times the q4 and q8 GEMMs of both in turn (a, b, a, b, ...), so both see the same
moments of the machine: on a shared machine whose speed drifts by 25% between runs, two separate
runs cannot show a 10% change, an interleaved A/B can. It also says whether the two gave the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
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


GEMM_KINDS = ("q4", "q5", "q5k", "q8b", "iq4", "f16", "bf16", "f32")


def random_weight(kind: str, n: int, k: int, seed: int = 0) -> native.Packed | torch.Tensor:
    """An (n, k) weight of random values in `kind`'s stored form, packed for its kernel (f32: oneDNN's
    prepacked float32 weight, what a projection without a stored form runs on)."""
    g = torch.Generator().manual_seed(seed)
    groups = (n, k // 32)
    if kind in ("q4", "q5", "q5k"):
        q = torch.randint(0, 16 if kind == "q4" else 32, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(groups, generator=g) * 0.01
        offset = -torch.rand(groups, generator=g) * 0.1
        if kind != "q5k":  # Q4_0 / Q5_0 keep their scales in float16, Q5_K's are float32 products
            scale, offset = scale.half(), offset.half()
        return native.pack_q4(q, scale, offset) if kind == "q4" else native.pack_q5(q, scale, offset)
    if kind == "iq4":  # IQ4_NL-style: codebook indices, float16 scales (d)
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        return native.pack_iq4(codes, (torch.rand(groups, generator=g) * 0.01).half().float())
    if kind == "q8b":
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return native.pack_q8_blocked(q8, torch.rand(groups, generator=g) * 0.01)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "f32":
        return torch.ops.mkldnn._reorder_linear_weight(w, 16)
    return native.pack_half(w.to({"f16": torch.float16, "bf16": torch.bfloat16}[kind]))


def _nbytes(w: native.Packed | torch.Tensor, n: int, k: int) -> int:
    return n * k * 4 if isinstance(w, torch.Tensor) else w.nbytes


def _copies(w: native.Packed | torch.Tensor, nbytes: int, total_bytes: int) -> list[native.Packed | torch.Tensor]:
    """Enough copies of `w` to fill total_bytes (at least 2), so a loop over them streams from memory."""
    count = max(2, -(-total_bytes // nbytes))
    if isinstance(w, torch.Tensor):
        return [w.clone() for _ in range(count)]
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    tensors = [name for name, v in fields.items() if isinstance(v, torch.Tensor)]
    return [dataclasses.replace(w, **{name: fields[name].clone() for name in tensors}) for _ in range(count)]


def _gemms(lib: Any, x: torch.Tensor, weights: list[native.Packed | torch.Tensor]) -> None:
    for w in weights:
        if isinstance(w, torch.Tensor):
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        else:
            native.matmul(lib, x, w, None, torch.get_num_threads())


def bench_gemm_kinds(
    lib: Any, n: int, k: int, kinds: list[str], rows: list[int], repeats: int, copy_mib: int
) -> list[dict[str, Any]]:
    """Each kind's GEMM at (n, k), called in turn per repeat (a, b, c, a, b, c, ...) so every kind sees
    the same moments of a shared machine; per call the best time, GB/s of its weight bytes, and the bits
    a weight takes in that form (scales and padding included)."""
    one = {kind: random_weight(kind, n, k) for kind in kinds}
    nbytes = {kind: _nbytes(w, n, k) for kind, w in one.items()}
    weights = {kind: _copies(w, nbytes[kind], copy_mib * 2**20) for kind, w in one.items()}
    out = []
    for m in rows:
        x = torch.randn(m, k)
        fns: list[Callable[[], Any]] = [functools.partial(_gemms, lib, x, ws) for ws in weights.values()]
        for kind, s in zip(kinds, timed_pair(fns, repeats), strict=True):
            per_call = s / len(weights[kind])
            out.append({"kernel": f"gemm {kind} {n}x{k}", "rows": m, "us": per_call * 1e6,
                        "gb_per_s": nbytes[kind] / per_call / 1e9, "bits_per_weight": 8 * nbytes[kind] / (n * k)})  # fmt: skip
    return out


def print_rows(rows_out: list[dict[str, Any]]) -> None:
    print(f"{'kernel':44} {'rows/ctx':>9} {'us':>10} {'rate':>14} {'bits/w':>7}")
    for r in rows_out:
        rate = f"{r['gb_per_s']:.2f} GB/s" if "gb_per_s" in r else f"{r['gmac_per_s']:.1f} GMAC/s"
        bits = f"{r['bits_per_weight']:.2f}" if "bits_per_weight" in r else ""
        print(f"{r['kernel']:44} {r.get('rows', r.get('context')):>9} {r['us']:>10.1f} {rate:>14} {bits:>7}")


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
    ap.add_argument("--gemm", metavar="NxK", help="time only the --kinds GEMMs at this (out x in) shape")
    ap.add_argument("--kinds", default=",".join(GEMM_KINDS), help=f"with --gemm: of {', '.join(GEMM_KINDS)}")
    ap.add_argument("--copy-mib", type=int, default=256, help="with --gemm: MiB of weight copies per kind")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    lib = native.load()
    if lib is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    if args.gemm:
        n, k = (int(v) for v in args.gemm.lower().split("x"))
        kinds = args.kinds.split(",")
        if unknown := set(kinds) - set(GEMM_KINDS):
            raise SystemExit(f"unknown --kinds {', '.join(sorted(unknown))} (of {', '.join(GEMM_KINDS)})")
        timed_rows = bench_gemm_kinds(lib, n, k, kinds, rows, args.repeats, args.copy_mib)
        print_rows(timed_rows)
        print(json.dumps({"threads": args.threads, "kernels_timed": timed_rows}))
        return
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
    layer: Any = model.model.layers[0]
    down = layer.mlp.down_proj  # the shape of a projection the file stores in other forms too
    rows_out += bench_gemm_kinds(lib, down.out_features, down.in_features, list(GEMM_KINDS), rows, args.repeats, 64)
    rows_out += bench_attention(model, args.repeats, lib) + bench_prefill_attention(model, args.repeats, lib)
    rows_out += bench_step(llm, rows, args.repeats)
    print_rows(rows_out)
    results["kernels_timed"] = rows_out
    print(json.dumps(results))


if __name__ == "__main__":
    main()
