"""The checks every family's test module runs against transformers' own class, on the paged cache.

A family's test (tests/model/test_gemma4.py, test_deepseek.py) builds a tiny random-weight model with
transformers, loads it into a DecoderLM and calls these with its own tolerances (written in its
docstring, with what was measured): a prefill then greedy decode steps, two sequences decoding in one
step on the reference attention backend, and a prefill split into chunks against one chunk. The pool
is sized as the engine sizes it (ModelConfig.num_kv_layers: layers that share K/V hold none). Then the
engine itself on a saved folder (`check_engine_generates_as_transformers`) with the word-level
tokenizer every tiny folder carries (`write_word_level_tokenizer`: "t0" .. "tN", one word a token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from onecall import LLM, SamplingParams
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from tests.model.test_model_numerics import BLOCK_SIZE, NUM_BLOCKS, VOCAB, Harness, Seq, hf_logits, prompt


class KVHarness(Harness):
    """test_model_numerics' Harness with the pool the engine builds: num_kv_layers cache layers."""

    def __init__(self, model: DecoderLM, seed: int = 1) -> None:
        super().__init__(model, seed)
        c = model.config
        self.kv_cache = PagedKVCache(
            c.num_kv_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
        )


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.2e} > {atol}"


def randomize(hf: Any) -> None:
    """Every norm weight 1 + 0.2 N, every other parameter 0.15 N (from torch's global generator, which the
    caller seeds): large enough that a missing detail moves the logits by far more than the tolerances."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))


def check_prefill_then_decode(hf: Any, ours: DecoderLM, atol: float) -> tuple[Seq, torch.Tensor]:
    """A 20-token prefill, then 6 greedy decode steps through the paged cache, each step's logits against
    transformers' over the whole sequence. Returns the sequence and transformers' logits over it."""
    harness = KVHarness(ours)
    seq = Seq(prompt(20, seed=3))
    (logits,) = harness.step([(seq, 20)])
    assert_close(logits, hf_logits(hf, seq.tokens), atol)
    steps = []
    for _ in range(6):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    ref = hf_logits(hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[20 + i], atol)
    return seq, ref


def check_batched_decode_on_reference(hf: Any, ours: DecoderLM, atol: float) -> None:
    """Two sequences prefilled together, then decoding in one step, on the reference attention backend
    (slot lists), each against transformers."""
    harness = KVHarness(ours)
    a, b = Seq(prompt(9, seed=5)), Seq(prompt(14, seed=6))
    harness.step([(a, 9), (b, 14)], backend="reference")
    a.tokens.append(7)
    b.tokens.append(11)
    la, lb = harness.step([(a, 1), (b, 1)], backend="reference", num_decode=2)
    assert_close(la[-1], hf_logits(hf, a.tokens)[-1], atol)
    assert_close(lb[-1], hf_logits(hf, b.tokens)[-1], atol)


def check_chunked_prefill(ours: DecoderLM, atol: float) -> None:
    """A 20-token prompt prefilled as 7 + 6 + 7 rows against one chunk of 20."""
    tokens = prompt(20, seed=4)
    (whole,) = KVHarness(ours).step([(Seq(list(tokens)), 20)])
    harness, seq = KVHarness(ours), Seq(list(tokens))
    parts = [harness.step([(seq, n)])[0] for n in (7, 6, 7)]
    assert_close(torch.cat(parts), whole, atol)


def write_word_level_tokenizer(folder: Path, vocab: int = VOCAB, **config: Any) -> None:
    """A tokenizer.json whose token i is the word "t{i}" (whitespace-split), and a tokenizer_config.json
    of `config` (eos "t1" unless given): prompts are written as "t5 t17 ..." and decode back to them."""
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", **config}))


def check_engine_generates_as_transformers(hf: Any, folder: Path, architecture: str) -> Any:
    """`hf` saved to `folder` and run through LLM (the engine: its KV pool, scheduler, paged cache,
    sampler), greedy, against transformers' generate: a 20-token prompt, 10 new tokens; then a second
    request sharing the first 16 tokens, which must hit the prefix cache (its attention reads blocks it
    never wrote) and still generate as transformers does. Returns the engine's ModelConfig and info."""
    hf.save_pretrained(folder)
    write_word_level_tokenizer(folder)
    first, second = prompt(20, seed=8), prompt(20, seed=8)[:16] + prompt(5, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(folder), kv_cache_gib=0.01, num_threads=1) as llm:
        assert llm.engine.model_config.architecture == architecture
        outs = [llm.generate([p], params)[0] for p in (first, second)]
        seen = llm.engine.model_config, llm.info
    assert outs[1].num_cached_tokens >= 12  # whole blocks of the shared 16 tokens
    for p, out in zip((first, second), outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        assert list(out.token_ids) == want
    return seen
