"""onecall on a CUDA GPU: correctness against transformers, then a Qwen3-8B-shaped speed run.

    python3 benchmarks/gpu_check.py              # from the repo root, on a machine with a CUDA GPU
    python3 benchmarks/gpu_check.py --layers 8   # a shorter 8B-shaped run (fewer layers)
    python3 benchmarks/gpu_check.py --sections tiny_qwen3,decode_graphs   # a subset (and what it needs)
    python3 benchmarks/gpu_check.py --device cpu --layers 2 --hidden 256 --tensor-parallel 0  # a smoke run

Needs only torch, transformers and onecall's own light dependencies (tokenizers, jinja2,
safetensors, numpy); onecall is imported from this source tree, so nothing needs installing and no
network is used. Sections, in the order they run (each is a key of the JSON):

  environment        torch, CUDA and Triton versions, the GPU's name, memory and count
  tiny_qwen3         a tiny random-weight Qwen3 (float32) greedy-decodes 24 tokens for 3 prompts
                     through onecall's engine (paged cache, the Triton attention kernel and the decode
                     steps' CUDA graphs on CUDA) and through transformers' generate on the same device;
                     the tokens must be equal
  tiny_qwen3_chunk   the same model, a prompt whose first block is in the prefix cache: its new tokens
                     run as one short chunk beside another request's decode row (a static step, a CUDA
                     graph on CUDA: engine/decode_graphs.py); both requests' tokens must equal
                     transformers'
  tiny_qwen3_bf16    a tiny Qwen3 at the 8B model's head shape (head_dim 128, 8 query / 2 KV heads) in
                     bfloat16 through the engine; each greedy token's regret under the float32
                     transformers model (its best logit minus the chosen token's) must stay within a
                     stated tolerance (rounding flips near-ties only; a broken kernel picks far tokens)
  tiny_qwen3_5       a tiny random Qwen3.5 hybrid (Gated DeltaNet's state cache beside the paged KV),
                     float32, greedy through the engine against transformers' generate on the device
  tiny_gpt_oss       the same for a tiny gpt-oss (attention sinks in the kernels, sliding layers, MoE)
  tensor_parallel    the same kind of model saved as a safetensors folder at tensor_parallel_size N
                     (--tensor-parallel N; NCCL, rank r on cuda:r) must give the tokens of one process;
                     skipped with fewer than N GPUs
  model_8b           a Qwen3-8B-shaped model (36 layers, hidden 4,096, 32 query / 8 KV heads, head_dim
                     128, intermediate 12,288, vocabulary 151,936), random bfloat16 weights, and its
                     engine (CUDA graphs on, prefix caching on)
  copy_bandwidth     the device's copy bandwidth (a 1 GiB copy, read + write bytes per second) and the
                     batch-1 decode floor: weight bytes read per step / that bandwidth
  warmup             every kind of step timed below runs once first (Triton compiles a kernel per
                     shape class on first use); the first 1,024-token prefill's seconds, compile
                     included, are kept
  decode_graphs      batch-1 decode ms/step (64 tokens after a 16-token prompt, gaps between streamed
                     tokens), decode steps replayed as CUDA graphs (the default on CUDA)
  decode_eager       the same with cuda_graphs off
  ttft_eager         time to first token of a prompt whose first 1,000 tokens are in the prefix cache,
                     plus 20 new, graphs off (the first such request, then a second one: the number)
  batch64            decode throughput at batch 64 (64 requests x 32 tokens; a short batch first, so
                     the 64-row decode graph is captured before the timing)
  prefill_1024       prefill tokens/s of a 1,024-token prompt
  ttft_graphs        the cached-prefix TTFT with graphs on: the 20 new tokens are one short prompt
                     chunk, a static step replayed as a CUDA graph
  graphs             the layouts that ran static steps and whether each captured a graph ("decode D +
                     chunk C": D one-token rows beside a chunk padded to C tokens), and capture errors

Fail-soft: a section that raises records {"error": "<type>: <message>", "traceback_tail": [...]}
under its key and the next one runs; a section whose prerequisite failed records why it was skipped
(as do the sections left once --max-seconds, default 480, is spent, and, on CUDA, those after an
error that left the device unusable: the error's record then says so in cuda_usable_after). A step that fails inside the engine (which
recovers by failing that step's requests) is raised as the section's error. After each section a
line `partial: {...}` holds everything so far, flushed, so a run cut short still leaves its numbers;
the last line is one JSON object with every section (or, when onecall itself fails to import, one
line {"import": {"error": ...}}). Nothing is a timed assertion: the exit status
is 1 when tokens differ from transformers' (or TP=N's from one process's), the bfloat16 regret is
out of tolerance, or a section raised, else 0; the speed figures are reported as measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TRACEBACK_LINES = 10  # of the innermost exception's traceback, kept in a section's error record


def error_record(e: BaseException) -> dict[str, Any]:
    """{"error": "<type>: <message>", "traceback_tail": the innermost cause's last lines}."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    lines = "".join(traceback.format_exception(type(root), root, root.__traceback__)).splitlines()
    lines = [line for line in lines if line.strip(" ^~")]  # not the column markers under a call
    return {"error": f"{type(e).__name__}: {e}"[:4000], "traceback_tail": lines[-TRACEBACK_LINES:]}


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # onecall from this source tree
try:
    from onecall.config import EngineConfig
    from onecall.engine.engine import Engine, RequestOutput
    from onecall.engine.engine_parts import LoadedEngineParts
    from onecall.formats.checkpoint import ModelFiles
    from onecall.formats.hf_config import model_config_from_hf
    from onecall.loading.packing import weight_bytes_read
    from onecall.loading.weights import load_weights
    from onecall.model.config import ModelConfig
    from onecall.model.decoder import DecoderLM
    from onecall.model.kv_cache import PagedKVCache
    from onecall.model.state_cache import LinearStateCache
    from onecall.sampling_params import SamplingParams
    from onecall.text.tokenizer import Tokenizer
except Exception as e:  # a tree that does not import still ends in one JSON line saying what broke
    print(
        json.dumps({"bench": "gpu_check", "torch": torch.__version__, "import": error_record(e)}), flush=True
    )
    raise


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
        mc.num_kv_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim, dtype, device
    )
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config = EngineConfig(device=str(device), dtype=dtype_name, block_size=block_size, **cfg)
    if mc.linear_state_shape is not None:  # a hybrid: its linear layers' state beside the KV
        kv.state = LinearStateCache(mc.linear_state_shape, config.num_state_slots, dtype, device)
    parts = LoadedEngineParts(
        files=ModelFiles(kind="hf", path=Path("random-weights"), name="random-weights"),
        model_config=mc, model=model, tokenizer=tokenizer, kv_cache=kv, num_blocks=num_blocks,
        max_model_len=min(mc.max_position_embeddings, num_blocks * block_size), device=device, dtype=dtype,
        load_seconds=0.0, kernels=model.kernels,
    )  # fmt: skip
    return Engine(config, parts=parts)


