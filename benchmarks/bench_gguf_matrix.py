"""onecall against llama.cpp on the GGUF files users download: every shape x llama.cpp preset.

    python benchmarks/make_gguf_mixes.py --shapes qwen2-0.5b --presets Q4_K_M,Q8_0       # the files
    python benchmarks/bench_gguf_matrix.py --shapes qwen2-0.5b --presets Q4_K_M,Q8_0 --repeats 2
    python benchmarks/bench_gguf_matrix.py --files /tmp/onecall-mixes/llama-1b-Q4_K_M.gguf
    python benchmarks/bench_gguf_matrix.py --only onecall,onecall-int8,llamacpp      # both onecalls

The files are benchmarks/make_gguf_mixes.py's: random-weight models in llama.cpp's converter layout,
quantized by llama.cpp's own quantizer, so each holds the per-tensor mix of types that a preset
really makes (Q4_K_M is Q4_K with Q6_K in places, and Q5_0/Q8_0 fallbacks where a row is not a
multiple of 256 wide). The embedded SmolLM2 Q4_1 file that bench_engine.py measures is not such a file.

Per file, both engines run in one interleaved run with bench_engine.py's machinery (each in its own
fresh process, see _peers.py; each timed run goes to every engine in turn, first engine rotating, so
a ratio compares runs from the same minutes of a machine whose speed drifts by tens of percent):

  cold start     wall seconds from spawning the engine's process to its first generated token of
                 a short chat turn (imports, load, template, prefill): a second start, as a user's
                 every start after the first is (each onecall variant is started once, untimed, before
                 the timed start, so its pack cache, loading/pack_cache.py, holds the file; the table
                 says whether the timed start mapped it: "pack cache hit")
  prefill        tokens/s of the forward of a --prefill-len (512) token prompt producing one
                 token; best of --repeats, each repeat a different prompt
  decode         tokens/s at batch 1, greedy, EOS ignored, --decode-tokens (64) after a short
                 prompt, the first token (prefill) excluded; best of --repeats
  long decode    the same, --long-tokens (16) after a --long-context (1024) token prompt; best of
                 --repeats
  concurrent     --concurrent (16) short prompts x --decode-tokens each: generated tokens / wall
                 seconds; best of --repeats. onecall: one LLM.generate over all of them (continuous
                 batching). llama.cpp: llama-cpp-python has no in-process batching server, so its
                 high-level API serves them one after another, stopping after --sequential-budget
                 seconds (requests cost about the same, so the rate over those done stands for all)
  memory         resident set after load + the first token, and the process's peak (the file's
                 mapped pages count where touched), beside the file size and each engine's KV pool
                 (onecall: the allocated paged pool; llama.cpp: its n_ctx cache, F16 K and V); and
                 the resident set after load beyond what it held once its libraries were imported
                 (torch alone is ~230 MB of onecall's): what the model and its buffers take

Ratios are onecall / llama.cpp (above 1 is onecall faster; for cold start and memory, below 1 is
onecall leaner): each engine's best run over the other's, then in brackets each round's own ratio
(the two engines' runs of one round ran back to back). On a shared machine whose speed swings
several-fold within a minute, trust a ratio only where its rounds agree; every run is in the JSON.
With each file: onecall's DecoderLM.kernels line (which tensors run on which kernels) and the file's
types per tensor role. Output: a markdown table per file and a summary, printed and written to
--markdown, and one JSON line per file, printed and appended to --jsonl (both under /tmp/onecall-mixes
unless told otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bench_engine
from _peers import LOADERS, SYSTEMS, LlamaCpp, Onecall, OnecallInt8, Workload
from bench_engine import CHAT, TOPICS, load_tokenizer, long_text, metric
from make_gguf_mixes import DEFAULT_OUT, SHAPES, mix_path, tensor_mix

DEFAULT_PRESETS = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "F16")
ROWS = (  # (bench_engine.metric name, label, higher is better)
    ("cold_start", "cold start to first token (s)", False),
    ("prefill", "prefill tok/s, {plen}-token prompt", True),
    ("decode", "decode tok/s, batch 1, {ntok} tokens", True),
    ("long_decode", "decode tok/s at a {lctx}-token context", True),
    ("aggregate", "{nconc} concurrent x {ntok} tokens, total tok/s", True),
    ("loaded_rss", "resident after load + first token (MB)", False),
    ("peak_rss", "peak resident (MB)", False),
    ("model_rss", "resident after load beyond the imported libraries (MB)", False),
)


# ---- child side: bench_engine's adapters, plus the figures this matrix reports --------------------
def onecall_figures(llm: Any) -> dict[str, Any]:
    """What onecall loaded and how it runs it (LLM.info: the kernels line, dtypes, shape) and the
    paged KV pool it allocated (torch.empty: its pages count as resident only once written)."""
    kv = llm.engine.parts.kv_cache
    pool = {"num_blocks": kv.num_blocks, "block_size": kv.block_size, "tokens": kv.num_blocks * kv.block_size,
            "bytes": kv.k.numel() * kv.k.element_size() + kv.v.numel() * kv.v.element_size(),
            "dtype": str(kv.k.dtype).removeprefix("torch.")}  # fmt: skip
    return {"info": asdict(llm.info), "kv_pool": pool, "pack_cache": llm.engine.parts.pack_cache}


class OnecallMatrix(Onecall):
    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        return {**super().extras(result), **onecall_figures(self.llm)}


class OnecallInt8Matrix(OnecallInt8):
    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        return {**super().extras(result), **onecall_figures(self.llm)}


class LlamaCppMatrix(LlamaCpp):
    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's context (n_ctx, as it rounded it) and its K/V cache: F16 K and V (its default
        type) of every position in every layer."""
        meta, n_ctx = self.llm.metadata, self.llm.n_ctx()
        arch = meta["general.architecture"]
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(
            meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads)
        )
        layers = int(meta[f"{arch}.block_count"])
        return {
            "kv_pool": {
                "tokens": n_ctx,
                "bytes": n_ctx * layers * kv_heads * head_dim * 2 * 2,
                "dtype": "float16",
            }
        }


