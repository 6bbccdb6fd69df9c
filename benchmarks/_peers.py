"""The systems bench_engine.py compares (onecall, onecall-int8: the same with --int8-activations,
transformers, llama.cpp), each measured inside its own fresh child process.

A child runs one system on one shared Workload (the same token ids for everyone). It reports on
stdout with tagged lines the parent reads, and takes one command a line on stdin ({"phase": ...,
"repeat": i}, then {"phase": "finish"}):

    @@bench first_token {"marks": {...}, ...}   as soon as the cold-start chat turn has its token
    @@bench run {"tokens_per_s": ...}           each timed run the parent asked for, when done
    @@bench result {...}                        all metrics, once, after "finish"

The parent (bench_engine.py) interleaves the systems: every system is started first (one at a time,
for its cold start), then each timed run (`schedule`) goes to every system in turn while the others
wait idle, so a phase's runs of all systems share the same minutes of a machine whose speed drifts.

Each system is a small adapter (load, first_token, prefill, decode, serve) and one class,
`Measurement`, times all of them the same way, so the numbers mean the same thing in each column:
  1. cold start: imports + model load + a short chat turn generating 1 token (the process is new)
  2. prefill: the forward of each long prompt producing 1 token, wall time, best of the repeats
  3. decode at batch 1: greedy, EOS ignored; tokens/s over the gaps between generated tokens, so the
     prefill (the first token) is excluded; the same at a long context, best of its repeats
  4. aggregate: all concurrent prompts, greedy, EOS ignored; total generated tokens / wall time,
     best of the repeats (as prefill and decode are: every system gets its best of the same
     number of runs, so a noisy moment on a shared machine does not decide a ratio)
  and memory: the resident set after the cold-start turn, and the process's peak over the whole run
  (the model file's mapped pages count where they are touched, for every system alike)

Heavy imports (torch, transformers, llama_cpp, onecall) happen inside the adapters' constructors:
they belong to the cold start being measured.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

TAG = "@@bench"
SYSTEMS = ("onecall", "onecall-int8", "transformers", "llamacpp")


@dataclass
class Workload:
    """What every system runs. Token ids are built once by the parent and shared."""

    model_path: str  # the GGUF file
    chat_messages: list[dict[str, str]]  # the cold-start chat turn
    prefill_prompts: list[list[int]]  # one prompt per repeat, all prefill_len long, distinct first tokens
    decode_prompt: list[int]
    decode_tokens: int
    decode_repeats: int
    long_prompt: list[int]  # decode at a long context: this prompt, then long_tokens greedy tokens
    long_tokens: int
    long_repeats: int
    concurrent_prompts: list[list[int]]
    concurrent_tokens: int
    aggregate_repeats: int  # runs of the concurrent batch; the best one is reported
    threads: int
    device: str  # onecall and transformers; llama.cpp runs on the CPU
    dtype: str  # onecall's dtype; transformers always runs float32
    kernels: str  # onecall's kernels: "fast" or "reference"
    kv_cache_dtype: str  # onecall's K/V cache dtype ("auto": the model's)
    sequential_budget_s: float  # a system serving one sequence at a time stops starting requests after this
    seed: int = 0
    t_spawn: float = 0.0  # parent's time.time() just before it started this child (set per child)
    marks: dict[str, float] = field(default_factory=dict)  # child's milestones, seconds after t_spawn
    rss_marks: dict[str, float] = field(default_factory=dict)  # child's resident MB at each milestone

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(path.read_text()))

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.time() - self.t_spawn, 4)
        self.rss_marks[name] = round(resident_mb(), 1)


def emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{TAG} {tag} {json.dumps(payload)}", flush=True)


def decode_rate(stamps: list[float]) -> float:
    """tokens/s over the gaps between consecutive generated tokens (len(stamps) - 1 decode steps)."""
    assert len(stamps) >= 2, "need at least two generated tokens to time a decode step"
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def summarize(rates: list[float]) -> dict[str, Any]:
    return {"best": max(rates), "median": statistics.median(rates), "runs": rates}


class System(Protocol):
    aggregate_mode: str  # how `serve` runs many prompts

    def first_token(self) -> list[int]: ...  # the cold-start chat turn, 1 greedy token
    def prefill(self, ids: list[int]) -> None: ...  # forward of a fresh prompt producing 1 token
    def decode(self, ids: list[int], n: int) -> list[float]: ...  # n greedy tokens, perf_counter of each
    def serve(self, prompts: list[list[int]], n: int) -> int: ...  # n tokens each; returns the total
    def extras(self, result: dict[str, Any]) -> dict[str, Any]: ...  # system-specific figures


PHASES = ("prefill", "decode", "long_decode", "aggregate")


def schedule(w: Workload) -> list[tuple[str, int]]:
    """Every timed run as (phase, repeat), in the order the parent asks for them; the parent hands
    each one to every system in turn before the next, so all systems' runs of a phase are spread over
    the same minutes of the machine."""
    counts = {"prefill": len(w.prefill_prompts), "decode": w.decode_repeats, "long_decode": w.long_repeats,
              "aggregate": w.aggregate_repeats}  # fmt: skip
    return [(phase, i) for phase in PHASES for i in range(counts[phase])]


class Measurement:
    """One system inside its child process: the cold start when made, then one timed run per call of
    `run` (timed identically for every system), then `result()` with every figure."""

    def __init__(self, w: Workload, load: Callable[[Workload], System]) -> None:
        # 1. cold start (the parent times spawn -> the first_token line)
        self.w = w
        self.system = load(w)
        w.mark("loaded")
        token_ids = self.system.first_token()
        w.mark("first_token")
        self.loaded_rss_mb = resident_mb()
        self.runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
        emit("first_token", {"marks": dict(w.marks), "token_ids": token_ids})

    def run(self, phase: str, i: int) -> dict[str, Any]:
        w, system = self.w, self.system
        if phase == "prefill":  # 2. a different prompt per repeat
            ids = w.prefill_prompts[i]
            t0 = time.perf_counter()
            system.prefill(ids)
            run: dict[str, Any] = {"tokens_per_s": len(ids) / (time.perf_counter() - t0)}
        elif phase == "decode":  # 3. batch 1
            run = {"tokens_per_s": decode_rate(system.decode(w.decode_prompt, w.decode_tokens))}
        elif phase == "long_decode":  # 3b. at a long context (prefill excluded: the gaps between tokens)
            run = {"tokens_per_s": decode_rate(system.decode(w.long_prompt, w.long_tokens))}
        elif phase == "aggregate":  # 4. every concurrent prompt
            t0 = time.perf_counter()
            num_generated = system.serve(w.concurrent_prompts, w.concurrent_tokens)
            wall = time.perf_counter() - t0
            num_requests, partial = divmod(num_generated, w.concurrent_tokens)
            assert num_requests and not partial, f"{num_generated} tokens is not a whole number of requests"
            run = {"tokens_per_s": num_generated / wall, "num_generated": num_generated, "wall_s": wall,
                   "num_requests": num_requests}  # fmt: skip
        else:
            raise ValueError(f"unknown phase {phase!r}")
        self.runs[phase].append(run)
        return run

    def result(self) -> dict[str, Any]:
        """Each phase's best run (and median, and all runs), memory, and the system's extras."""
        rates = {phase: [r["tokens_per_s"] for r in runs] for phase, runs in self.runs.items()}
        aggregate = dict(max(self.runs["aggregate"], key=lambda r: r["tokens_per_s"]))
        aggregate.update(median=statistics.median(rates["aggregate"]), runs=rates["aggregate"],
                         mode=self.system.aggregate_mode)  # fmt: skip
        result: dict[str, Any] = {
            "prefill_tokens_per_s": summarize(rates["prefill"]),
            "decode_tokens_per_s": summarize(rates["decode"]),
            "long_decode": {"tokens_per_s": max(rates["long_decode"]), "runs": rates["long_decode"],
                            "context": len(self.w.long_prompt), "tokens": self.w.long_tokens},  # fmt: skip
            "aggregate": aggregate,
            "memory": {
                "loaded_rss_mb": self.loaded_rss_mb,  # resident right after the cold-start turn
                # resident once the system's libraries were imported, before its model loaded (torch's
                # ~230 MB for onecall): loaded minus this is what the model and its buffers hold
                "imported_rss_mb": self.w.rss_marks.get("imported"),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,  # Linux: KiB
            },
        }
        result.update(self.system.extras(result))
        return result


def resident_mb() -> float:
    """This process's resident memory now (Linux /proc/self/statm: resident pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 1e6


