"""onecall on a CUDA GPU: correctness against transformers, then a Qwen3-8B-shaped speed run.

    python3 benchmarks/gpu_check.py              # from the repo root, on a machine with a CUDA GPU
    python3 benchmarks/gpu_check.py --layers 8   # a shorter 8B-shaped run (fewer layers)
    python3 benchmarks/gpu_check.py --device cpu --layers 2 --hidden 256  # a smoke run of the script

Needs only torch, transformers and onecall's own light dependencies (tokenizers, jinja2,
safetensors, numpy); onecall is imported from this source tree, so nothing needs installing and no
network is used. About two minutes on an H200. Steps:

1. correctness: a tiny random-weight Qwen3 (float32) greedy-decodes 24 tokens for 3 prompts through
   onecall's engine (paged cache, the Triton attention kernel on CUDA) and through transformers'
   generate on the same device; the tokens must be equal. With 2 GPUs (--tensor-parallel N: N), the
   same kind of model saved as a safetensors folder runs at tensor_parallel_size 2 (NCCL, rank r on
   cuda:r) and must give the tokens of one process; with fewer GPUs the JSON says it was skipped.
2. a Qwen3-8B-shaped model (36 layers, hidden 4,096, 32 query / 8 KV heads, head_dim 128,
   intermediate 12,288, vocabulary 151,936) with random bfloat16 weights:
   - copy bandwidth of the device (a 1 GiB copy, read + write bytes per second), and the batch-1
     decode floor: weight bytes read per step / that bandwidth;
   - batch-1 decode ms/step (64 tokens after a 16-token prompt, gaps between streamed tokens), with
     the decode steps replayed as CUDA graphs (the default on CUDA) and without (eager);
   - decode throughput at batch 64 (64 requests x 32 tokens);
   - prefill tokens/s of a 1,024-token prompt;
   - time to first token of a prompt whose first 1,000 tokens are in the prefix cache, plus 20 new:
     the new tokens are one short prompt chunk, a static step replayed as a CUDA graph (engine/
     decode_graphs.py); and the same with graphs off (eager). The JSON names the layouts that ran
     static steps and whether each captured a graph ("decode D + chunk C": D one-token rows beside
     a chunk padded to C tokens).
   Every kind of step runs once before it is timed (Triton compiles a kernel per shape class on
   first use); the first 1,024-token prefill's seconds, compile included, are kept in the JSON.
The last line is one JSON object with every number. Nothing here is a timed assertion: step 1 exits
non-zero on a token mismatch, the speed figures are reported as measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # onecall from this source tree

from onecall.config import EngineConfig  # noqa: E402
from onecall.engine.engine import Engine  # noqa: E402
from onecall.engine.engine_parts import LoadedEngineParts  # noqa: E402
from onecall.model.checkpoint import ModelFiles  # noqa: E402
from onecall.model.config import ModelConfig  # noqa: E402
from onecall.model.decoder import DecoderLM  # noqa: E402
from onecall.model.kv_cache import PagedKVCache  # noqa: E402
from onecall.model.packing import weight_bytes_read  # noqa: E402
from onecall.model.weights import load_weights  # noqa: E402
from onecall.sampling_params import SamplingParams  # noqa: E402
from onecall.text.tokenizer import Tokenizer  # noqa: E402


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer with ids 0..vocab_size-1 ("t0", "t1", ...): prompts here are token ids,
    and detokenizing needs only some text per id. The last id is EOS (never sampled: ignore_eos)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return Tokenizer(
        hf, bos_token_id=None, eos_token_ids=frozenset({vocab_size - 1}), eos_token_id=vocab_size - 1,
        special_ids=frozenset(), add_bos_token=False, chat_template=None, piece_mode="plain",
    )  # fmt: skip


def make_engine(
    model: DecoderLM,
    tokenizer: Tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    kv_tokens: int,
    **cfg: Any,
) -> Engine:
    mc, block_size = model.config, 16
    num_blocks = -(-kv_tokens // block_size)
    kv = PagedKVCache(
        mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim, dtype, device
    )
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config = EngineConfig(device=str(device), dtype=dtype_name, block_size=block_size, **cfg)
    parts = LoadedEngineParts(
        files=ModelFiles(kind="hf", path=Path("random-weights"), name="random-weights"),
        model_config=mc, model=model, tokenizer=tokenizer, kv_cache=kv, num_blocks=num_blocks,
        max_model_len=min(mc.max_position_embeddings, num_blocks * block_size), device=device, dtype=dtype,
        load_seconds=0.0, kernels=model.kernels,
    )  # fmt: skip
    return Engine(config, parts=parts)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Add all, step to the end; returns the final outputs by id and each token's arrival time."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    final, stamps = {}, {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.delta_token_ids:
                stamps[out.request_id].append(time.perf_counter())
            if out.finished:
                final[out.request_id] = out
    return {"outputs": final, "stamps": stamps}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1. correctness ----------------------------------------------------------------------------
def check_tiny_qwen3(
    device: torch.device, attention_backend: str | None = None, max_tokens: int = 24
) -> dict[str, Any]:
    """Greedy tokens of onecall's engine against transformers' generate. `attention_backend`
    overrides the engine's choice (the tests run "triton" on CPU under TRITON_INTERPRET=1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    vocab = 512
    hf_config = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    hf = Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)  # wide logit gaps: greedy is not decided by rounding
    hf = hf.to(device)
    mc = ModelConfig.from_hf_config(hf_config.to_dict())
    ours = DecoderLM(mc, dtype=torch.float32, device=device)
    load_weights(ours, hf.state_dict().items())
    engine = make_engine(ours, synthetic_tokenizer(vocab), device, torch.float32, 4096)
    if attention_backend is not None:
        engine.runner.attention_backend = attention_backend
    prompts = [[(7 * i + 3 * j) % (vocab - 1) for j in range(5 + 6 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = run(engine, prompts, params)["outputs"]
    mismatches = []
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            x = torch.tensor([ids], device=device)
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=vocab - 1,
            )[0, len(ids) :].tolist()  # fmt: skip
        if ref != list(got[f"r{i}"].token_ids):
            mismatches.append({"prompt": i, "transformers": ref, "onecall": list(got[f"r{i}"].token_ids)})
    return {
        "tokens_equal": not mismatches,
        "attention_backend": engine.runner.attention_backend,
        "mismatches": mismatches,
    }


# ---- 1b. tensor parallel -------------------------------------------------------------------------
def check_tensor_parallel(device: torch.device, size: int = 2, max_tokens: int = 12) -> dict[str, Any]:
    """Greedy tokens of a tiny random Qwen3 (safetensors folder, as a user would load one) through
    LLM(tensor_parallel_size=size) equal the same model in one process (reference kernels, float32).
    On CUDA rank r runs on cuda:r over NCCL (needs `size` GPUs); on CPU the ranks use gloo."""
    import tempfile

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from onecall import LLM

    torch.manual_seed(0)
    vocab = 512
    hf_config = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, eos_token_id=vocab - 1,
    )  # fmt: skip
    hf = Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)  # wide logit gaps: the all-reduce's summation order cannot flip a token
    prompts = [[(7 * i + 3 * j) % (vocab - 1) for j in range(5 + 6 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[int, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-qwen3"
        hf.save_pretrained(folder, safe_serialization=True)
        tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{vocab - 1}"}))
        for tp in (1, size):
            with LLM(
                model=str(folder), device=device.type, dtype="float32", kernels="reference",
                tensor_parallel_size=tp, num_threads=1 if device.type == "cpu" else None, kv_cache_gib=0.05,
            ) as llm:  # fmt: skip
                tokens[tp] = [list(o.token_ids) for o in llm.generate(prompts, params)]
    return {"size": size, "tokens_equal": tokens[1] == tokens[size], "tp1": tokens[1], f"tp{size}": tokens[size]}


# ---- 2. the 8B shape -----------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """(read + write) bytes/s of a device-to-device copy, best of 5."""
    x = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for i in range(6):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def random_model(mc: ModelConfig, device: torch.device) -> DecoderLM:
    model = DecoderLM(mc, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def speed_8b(device: torch.device, num_layers: int, hidden: int) -> dict[str, Any]:
    scale = hidden / 4096
    mc = ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=int(12288 * scale),
        num_hidden_layers=num_layers, num_attention_heads=max(1, int(32 * scale)),
        num_key_value_heads=max(1, int(8 * scale)), head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
    )  # fmt: skip
    model = random_model(mc, device)
    engine = make_engine(model, synthetic_tokenizer(mc.vocab_size), device, torch.bfloat16, 80_000,
                         max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=True)  # fmt: skip
    weight_bytes = weight_bytes_read(model, 1)
    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * weight_bytes / bandwidth
    rng = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, mc.vocab_size - 1, (n,), generator=rng).tolist()

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)

    # warm-up: Triton compiles a kernel per new shape class on first use (measured: the first
    # 1,024-token prefill ran at 1.3k tok/s, the next ones at 29k), so every kind of step timed below
    # runs once first: a short prompt and its decode, a long prompt, a chunk after a cached prefix
    run(engine, [ids(16)], greedy(8))
    sync(device)
    t0 = time.perf_counter()
    run(engine, [ids(1024)], greedy(1))
    sync(device)
    first_prefill_s = time.perf_counter() - t0
    warm_prefix = ids(1000)
    run(engine, [warm_prefix], greedy(1))
    run(engine, [warm_prefix + ids(20)], greedy(1))

    # batch-1 decode: gaps between streamed tokens (prefill excluded); then the same without graphs
    def decode_ms_per_step(eng: Engine) -> float:
        stamps = run(eng, [ids(16)], greedy(64))["stamps"]["r0"]
        return 1e3 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)

    # TTFT with a 1,000-token cached prefix + 20 new tokens (the prefix enters the cache first)
    def ttft_ms(eng: Engine) -> tuple[float, int]:
        prefix = ids(1000)
        run(eng, [prefix], greedy(1))
        out = run(eng, [prefix + ids(20)], greedy(1))["outputs"]["r0"]
        return 1e3 * (out.trace.first_token_time - out.trace.arrival_time), out.num_cached_tokens

    decode_ms = decode_ms_per_step(engine)
    eager = make_engine(model, engine.tokenizer, device, torch.bfloat16, 20_000, cuda_graphs=False)
    run(eager, [ids(16)], greedy(8))
    eager_ms = decode_ms_per_step(eager)
    ttft_ms(eager)  # warm-up: its chunk shapes
    eager_ttft_ms = ttft_ms(eager)[0]
    del eager

    # batch 64 x 32 tokens
    sync(device)
    t0 = time.perf_counter()
    outs = run(engine, [ids(32) for _ in range(64)], greedy(32))["outputs"]
    sync(device)
    batch_tok_s = sum(len(o.token_ids) for o in outs.values()) / (time.perf_counter() - t0)

    # prefill of 1,024 fresh tokens (1 output token)
    sync(device)
    t0 = time.perf_counter()
    run(engine, [ids(1024)], greedy(1))
    sync(device)
    prefill_tok_s = 1024 / (time.perf_counter() - t0)

    ttft, cached = ttft_ms(engine)  # its layout was captured in the warm-up (warm_prefix + 20)
    graphs = engine.runner.decode_graphs
    return {
        "layers": num_layers, "hidden": hidden, "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9, "decode_floor_ms": floor_ms,
        "decode_ms_per_step": decode_ms, "fraction_of_floor": floor_ms / decode_ms,
        "batch64_tokens_per_s": batch_tok_s, "prefill_tokens_per_s": prefill_tok_s,
        "first_prefill_s_with_compile": first_prefill_s,
        "ttft_cached_1000_plus_20_ms": ttft, "cached_tokens": cached,
        "ttft_cached_1000_plus_20_ms_eager": eager_ttft_ms,
        "attention_backend": engine.runner.attention_backend,
        "decode_ms_per_step_eager": eager_ms,
        "cuda_graphs": graphs is not None and any(graphs.buckets.values()),
        "chunk_graphs": {} if graphs is None else {
            f"decode {d} + chunk {c}": captured for (d, c), captured in sorted(graphs.chunk_buckets.items())
        },
        "graph_capture_errors": {} if graphs is None else graphs.capture_errors,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=36, help="layers of the 8B-shaped model")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size (heads scale with it)")
    ap.add_argument(
        "--tensor-parallel", type=int, default=2,
        help="ranks of the tensor-parallel check (runs on CUDA when that many GPUs are there; 0: skip)",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    result: dict[str, Any] = {"bench": "gpu_check", "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    result["tiny_qwen3"] = check_tiny_qwen3(device)
    print(f"tiny Qwen3 greedy tokens equal transformers': {result['tiny_qwen3']['tokens_equal']}", flush=True)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    tp_ok = True
    if args.tensor_parallel > 1 and (device.type != "cuda" or gpus >= args.tensor_parallel):
        result["tensor_parallel"] = check_tensor_parallel(device, args.tensor_parallel)
        tp_ok = result["tensor_parallel"]["tokens_equal"]
        print(f"tiny Qwen3 at tensor_parallel_size {args.tensor_parallel}: greedy tokens equal TP=1: {tp_ok}", flush=True)
    elif args.tensor_parallel > 1:
        result["tensor_parallel"] = {"skipped": f"needs {args.tensor_parallel} GPUs, found {gpus}"}
    result["qwen3_8b_shape"] = speed_8b(device, args.layers, args.hidden)
    s = result["qwen3_8b_shape"]
    print(
        f"8B shape ({s['layers']} layers): decode {s['decode_ms_per_step']:.2f} ms/step, eager "
        f"{s['decode_ms_per_step_eager']:.2f} (floor "
        f"{s['decode_floor_ms']:.2f} ms, {100 * s['fraction_of_floor']:.0f}%), batch 64 "
        f"{s['batch64_tokens_per_s']:.0f} tok/s, prefill {s['prefill_tokens_per_s']:.0f} tok/s, TTFT with a "
        f"cached 1,000-token prefix {s['ttft_cached_1000_plus_20_ms']:.1f} ms (eager "
        f"{s['ttft_cached_1000_plus_20_ms_eager']:.1f}; chunk layouts, captured: {s['chunk_graphs']})",
        flush=True,
    )
    result["wall_s"] = time.perf_counter() - t0
    print(json.dumps(result))
    sys.exit(0 if result["tiny_qwen3"]["tokens_equal"] and tp_ok else 1)


if __name__ == "__main__":
    main()