MATRIX_LOADERS = {"onecall": OnecallMatrix, "onecall-int8": OnecallInt8Matrix, "llamacpp": LlamaCppMatrix}


def child_main(system: str, spec: Path) -> None:
    """bench_engine's child loop, with this matrix's adapters in place of its own."""
    LOADERS.update(MATRIX_LOADERS)  # the table bench_engine.child_main reads
    bench_engine.child_main(system, spec)


# ---- parent side ----------------------------------------------------------------------------------
def build_workload(path: Path, args: argparse.Namespace) -> Workload:
    """The same token ids for both engines (the file's own tokenizer: the embedded model's)."""
    encode, _ = load_tokenizer(path)
    plen, stride = args.prefill_len, 13  # repeat r is the window starting at r * stride
    ids = encode(long_text(random.Random(0), 2 * plen + 200))
    assert len(ids) >= plen + stride * args.repeats, "the deterministic text is too short"
    long_ids = encode(long_text(random.Random(1), args.long_context + 200))[: args.long_context]
    topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" (take {i // len(TOPICS) + 1})")
              for i in range(args.concurrent)]  # fmt: skip
    return Workload(
        model_path=str(path),
        chat_messages=CHAT,
        prefill_prompts=[ids[r * stride : r * stride + plen] for r in range(args.repeats)],
        decode_prompt=encode("Explain how a paged KV cache works, step by step."),
        decode_tokens=args.decode_tokens,
        decode_repeats=args.repeats,
        long_prompt=long_ids,
        long_tokens=args.long_tokens,
        long_repeats=args.repeats,
        concurrent_prompts=[encode(f"Write a short story about {topic}.") for topic in topics],
        concurrent_tokens=args.decode_tokens,
        aggregate_repeats=args.repeats,
        threads=args.threads,
        device="cpu",
        dtype="float32",
        kernels=args.kernels,
        kv_cache_dtype="auto",
        sequential_budget_s=args.sequential_budget,
    )


def warm_page_cache(path: Path, chunk: int = 64 * 2**20) -> None:
    """Read the file once, so every engine starts with it in the page cache (without holding it)."""
    with path.open("rb") as f:
        while f.read(chunk):
            pass