_request_ids = itertools.count()  # engine request ids, unique across sections


class StepFailed(RuntimeError):
    """A request finished with an error: the engine recovered a step that raised by failing its batch."""


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Add all, step to the end. Returns "outputs" (the final RequestOutput per prompt, in order) and
    "stamps" (per prompt, each streamed token's arrival time). Raises StepFailed (from the step's own
    exception) when a request finishes with an error, after aborting the others."""
    assert not engine.has_unfinished_requests(), "requests left over from an earlier run"
    rids = [f"q{next(_request_ids)}" for _ in prompts]
    index = {rid: i for i, rid in enumerate(rids)}
    final: dict[str, RequestOutput] = {}
    stamps: list[list[float]] = [[] for _ in prompts]
    try:
        for rid, ids in zip(rids, prompts, strict=True):
            engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise StepFailed(f"request {index[out.request_id]}: {out.error}") from out.error
                if out.delta_token_ids:
                    stamps[index[out.request_id]].append(time.perf_counter())
                if out.finished:
                    final[out.request_id] = out
    except BaseException:
        for rid in rids:  # the next section starts on an idle engine
            engine.abort(rid)
        raise
    return {"outputs": [final[rid] for rid in rids], "stamps": stamps}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_info(engine: Engine) -> dict[str, Any]:
    """What the engine's static steps ran: the layouts used, whether each replays a captured graph."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return {"static_steps": False}
    return {
        "static_steps": True,
        "cuda_graphs": any(graphs.buckets.values()) or any(graphs.chunk_buckets.values()),
        "decode_buckets": {str(b): captured for b, captured in sorted(graphs.buckets.items())},
        "chunk_graphs": {
            f"decode {d} + chunk {c}": captured for (d, c), captured in sorted(graphs.chunk_buckets.items())
        },
        "capture_errors": dict(graphs.capture_errors),
    }