# ---- transformers -------------------------------------------------------------------------------
class _TokenClock:
    """A transformers streamer that timestamps each generated token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


class Transformers:
    """transformers' own generate() on its float32 dequantization of the GGUF; batches left-padded."""

    aggregate_mode = "batched generate, left padding"

    def __init__(self, w: Workload) -> None:
        import torch

        w.mark("imported_torch")
        torch.manual_seed(w.seed)
        torch.set_num_threads(w.threads)
        self.torch, self.device, self.w = torch, torch.device(w.device), w
        self.model, self.tok, self.loader = _load_transformers(Path(w.model_path), self.device)
        pad_id = (
            self.tok.pad_token_id if self.tok.pad_token_id is not None else self.model.config.eos_token_id
        )
        self.pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id

    def generate(self, ids: list[list[int]], n: int, streamer: Any = None) -> Any:
        """Left-padded batch -> (batch, width + n) ids; exactly n new tokens (EOS suppressed).
        With max_new_tokens=1 the prefill keeps only the last position's logits."""
        torch, width = self.torch, max(len(p) for p in ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=self.pad_id, streamer=streamer,
            )  # fmt: skip
        assert out.shape == (len(ids), width + n), f"transformers generated {tuple(out.shape)}"
        return out

    def first_token(self) -> list[int]:
        chat = self.tok.apply_chat_template(
            self.w.chat_messages, add_generation_prompt=True, return_tensors="pt"
        )
        ids = (chat["input_ids"] if hasattr(chat, "keys") else chat)[0].tolist()
        return self.generate([ids], 1)[0, -1:].tolist()

    def prefill(self, ids: list[int]) -> None:
        self.generate([ids], 1)

    def decode(self, ids: list[int], n: int) -> list[float]:
        clock = _TokenClock()
        self.generate([ids], n, clock)
        return clock.stamps

    def serve(self, prompts: list[list[int]], n: int) -> int:
        return self.generate(prompts, n).shape[0] * n

    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"loader": self.loader}