def bench_file(path: Path, shape: str, preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """One interleaved run of every engine on one file -> its JSON record."""
    mix = tensor_mix(path)
    warm_page_cache(path)
    workload = build_workload(path, args)
    load_before = os.getloadavg()
    t0 = time.time()
    # bench_engine's Child spawns `python <bench_engine.__file__> --child ...`: point it at this
    # script, whose child side (child_main) adds the kernels line and the KV pools to the results
    bench_engine.__file__ = __file__
    untimed_first_start(args.systems, workload, args.timeout)
    results = bench_engine.run_systems(args.systems, workload, args.timeout)
    record: dict[str, Any] = {
        "bench": "bench_gguf_matrix",
        "file": str(path), "shape": shape, "preset": preset, "size_bytes": path.stat().st_size,
        "started": datetime.datetime.fromtimestamp(t0).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - t0, 1),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "workload": {"prefill_len": args.prefill_len, "decode_tokens": args.decode_tokens,
                     "long_context": len(workload.long_prompt), "long_tokens": args.long_tokens,
                     "concurrent": args.concurrent, "repeats": args.repeats, "threads": args.threads,
                     "sequential_budget_s": args.sequential_budget},
        "mix": mix,
        "weight_types": weight_types(mix),
        "results": results,
        "ratios": ratios(results),
        "round_ratios": round_ratios(results),
    }  # fmt: skip
    for name in ("onecall", "onecall-int8"):
        info = results.get(name, {}).get("info")
        if info:
            record.setdefault("kernels", {})[name] = info["kernels"]
            record.setdefault("pack_cache", {})[name] = results[name].get("pack_cache", "-")
    return record


def untimed_first_start(systems: list[str], workload: Workload, timeout: float) -> None:
    """Start each onecall variant once to its first token and stop it, untimed: the timed start is then
    a second start, whose pack cache (loading/pack_cache.py) holds this file's packed weights, as it
    does for a user's every start after the first. (llama.cpp keeps no such cache: its second start
    differs from its first only by the page cache, which warm_page_cache has filled already.)"""
    with tempfile.TemporaryDirectory() as tmp:
        for system in systems:
            if system.startswith("onecall"):
                print(f"starting {system} once, untimed (its pack cache) ...", file=sys.stderr, flush=True)
                bench_engine.Child(system, workload, timeout, Path(tmp)).kill()


def weight_types(mix: dict[str, dict[str, int]]) -> dict[str, int]:
    """Tensors per type over the whole file, norms and biases (F32) left out."""
    total: Counter[str] = Counter()
    for role, counts in mix.items():
        if role.endswith(".weight") and "norm" not in role:
            total.update(counts)
    return dict(total.most_common())


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """onecall / llama.cpp per metric, for each onecall variant that ran beside llama.cpp."""
    out: dict[str, dict[str, float | None]] = {}
    peer = results.get("llamacpp")
    for name in ("onecall", "onecall-int8"):
        if name not in results or peer is None or "error" in results[name] or "error" in peer:
            continue
        row: dict[str, float | None] = {}
        for key, _, _ in ROWS:
            have, base = metric(results[name], key), metric(peer, key)
            row[key] = round(have / base, 3) if have and base else None
        out[name] = row
    return out


# the timed metrics, and where each engine's list of runs sits in its result (runs[i]: round i)
RUNS = {"prefill": "prefill_tokens_per_s", "decode": "decode_tokens_per_s", "long_decode": "long_decode",
        "aggregate": "aggregate"}  # fmt: skip


def round_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """onecall's run / llama.cpp's run of the same round, per timed metric: the two ran back to back,
    so on a machine whose speed swings several-fold within a minute these pairs compare like with
    like, where the best of each engine's runs may pair a quiet moment with a busy one."""
    out: dict[str, dict[str, list[float]]] = {}
    peer = results.get("llamacpp")
    for name in ("onecall", "onecall-int8"):
        if name not in results or peer is None or "error" in results[name] or "error" in peer:
            continue
        out[name] = {
            key: [round(a / b, 3) for a, b in zip(results[name][field]["runs"], peer[field]["runs"]) if b]
            for key, field in RUNS.items()
        }
    return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def _runs(result: dict[str, Any]) -> str:
    """`prefill 284/97, decode 91/78, ...`: how far one engine's repeats drifted."""
    if "error" in result:
        return ""
    phases = (("prefill", result["prefill_tokens_per_s"]["runs"]), ("decode", result["decode_tokens_per_s"]["runs"]),
              ("long", result["long_decode"]["runs"]), ("concurrent", result["aggregate"]["runs"]))  # fmt: skip
    return ", ".join(f"{name} " + "/".join(_num(v) for v in runs) for name, runs in phases)


