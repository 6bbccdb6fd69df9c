"""A real Engine around a tiny random-weight model and the embedded model's real tokenizer.

The model is small enough that a step costs a millisecond or two, and its weights
are scaled so that logit gaps are wide: greedy argmax does not flip between
batched and unbatched float32 arithmetic (differences ~1e-6) in these tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine
from onecall.engine.engine_parts import LoadedEngineParts
from onecall.formats.checkpoint import ModelFiles, resolve_model
from onecall.formats.gguf import open_gguf
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from onecall.text.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1)
def embedded_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(resolve_model(None).path).metadata)


@functools.lru_cache(maxsize=4)
def tiny_model(arch: str = "llama", seed: int = 0) -> DecoderLM:
    tok = embedded_tokenizer()
    mc = ModelConfig(
        architecture=arch,
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    torch.manual_seed(seed)
    model = DecoderLM(mc, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)  # parameters start uninitialised (DecoderLM builds on "meta")
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5 if "embed" not in name else 1.0)
    return model.eval()


def tiny_engine(
    num_blocks: int = 256,
    block_size: int = 4,
    arch: str = "llama",
    model: DecoderLM | None = None,
    files: ModelFiles | None = None,
    **config: Any,
) -> Engine:
    """The tiny model (or `model`) as an engine. `files`: the model files the engine claims to run
    (what bundles hash and traces name); the embedded GGUF's when not given."""
    model = model or tiny_model(arch)
    mc = model.config
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=block_size, **config)
    kv_cache = PagedKVCache(
        mc.num_hidden_layers,
        num_blocks,
        block_size,
        mc.num_key_value_heads,
        mc.head_dim,
        torch.float32,
        "cpu",
    )
    max_len = min(mc.max_position_embeddings, num_blocks * block_size)
    parts = LoadedEngineParts(
        files=files or resolve_model(None),
        model_config=mc,
        model=model,
        tokenizer=embedded_tokenizer(),
        kv_cache=kv_cache,
        num_blocks=num_blocks,
        max_model_len=max_len,
        device=torch.device("cpu"),
        dtype=torch.float32,
        load_seconds=0.0,
    )
    return Engine(cfg, parts=parts)


def run_all(engine: Engine, prompts: dict[str, Any], params: Any) -> dict[str, Any]:
    """Add every prompt at once, step until all finish; returns the final outputs by id."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params if not isinstance(params, dict) else params[rid])
    final = drain(engine)
    assert set(final) == set(prompts), "engine stopped stepping before every request finished"
    return final


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, Any]:
    """Step until nothing is unfinished; the final output of every request that finished, by id."""
    final: dict[str, Any] = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            return final
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