def _load_transformers(path: Path, device: Any) -> tuple[Any, Any, str]:
    """(model, tokenizer, how) for the GGUF, dequantized to float32 by transformers itself.

    from_pretrained(gguf_file=...) needs `accelerate`; without it, build the model from the GGUF's
    config and load transformers' own dequantized GGUF state dict (same tensors, same code path)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model: Any
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        how = "from_pretrained(gguf_file=...)"
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
        from transformers.initialization import no_init_weights
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
        assert set(result.missing_keys) <= {"lm_head.weight"}, f"GGUF left weights unloaded: {result}"
        model.tie_weights()
        how = "from_config + load_gguf_checkpoint (accelerate not installed)"
    return model.to(device).eval(), tok, how


# ---- llama.cpp ----------------------------------------------------------------------------------
class LlamaCpp:
    """llama-cpp-python's high-level Llama on the Q4_1 weights as they are, CPU only."""

    aggregate_mode = "sequential (the high-level API serves one sequence at a time)"

    def __init__(self, w: Workload) -> None:
        import llama_cpp

        w.mark("imported")
        longest = max(
            len(p) for p in [*w.prefill_prompts, w.decode_prompt, w.long_prompt, *w.concurrent_prompts]
        )
        n_ctx = longest + max(w.decode_tokens, w.concurrent_tokens) + 8
        self.w = w
        self.llm = llama_cpp.Llama(
            w.model_path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=w.threads, n_threads_batch=w.threads,
            seed=w.seed, verbose=False,
        )  # fmt: skip

    def first_token(self) -> list[int]:
        # the chat handler renders the GGUF's own template
        chat: Any = self.llm.create_chat_completion(self.w.chat_messages, max_tokens=1, temperature=0.0)  # type: ignore[arg-type]
        assert chat["choices"], "llama.cpp returned no completion"
        return []

    def decode(self, ids: list[int], n: int) -> list[float]:
        """n greedy tokens from a fresh context (reset: no KV reuse between calls)."""
        self.llm.reset()
        stamps: list[float] = []
        gen = self.llm.generate(list(ids), temp=0.0, reset=True)  # never stops on EOS; we stop it
        for _ in range(n):
            next(gen)
            stamps.append(time.perf_counter())
        gen.close()
        return stamps

    def prefill(self, ids: list[int]) -> None:
        self.decode(ids, 1)

    def serve(self, prompts: list[list[int]], n: int) -> int:
        """One request after another. Each costs about the same, so once the budget is spent the rate
        over those done stands for all of them (the result's num_requests says how many ran)."""
        t0, total = time.perf_counter(), 0
        for p in prompts:
            total += len(self.decode(p, n))
            if time.perf_counter() - t0 > self.w.sequential_budget_s:
                break
        return total

    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        return {}