def _ratio(best: float | None, rounds: list[float] | None) -> str:
    """`1.92x (1.92, 1.87)`: best over best, then each round's own ratio."""
    text = "-" if not best else _num(best) + "x"
    return text + (f" ({', '.join(_num(r) for r in rounds)})" if rounds else "")


def markdown_file(record: dict[str, Any]) -> str:
    """One file's table: each engine's figure, and onecall / llama.cpp."""
    results, w = record["results"], record["workload"]
    names = list(results)
    onecalls = [n for n in names if n in record["ratios"]]
    fill = {
        "plen": w["prefill_len"],
        "ntok": w["decode_tokens"],
        "lctx": w["long_context"],
        "nconc": w["concurrent"],
    }
    lines = [
        f"### {record['shape']} {record['preset']}: `{Path(record['file']).name}` ({_mb(record['size_bytes'])} MB)",
        "",
        "weights: " + ", ".join(f"{t} x{n}" for t, n in record["weight_types"].items()),
    ]
    for name, line in record.get("kernels", {}).items():
        lines.append(f"{name} kernels: `{line}`")
    for name, status in record.get("pack_cache", {}).items():
        lines.append(f"{name} timed start's pack cache: {status}")
    rounds = record.get("round_ratios", {})
    header = ["metric", *names, *(f"{o} / llama.cpp (per round)" for o in onecalls)]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, label, higher in ROWS:
        cells = [_num(metric(results[n], key)) for n in names]
        ratio_cells = [_ratio(record["ratios"][o][key], rounds.get(o, {}).get(key)) for o in onecalls]
        better = "higher" if higher else "lower"
        lines.append(
            f"| {label.format(**fill)} ({better} is better) | " + " | ".join(cells + ratio_cells) + " |"
        )
    pools = [_mb(results[n].get("kv_pool", {}).get("bytes")) for n in names]
    lines.append("| KV pool allocated (MB) | " + " | ".join(pools + ["" for _ in onecalls]) + " |")
    spread = [f"{n}: {runs}" for n in names if (runs := _runs(results[n]))]
    if spread:
        lines.append("\nevery timed run, tok/s (the table keeps the best): " + "; ".join(spread))
    for n in names:
        r = results[n]
        if "error" in r:
            tail = " / ".join(r.get("stderr_tail", [])[-3:])
            lines.append(f"\n{n} FAILED: {r['error']}: {tail}")
    peer = results.get("llamacpp", {})
    if "aggregate" in peer:
        lines.append(
            f"\nllama.cpp's concurrent row ran the requests one after another ({peer['aggregate']['num_requests']}"
            f" of {w['concurrent']} within the {w['sequential_budget_s']:g} s budget): llama-cpp-python has no"
            " in-process batching server."
        )
    lines.append(f"\nrun started {record['started']}, {record['wall_s']:.0f} s; 1-minute load average before/after:"
                 f" {record['loadavg_before_after'][0]}/{record['loadavg_before_after'][1]}")  # fmt: skip
    return "\n".join(lines)