# ---- 1. correctness ----------------------------------------------------------------------------
TINY_VOCAB = 512


def tiny_qwen3(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    hidden: int = 128,
    heads: int = 4,
    head_dim: int = 32,
) -> tuple[Any, DecoderLM]:
    """A tiny random Qwen3 (3 layers, 2 KV heads) in transformers, float32 on `device`, and the same
    weights in onecall, in `dtype`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf_config = Qwen3Config(
        vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    hf = Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)  # wide logit gaps: greedy is not decided by rounding
    hf = hf.to(device)
    ours = DecoderLM(model_config_from_hf(hf_config.to_dict()), dtype=dtype, device=device)
    load_weights(ours, ((name, t.to(dtype)) for name, t in hf.state_dict().items()))
    return hf, ours


def hf_greedy(hf: Any, ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([ids], device=hf.device)
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=TINY_VOCAB - 1,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def tiny_engine(ours: DecoderLM, device: torch.device, attention_backend: str | None) -> Engine:
    """The tiny model's engine. `attention_backend` overrides the engine's choice (the tests run
    "triton" on CPU under TRITON_INTERPRET=1, with the static steps eager: no capture on CPU)."""
    dtype = ours.model.norm.weight.dtype
    engine = make_engine(ours, synthetic_tokenizer(TINY_VOCAB), device, dtype, 4096)
    hybrid = ours.config.linear_state_shape is not None  # its state runs eager steps only
    if attention_backend == "triton" and engine.runner.decode_graphs is None and not hybrid:
        engine.enable_static_decode(capture=device.type == "cuda", backend="triton")
    elif attention_backend is not None:
        engine.runner.attention_backend = attention_backend
    return engine


def check_tiny_qwen3(
    device: torch.device, attention_backend: str | None = None, max_tokens: int = 24
) -> dict[str, Any]:
    """Greedy tokens of onecall's engine against transformers' generate, 3 prompts in one batch."""
    hf, ours = tiny_qwen3(device)
    engine = tiny_engine(ours, device, attention_backend)
    prompts = [[(7 * i + 3 * j) % (TINY_VOCAB - 1) for j in range(5 + 6 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = run(engine, prompts, params)["outputs"]
    mismatches = []
    for i, ids in enumerate(prompts):
        ref = hf_greedy(hf, ids, max_tokens)
        if ref != list(got[i].token_ids):
            mismatches.append({"prompt": i, "transformers": ref, "onecall": list(got[i].token_ids)})
    return {
        "tokens_equal": not mismatches,
        "attention_backend": engine.runner.attention_backend,
        "mismatches": mismatches,
        "graphs": graph_info(engine),
    }


def check_new_family(
    device: torch.device, family: str, attention_backend: str | None = None, max_tokens: int = 12
) -> dict[str, Any]:
    """A newer family's tiny random model, float32, greedy through onecall's engine against transformers'
    generate on the same device: "qwen3_5" (the hybrid: Gated DeltaNet's state cache beside the paged
    KV), "gpt_oss" (attention sinks in the paged / Triton kernels, sliding layers, its MoE), "gemma4"
    (per-layer embeddings, KV shared by the last layers, proportional RoPE) and "deepseek_v3" (the
    latent KV cache, grouped routing). Three prompts in one batch; the tokens must be equal."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        hf_config: Any = Qwen3_5TextConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        )  # fmt: skip
        hf = Qwen3_5ForCausalLM(hf_config)
    elif family == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        hf_config = GptOssConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        )  # fmt: skip
        hf = GptOssForCausalLM(hf_config)
    elif family == "gemma4":  # per-layer embeddings, the last two layers' KV shared, double-wide MLPs
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        sliding, full = "sliding_attention", "full_attention"
        hf_config = Gemma4TextConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6,
            max_position_embeddings=512, layer_types=[sliding, full] * 3,
            rope_parameters={sliding: {"rope_type": "default", "rope_theta": 10000.0},
                             full: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "factor": 2.0, "rope_theta": 1e6}},
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB, num_kv_shared_layers=2,
            use_double_wide_mlp=True, final_logit_softcapping=30.0,
        )  # fmt: skip
        hf = Gemma4ForCausalLM(hf_config)
    elif family == "deepseek_v3":  # multi-head latent attention, grouped top-k routing, a shared expert
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        hf_config = DeepseekV3Config(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            first_k_dense_replace=1, max_position_embeddings=512, rope_interleave=True,
        )  # fmt: skip
        hf = DeepseekV3ForCausalLM(hf_config)
    else:
        raise ValueError(f"unknown family {family!r}")
    hf = hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p)) if family != "qwen3_5" else p.normal_(0.0, 0.2)
            elif "A_log" in name:
                p.uniform_(-2.0, 0.0)
            else:
                p.normal_(0.0, 0.3)  # wide logit gaps: greedy is not decided by rounding
        for name, buf in hf.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: each layer's output scale
                buf.copy_(0.5 + torch.rand_like(buf))
            elif name.endswith("e_score_correction_bias"):  # DeepSeek: the routing bias
                buf.copy_(0.3 * torch.randn_like(buf))
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device=device)
    load_weights(ours, hf.state_dict().items())
    hf = hf.to(device)
    engine = tiny_engine(ours, device, attention_backend)
    prompts = [[(5 * i + 7 * j + 1) % (TINY_VOCAB - 1) for j in range(4 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = run(engine, prompts, params)["outputs"]
    mismatches = []
    for i, ids in enumerate(prompts):
        ref = hf_greedy(hf, ids, max_tokens)
        if ref != list(got[i].token_ids):
            mismatches.append({"prompt": i, "transformers": ref, "onecall": list(got[i].token_ids)})
    return {"tokens_equal": not mismatches, "attention_backend": engine.runner.attention_backend,
            "mismatches": mismatches}  # fmt: skip


def check_cached_chunk(
    device: torch.device, attention_backend: str | None = None, max_tokens: int = 16
) -> dict[str, Any]:
    """A prompt whose first block (16 tokens) is cached, its 13 new tokens fed as one chunk in the
    step where another request decodes: on CUDA the static layout "decode 1 + chunk 16", captured
    as a graph. Both requests' greedy tokens against transformers'."""
    hf, ours = tiny_qwen3(device)
    engine = tiny_engine(ours, device, attention_backend)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prefix = [(5 * j + 11) % (TINY_VOCAB - 1) for j in range(20)]
    run(engine, [prefix], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))  # caches 1 block
    decoding = [(3 * j + 1) % (TINY_VOCAB - 1) for j in range(9)]
    chunked = prefix[:16] + [(13 * j + 2) % (TINY_VOCAB - 1) for j in range(13)]
    outs: dict[str, RequestOutput] = {}
    added = False
    try:
        engine.add_request("decoding", decoding, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise StepFailed(f"{out.request_id}: {out.error}") from out.error
                if out.finished:
                    outs[out.request_id] = out
            if not added:  # "decoding" is prefilled: the chunk joins its first decode step
                engine.add_request("chunked", chunked, params)
                added = True
    except BaseException:
        engine.abort("decoding")
        engine.abort("chunked")
        raise
    mismatches = []
    for rid, ids in (("decoding", decoding), ("chunked", chunked)):
        ref = hf_greedy(hf, ids, max_tokens)
        if ref != list(outs[rid].token_ids):
            mismatches.append({"request": rid, "transformers": ref, "onecall": list(outs[rid].token_ids)})
    return {
        "tokens_equal": not mismatches,
        "cached_tokens": outs["chunked"].num_cached_tokens,
        "attention_backend": engine.runner.attention_backend,
        "mismatches": mismatches,
        "graphs": graph_info(engine),
    }


BF16_MAX_REGRET = 1.0  # float32 logits; reference kernels on CPU in bfloat16: at most 0.13 (std ~4.8)


def check_tiny_qwen3_bf16(
    device: torch.device, attention_backend: str | None = None, max_tokens: int = 24
) -> dict[str, Any]:
    """The tiny Qwen3 at the 8B model's head shape (head_dim 128, 8 query / 2 KV heads) in bfloat16
    through the engine (on CUDA the Triton kernels and the graphs, in bfloat16), greedy, 3 prompts.
    Rounding may flip near-ties, so tokens are not compared: each chosen token is scored by the
    float32 transformers model on the same prefix (onecall's own tokens before it), its regret being
    the float32 logit of the best token minus that of the chosen one. A bfloat16 path that computes
    the right thing keeps every regret small; a broken one picks tokens far from the best (the
    logits' spread is ~4.8). Within tolerance: every regret <= BF16_MAX_REGRET."""
    hf, ours = tiny_qwen3(device, torch.bfloat16, hidden=256, heads=8, head_dim=128)
    engine = tiny_engine(ours, device, attention_backend)
    prompts = [[(7 * i + 3 * j) % (TINY_VOCAB - 1) for j in range(5 + 6 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    regrets: list[float] = []
    not_best = 0
    for ids, out in zip(prompts, run(engine, prompts, params)["outputs"], strict=True):
        chosen = torch.tensor(list(out.token_ids), device=device)
        with torch.no_grad():
            x = torch.tensor([ids + chosen.tolist()], device=device)
            logits = hf(x).logits[0, len(ids) - 1 : -1].float()  # (max_tokens, vocab): what picked each
        regret = logits.max(dim=-1).values - logits.gather(1, chosen[:, None])[:, 0]
        regrets += regret.tolist()
        not_best += int((regret > 0).sum())
    return {
        "within_tolerance": max(regrets) <= BF16_MAX_REGRET,
        "max_regret": max(regrets),
        "mean_regret": sum(regrets) / len(regrets),
        "tokens_not_float32_best": not_best,
        "tokens": len(regrets),
        "tolerance": BF16_MAX_REGRET,
        "attention_backend": engine.runner.attention_backend,
        "graphs": graph_info(engine),
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
    return {
        "size": size,
        "tokens_equal": tokens[1] == tokens[size],
        "tp1": tokens[1],
        f"tp{size}": tokens[size],
    }


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


def shape_8b(num_layers: int, hidden: int) -> ModelConfig:
    """Qwen3-8B's shape at `num_layers` layers; a smaller `hidden` scales the heads and the MLP."""
    scale = hidden / 4096
    return ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=int(12288 * scale),
        num_hidden_layers=num_layers, num_attention_heads=max(1, int(32 * scale)),
        num_key_value_heads=max(1, int(8 * scale)), head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
    )  # fmt: skip


@dataclass
class Bench:
    """What the sections share: the device, the 8B-shaped model and its engines, figures later
    sections derive from (weight bytes, bandwidth), and the random prompt ids."""

    device: torch.device
    num_layers: int
    hidden: int
    tensor_parallel: int
    model: DecoderLM | None = None
    engines: dict[str, Engine] = field(default_factory=dict)
    weight_bytes: int | None = None
    floor_ms: float | None = None
    rng: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1))

    def ids(self, n: int) -> list[int]:
        assert self.model is not None
        return torch.randint(0, self.model.vocab_size - 1, (n,), generator=self.rng).tolist()

    def engine(self, kind: str) -> Engine:
        """The 8B model's engine: "graphs" (CUDA graphs, the default on CUDA) or "eager" (graphs
        off), built on first use, and again when an earlier section left it dead."""
        assert self.model is not None
        engine = self.engines.get(kind)
        if engine is not None and engine.dead_reason is None:
            return engine
        self.engines.pop(kind, None)
        tokenizer = synthetic_tokenizer(self.model.vocab_size)
        if kind == "graphs":
            engine = make_engine(self.model, tokenizer, self.device, torch.bfloat16, 80_000,
                                 max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=True)  # fmt: skip
        else:
            engine = make_engine(
                self.model, tokenizer, self.device, torch.bfloat16, 20_000, cuda_graphs=False
            )
        self.engines[kind] = engine
        return engine

    def clean_up(self) -> None:
        """After a section raised (its requests were aborted by run()): return the cached memory."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def decode_ms_per_step(b: Bench, engine: Engine) -> float:
    """Batch-1 decode: gaps between streamed tokens, the first decode step (a capture) excluded."""
    stamps = run(engine, [b.ids(16)], greedy(64))["stamps"][0]
    assert len(stamps) == 64, f"{len(stamps)} tokens streamed, 64 asked for"
    return 1e3 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def ttft_ms(b: Bench, engine: Engine) -> tuple[float, int]:
    """TTFT of a 1,000-token cached prefix + 20 new tokens (the prefix enters the cache first)."""
    prefix = b.ids(1000)
    run(engine, [prefix], greedy(1))
    out = run(engine, [prefix + b.ids(20)], greedy(1))["outputs"][0]
    return 1e3 * (out.trace.first_token_time - out.trace.arrival_time), out.num_cached_tokens


# ---- the sections (each returns its JSON record) ---------------------------------------------------
def sec_environment(b: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if b.device.type == "cuda":
        props = torch.cuda.get_device_properties(b.device)
        out |= {
            "gpu": props.name, "gpus": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}",
            "memory_gib": props.total_memory / 2**30,
        }  # fmt: skip
    return out


def sec_tiny_qwen3(b: Bench) -> dict[str, Any]:
    return check_tiny_qwen3(b.device)


def sec_tiny_qwen3_chunk(b: Bench) -> dict[str, Any]:
    return check_cached_chunk(b.device)


def sec_tiny_qwen3_bf16(b: Bench) -> dict[str, Any]:
    return check_tiny_qwen3_bf16(b.device)


def sec_tiny_qwen3_5(b: Bench) -> dict[str, Any]:
    return check_new_family(b.device, "qwen3_5")


def sec_tiny_gpt_oss(b: Bench) -> dict[str, Any]:
    return check_new_family(b.device, "gpt_oss")


def sec_tiny_gemma4(b: Bench) -> dict[str, Any]:
    return check_new_family(b.device, "gemma4")


def sec_tiny_deepseek_v3(b: Bench) -> dict[str, Any]:
    return check_new_family(b.device, "deepseek_v3")


def sec_tensor_parallel(b: Bench) -> dict[str, Any]:
    size = b.tensor_parallel
    gpus = torch.cuda.device_count() if b.device.type == "cuda" else 0
    if size < 2:
        return {"skipped": f"--tensor-parallel {size}"}
    if b.device.type == "cuda" and gpus < size:
        return {"skipped": f"needs {size} GPUs, found {gpus}"}
    return check_tensor_parallel(b.device, size)


def sec_model_8b(b: Bench) -> dict[str, Any]:
    b.model = random_model(shape_8b(b.num_layers, b.hidden), b.device)
    b.weight_bytes = weight_bytes_read(b.model, 1)
    engine = b.engine("graphs")
    return {
        "layers": b.num_layers, "hidden": b.hidden, "weight_bytes": b.weight_bytes,
        "attention_backend": engine.runner.attention_backend, "static_steps": engine.runner.decode_graphs is not None,
    }  # fmt: skip


def sec_copy_bandwidth(b: Bench) -> dict[str, Any]:
    bandwidth = copy_bandwidth(b.device)
    out: dict[str, Any] = {"copy_bandwidth_gb_s": bandwidth / 1e9}
    if b.weight_bytes is not None:
        b.floor_ms = 1e3 * b.weight_bytes / bandwidth
        out["decode_floor_ms"] = b.floor_ms
    return out


def sec_warmup(b: Bench) -> dict[str, Any]:
    # Triton compiles a kernel per new shape class on first use (measured: the first 1,024-token
    # prefill ran at 1.3k tok/s, the next ones at 29k), so every kind of step timed below runs once
    # first: a short prompt and its decode, a long prompt, a chunk after a cached prefix
    engine = b.engine("graphs")
    run(engine, [b.ids(16)], greedy(8))
    sync(b.device)
    t0 = time.perf_counter()
    run(engine, [b.ids(1024)], greedy(1))
    sync(b.device)
    first_prefill_s = time.perf_counter() - t0
    prefix = b.ids(1000)
    run(engine, [prefix], greedy(1))
    run(engine, [prefix + b.ids(20)], greedy(1))
    return {"first_prefill_s_with_compile": first_prefill_s}


def sec_decode_graphs(b: Bench) -> dict[str, Any]:
    engine = b.engine("graphs")
    ms = decode_ms_per_step(b, engine)
    out: dict[str, Any] = {
        "decode_ms_per_step": ms,
        "replayed_graph": graph_info(engine).get("decode_buckets"),
    }
    if b.floor_ms is not None:
        out["fraction_of_floor"] = b.floor_ms / ms
    return out


def sec_decode_eager(b: Bench) -> dict[str, Any]:
    engine = b.engine("eager")
    run(engine, [b.ids(16)], greedy(8))  # warm-up
    ms = decode_ms_per_step(b, engine)
    out: dict[str, Any] = {"decode_ms_per_step_eager": ms}
    if b.floor_ms is not None:
        out["fraction_of_floor"] = b.floor_ms / ms
    return out


def sec_ttft_eager(b: Bench) -> dict[str, Any]:
    engine = b.engine("eager")
    first, _ = ttft_ms(b, engine)  # warm-up: its chunk shapes
    ms, cached = ttft_ms(b, engine)
    del b.engines["eager"]  # its KV pool goes back before the graphs engine's timed sections
    return {"ttft_cached_1000_plus_20_ms_eager": ms, "first_request_ms": first, "cached_tokens": cached}


def sec_batch64(b: Bench) -> dict[str, Any]:
    engine = b.engine("graphs")
    run(engine, [b.ids(32) for _ in range(64)], greedy(2))  # warm-up: the 64-row decode graph's capture
    prompts = [b.ids(32) for _ in range(64)]
    sync(b.device)
    t0 = time.perf_counter()
    outs = run(engine, prompts, greedy(32))["outputs"]
    sync(b.device)
    return {"batch64_tokens_per_s": sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)}


def sec_prefill_1024(b: Bench) -> dict[str, Any]:
    engine = b.engine("graphs")
    prompt = b.ids(1024)
    sync(b.device)
    t0 = time.perf_counter()
    run(engine, [prompt], greedy(1))
    sync(b.device)
    return {"prefill_tokens_per_s": 1024 / (time.perf_counter() - t0)}


def sec_ttft_graphs(b: Bench) -> dict[str, Any]:
    engine = b.engine("graphs")
    first, _ = ttft_ms(b, engine)  # its layout's capture, unless the warm-up ran it
    ms, cached = ttft_ms(b, engine)
    return {"ttft_cached_1000_plus_20_ms": ms, "first_request_ms": first, "cached_tokens": cached}


def sec_graphs(b: Bench) -> dict[str, Any]:
    return graph_info(b.engine("graphs"))


@dataclass(frozen=True)
class Section:
    name: str
    fn: Callable[[Bench], dict[str, Any]]
    needs: tuple[str, ...] = ()  # sections that must have run without an error first


_8B = ("model_8b",)
SECTIONS = (
    Section("environment", sec_environment),
    Section("tiny_qwen3", sec_tiny_qwen3),
    Section("tiny_qwen3_chunk", sec_tiny_qwen3_chunk),
    Section("tiny_qwen3_bf16", sec_tiny_qwen3_bf16),
    Section("tiny_qwen3_5", sec_tiny_qwen3_5),
    Section("tiny_gpt_oss", sec_tiny_gpt_oss),
    Section("tiny_gemma4", sec_tiny_gemma4),
    Section("tiny_deepseek_v3", sec_tiny_deepseek_v3),
    Section("tensor_parallel", sec_tensor_parallel),
    Section("model_8b", sec_model_8b),
    Section("copy_bandwidth", sec_copy_bandwidth),
    Section("warmup", sec_warmup, _8B),
    Section("decode_graphs", sec_decode_graphs, _8B),
    Section("decode_eager", sec_decode_eager, _8B),
    Section("ttft_eager", sec_ttft_eager, _8B),
    Section("batch64", sec_batch64, _8B),
    Section("prefill_1024", sec_prefill_1024, _8B),
    Section("ttft_graphs", sec_ttft_graphs, _8B),
    Section("graphs", sec_graphs, _8B),
)
BY_NAME = {s.name: s for s in SECTIONS}


def run_section(section: Section, b: Bench) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        record = section.fn(b)
        sync(b.device)  # a kernel's asynchronous fault surfaces in the section that launched it
    except Exception as e:  # fail-soft: record it, go on with the next section
        record = error_record(e)
        try:
            b.clean_up()
        except Exception as cleanup:
            record["clean_up_error"] = f"{type(cleanup).__name__}: {cleanup}"
        if b.device.type == "cuda":  # a device-side fault (an illegal address) poisons the context
            record["cuda_usable_after"] = cuda_usable(b.device)
    record["seconds"] = time.perf_counter() - t0
    return record


def cuda_usable(device: torch.device) -> bool | str:
    """True when a small kernel still runs on the device, else the error it raises."""
    try:
        torch.ones(8, device=device).add_(1).sum().item()
        torch.cuda.synchronize(device)
        return True
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:500]


def selected(names: list[str] | None) -> list[Section]:
    """The sections asked for and what they need, in the order they run (all when names is None)."""
    if names is None:
        return list(SECTIONS)
    wanted = set(names)
    for name in names:
        wanted |= set(BY_NAME[name].needs)
    return [s for s in SECTIONS if s.name in wanted]


def run_all(b: Bench, sections: list[Section], max_seconds: float | None) -> dict[str, Any]:
    """Run the sections in order; print a readable line and a `partial: {...}` JSON line after each."""
    result: dict[str, Any] = {
        "bench": "gpu_check",
        "device": str(b.device),
        "sections": [s.name for s in sections],
    }
    t0 = time.perf_counter()
    for section in sections:
        spent = time.perf_counter() - t0
        failed = [n for n in section.needs if "error" in result.get(n, {}) or "skipped" in result.get(n, {})]
        ran = [s.name for s in sections if s.name in result]
        lost = [n for n in ran if result[n].get("cuda_usable_after", True) is not True]
        if max_seconds is not None and spent > max_seconds:
            record: dict[str, Any] = {"skipped": f"--max-seconds {max_seconds:g} spent ({spent:.0f} s)"}
        elif lost:
            record = {
                "skipped": f"the CUDA context failed after {lost[0]}'s error (see its cuda_usable_after)"
            }
        elif failed:
            record = {"skipped": f"needs {', '.join(failed)}, which did not run: {result[failed[0]]}"[:1000]}
        else:
            record = run_section(section, b)
        result[section.name] = record
        print(f"{section.name}: {brief(record)}", flush=True)
        print("partial: " + json.dumps(result, default=str), flush=True)
    result["errors"] = [s.name for s in sections if "error" in result[s.name]]
    result["mismatches"] = [
        s.name
        for s in sections
        if result[s.name].get("tokens_equal") is False or result[s.name].get("within_tolerance") is False
    ]
    result["skipped"] = [s.name for s in sections if "skipped" in result[s.name]]
    result["wall_s"] = time.perf_counter() - t0
    return result


def brief(record: dict[str, Any]) -> str:
    """One readable line: the error, the reason for a skip, or the record's top-level numbers."""
    if "error" in record:
        return "ERROR " + record["error"].splitlines()[0][:300]
    if "skipped" in record:
        return "skipped: " + record["skipped"]
    parts = []
    for k, v in record.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        elif isinstance(v, (bool, int, str)) or v is None:
            parts.append(f"{k}={v}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=36, help="layers of the 8B-shaped model")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size (heads scale with it)")
    ap.add_argument(
        "--tensor-parallel", type=int, default=2,
        help="ranks of the tensor-parallel check (runs on CUDA when that many GPUs are there; 0: skip)",
    )  # fmt: skip
    ap.add_argument(
        "--sections", type=lambda s: [n.strip() for n in s.split(",") if n.strip()], default=None,
        help=f"comma list of sections to run (with those they need); default all: {','.join(BY_NAME)}",
    )  # fmt: skip
    ap.add_argument(
        "--max-seconds", type=float, default=480.0,
        help="after this many seconds no further section starts (those left are recorded as skipped); "
        "0: no limit",
    )  # fmt: skip
    args = ap.parse_args(argv)
    unknown = [n for n in args.sections or [] if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {','.join(BY_NAME)}")
    b = Bench(torch.device(args.device), args.layers, args.hidden, args.tensor_parallel)
    result = run_all(b, selected(args.sections), args.max_seconds or None)
    print(json.dumps(result, default=str), flush=True)
    return 1 if result["errors"] or result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