# ---- onecall ------------------------------------------------------------------------------------
class Onecall:
    """onecall's LLM facade; prefix caching off so repeated prompts are recomputed, not served. Room for
    the concurrent prompts' sequences (a hybrid's states come out of the KV budget: one per sequence)."""

    aggregate_mode = "continuous batching"
    int8_activations = False  # EngineConfig.int8_activations (OnecallInt8)

    def __init__(self, w: Workload) -> None:
        from onecall import LLM, SamplingParams

        w.mark("imported")
        longest = max(len(p) for p in [*w.prefill_prompts, w.long_prompt])
        self.w, self.SamplingParams = w, SamplingParams
        self.llm = LLM(
            model=w.model_path, dtype=w.dtype, device=w.device, num_threads=w.threads, kernels=w.kernels,
            max_num_batched_tokens=max(2048, longest), max_num_seqs=max(16, len(w.concurrent_prompts)),
            enable_prefix_caching=False, kv_cache_dtype=w.kv_cache_dtype, int8_activations=self.int8_activations,
        )  # fmt: skip
        self.trace_decode_rates: list[float] = []

    def greedy(self, n: int) -> Any:
        return self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def first_token(self) -> list[int]:
        out = self.llm.chat(self.w.chat_messages, self.SamplingParams(temperature=0.0, max_tokens=1))[0]
        return list(out.token_ids)

    def prefill(self, ids: list[int]) -> None:
        self.llm.generate([ids], self.greedy(1))

    def decode(self, ids: list[int], n: int) -> list[float]:
        """Stamped as outputs stream out, like the peers; the trace's own figure (forward + sampling
        only, no scheduling or detokenizing) is kept alongside."""
        stamps: list[float] = []
        last: Any = None
        for out in self.llm.generate_stream(ids, self.greedy(n)):
            stamps.append(time.perf_counter())
            last = out
        assert len(stamps) == n and last.finished, f"onecall streamed {len(stamps)} outputs for {n} tokens"
        self.trace_decode_rates.append(last.trace.decode_tokens_per_s or 0.0)
        return stamps

    def serve(self, prompts: list[list[int]], n: int) -> int:
        return sum(len(o.token_ids) for o in self.llm.generate(prompts, self.greedy(n)))

    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        result["decode_tokens_per_s"]["trace_runs"] = self.trace_decode_rates
        w = self.w
        return {
            "bandwidth": decode_bandwidth(self.llm, w, result["decode_tokens_per_s"]["best"], len(w.decode_prompt), w.decode_tokens),
            "long_bandwidth": decode_bandwidth(self.llm, w, result["long_decode"]["tokens_per_s"], len(w.long_prompt), w.long_tokens),
        }  # fmt: skip


class OnecallInt8(Onecall):
    """onecall with llama.cpp's activation rounding: 4-bit projections quantize activations to int8."""

    int8_activations = True


def decode_bandwidth(
    llm: Any, w: Workload, tokens_per_s: float, prompt_len: int, num_tokens: int
) -> dict[str, Any]:
    """gpt-fast style: bytes one decode step reads x steps/s, against the machine's copy bandwidth.

    Weights: what the model's kernels stream per step at batch 1 (packing.weight_bytes_read: 4-bit
    projections on the fast path, float32 ones on the reference path; a tied embedding is read in
    full as the lm_head, an untied one is only gathered from). KV: K and V of every cached position
    in every layer, averaged over the decode steps."""
    model, kv = llm.engine.parts.model, llm.engine.parts.kv_cache
    weight_bytes = llm.weight_bytes_read(1)
    kv_bytes_per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * kv.k.element_size()
    mean_context = prompt_len + num_tokens / 2  # decode step k reads prompt + k positions
    step_bytes = weight_bytes + kv_bytes_per_token * mean_context
    achieved = step_bytes * tokens_per_s
    copy = copy_bandwidth(w.device)
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_step": kv_bytes_per_token * mean_context,
        "achieved_gb_per_s": achieved / 1e9,
        "copy_gb_per_s": copy / 1e9,
        "fraction_of_copy": achieved / copy,
        "tied_embeddings": getattr(model, "lm_head", None) is None,
    }


def copy_bandwidth(device: str, num_bytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """Bytes/s of copying a 512 MiB float32 tensor into a preallocated one, best of 3, counting
    read + write. Both buffers are touched first: a fresh clone() would time page faults instead."""
    import torch

    dev = torch.device(device)
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=dev)  # (num_bytes / 4,), pages touched
    y = torch.zeros_like(x)
    times: list[float] = []
    for i in range(repeats + 1):  # copy 0 only warms up and is not counted
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        y.copy_(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    best = min(times)
    return 2 * num_bytes / best


LOADERS: dict[str, Callable[[Workload], System]] = {
    "onecall": Onecall,
    "onecall-int8": OnecallInt8,
    "transformers": Transformers,
    "llamacpp": LlamaCpp,
}