def markdown_summary(records: list[dict[str, Any]]) -> str:
    """One row per file: the ratios that matter, and onecall's memory against the file's size."""
    cols = ("decode", "prefill", "aggregate", "cold_start", "peak_rss")
    lines = [
        "| file | MB | engine | "
        + " | ".join(f"{c} ratio" + (" (per round)" if c in RUNS else "") for c in cols)
        + " | onecall peak RSS / file | onecall's model RSS / file |",
        "|" + "---|" * (5 + len(cols)),
    ]
    for r in records:
        size = r["size_bytes"]
        for name, row in r["ratios"].items():
            peak = metric(r["results"].get(name, {"error": "-"}), "peak_rss")
            mem = f"{peak * 1e6 / size:.2f}" if peak else "-"
            model = metric(r["results"].get(name, {"error": "-"}), "model_rss")
            mem += f" | {model * 1e6 / size:.2f}" if model else " | -"
            rounds = r.get("round_ratios", {}).get(name, {})
            cells = [_ratio(row.get(c), rounds.get(c)) for c in cols]
            lines.append(
                f"| {r['shape']} {r['preset']} | {_mb(size)} | {name} | " + " | ".join(cells) + f" | {mem} |"
            )
        if not r["ratios"]:
            failed = ", ".join(f"{n}: {v['error']}" for n, v in r["results"].items() if "error" in v)
            why = failed or "llama.cpp did not run"
            lines.append(f"| {r['shape']} {r['preset']} | {_mb(size)} | - | no ratio ({why}) |")
    return "\n".join(lines)


def pick_files(args: argparse.Namespace) -> list[tuple[Path, str, str]]:
    """(path, shape, preset) to run: --files as given, else --shapes x --presets under --dir."""
    if args.files:
        picked = []
        for f in args.files.split(","):
            path = Path(f.strip())
            shape, _, preset = path.stem.rpartition("-")
            picked.append((path, shape or path.stem, preset))
    else:
        picked = [(mix_path(args.dir, s, p), s, p) for s in args.shapes for p in args.presets]
    missing = [str(p) for p, _, _ in picked if not p.exists()]
    if missing:
        raise SystemExit(
            "missing: " + ", ".join(missing) + "\nmake them with: python benchmarks/make_gguf_mixes.py"
            f" --out {args.dir} --shapes {','.join(args.shapes)} --presets {','.join(args.presets)}"
        )
    return picked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_OUT, help="where make_gguf_mixes.py wrote the files")
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}"
    )
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma-separated presets")
    ap.add_argument(
        "--files", default=None, help="comma-separated GGUF paths instead of --shapes x --presets"
    )
    ap.add_argument(
        "--only", default="onecall,llamacpp", help="engines: a subset of onecall,onecall-int8,llamacpp"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs of prefill, decode and concurrent (best kept)"
    )
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--long-context", type=int, default=1024)
    ap.add_argument("--long-tokens", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument(
        "--sequential-budget", type=float, default=30.0, help="llama.cpp's concurrent row, seconds"
    )
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for each engine")
    ap.add_argument("--kernels", default="fast", choices=["fast", "reference"], help="onecall's kernels")
    ap.add_argument(
        "--timeout", type=float, default=900.0, help="seconds allowed per cold start and per timed run"
    )
    ap.add_argument("--markdown", type=Path, default=DEFAULT_OUT / "bench_gguf_matrix.md")
    ap.add_argument("--jsonl", type=Path, default=DEFAULT_OUT / "bench_gguf_matrix.jsonl")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.presets = [p.strip().upper() for p in args.presets.split(",") if p.strip()]
    args.systems = [s.strip() for s in args.only.split(",") if s.strip()]
    if not args.systems or set(args.systems) - set(MATRIX_LOADERS):
        ap.error(f"--only takes a subset of {','.join(MATRIX_LOADERS)}; got {args.only!r}")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.workload)
        return
    files = pick_files(args)
    command = "python benchmarks/bench_gguf_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    header = (f"## bench_gguf_matrix, {started}\n\n`{command}`\n\n{platform.node()}, {os.cpu_count()} CPUs,"
              f" {args.threads} threads per engine; ratios are onecall / llama.cpp from one interleaved run per file")  # fmt: skip
    records, sections = [], [header]
    args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    for path, shape, preset in files:
        print(f"== {path} ...", file=sys.stderr, flush=True)
        record = bench_file(path, shape, preset, args)
        record["command"] = command
        records.append(record)
        sections.append(markdown_file(record))
        print("\n" + sections[-1], flush=True)
        line = json.dumps(record)
        with args.jsonl.open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)
    sections += ["### summary (onecall / llama.cpp)", markdown_summary(records)]
    print("\n" + sections[-1])
    args.markdown.write_text("\n\n".join(sections) + "\n")
    print(f"\nwrote {args.markdown} and appended {len(records)} line(s) to {args.jsonl}", file=sys.stderr)


if __name__ == "__main__":
    main()
