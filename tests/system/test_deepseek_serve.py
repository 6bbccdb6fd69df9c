"""`onecall serve` on a DeepSeek-V3 model folder (tests/model/test_deepseek.py's tiny "lora" variant: multi-head
latent attention with q_lora_rank, interleaved RoPE, a grouped sigmoid router over 8 routed experts and a
shared one, saved by transformers), driven by the official openai client:

- a chat reply and a streamed reply are the tokens transformers' generate writes for the rendered prompt;
- a second turn that re-sends the first turn's prompt and reply hits the prefix cache (usage.cached_tokens
  and the trace's num_cached_tokens agree), and its greedy reply is transformers' too, so the attention
  that reads latent rows it never wrote is right;
- /server_info's pool is sized in latent rows: with --kv-cache-gib set, the pool holds exactly the blocks
  that budget buys at (kv_lora_rank + qk_rope_head_dim) values a token a layer (the latent row split over
  the pool's K and V halves), not at per-head K and V.

The tokenizer is a word-level one over the model's 512 ids ("t0" .. "t511", whitespace-split) and the chat
template joins the messages' words and ends the prompt with "t2", so the prompt's ids are known and the
reply's words are its ids.

A second server runs the same model with DeepSeek-V3.1's real chat template (tests/data/chat_templates/) in
tokenizer_config.json and its markers (<｜User｜>, <｜Assistant｜>, </think>, ...) as special tokens at ids of the
vocabulary: the prompt it renders and encodes (the trace's text and ids) is what transformers' AutoTokenizer
renders and encodes from the same folder, and its greedy tokens are transformers' argmax continuation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tests.helpers.family_checks import write_word_level_tokenizer
from tests.helpers.server_process import ServerProcess
from tests.model.test_deepseek import build
from tests.model.test_model_numerics import VOCAB, prompt

pytestmark = pytest.mark.server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t2{% endif %}"
KV_CACHE_GIB = 0.001  # 1 MiB: blocks enough for these prompts, and an exact figure to check the pool against
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Any]]:
    hf, _ = build("lora")
    folder = Path(tmp_path_factory.mktemp("deepseek")) / "tiny-deepseek-v3"
    hf.save_pretrained(folder)
    write_word_level_tokenizer(folder, bos_token="t3", add_bos_token=False, chat_template=TEMPLATE)
    proc = ServerProcess(
        "--model", str(folder), "--served-model-name", "tiny-deepseek", "--max-model-len", "128",
        "--kv-cache-gib", str(KV_CACHE_GIB),
    )  # fmt: skip
    try:
        yield proc.start(), hf
    finally:
        proc.stop()


def _want(hf: Any, ids: list[int], n: int) -> list[str]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    return [f"t{i}" for i in out]


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="-", max_retries=0, timeout=120)


def test_chat_and_stream_are_transformers_generate(served: tuple[ServerProcess, Any]) -> None:
    server, hf = served
    client = _client(server)
    ids = prompt(18, seed=11)
    messages: Any = [{"role": "user", "content": _words(ids)}]
    want = _want(hf, ids + [2], MAX_TOKENS)
    kwargs: dict[str, Any] = dict(
        model="tiny-deepseek", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    first = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens == len(ids) + 1
    assert first.usage.completion_tokens == MAX_TOKENS
    assert (first.choices[0].message.content or "").split() == want
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.split() == want


def test_second_turn_hits_the_prefix_cache(served: tuple[ServerProcess, Any]) -> None:
    """Turn two re-sends turn one's prompt and reply: whole blocks of it come from the cache (the usage
    and the trace say how many), and the reply is still transformers' greedy continuation."""
    server, hf = served
    client = _client(server)
    ids = prompt(21, seed=12)
    messages: Any = [{"role": "user", "content": _words(ids)}]
    first = client.chat.completions.create(
        model="tiny-deepseek", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    reply = first.choices[0].message.content or ""
    follow_up = prompt(5, seed=13)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": _words(follow_up)}]
    second = client.chat.completions.create(
        model="tiny-deepseek", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "trace": True},
    )  # fmt: skip
    # the second prompt: the first prompt's words, the reply's, the follow-up's, then "t2"
    second_ids = ids + [int(w[1:]) for w in reply.split()] + follow_up + [2]
    assert second.usage is not None and second.usage.prompt_tokens == len(second_ids)
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    trace = (second.model_extra or {})["trace"]
    assert cached >= 16 and trace["num_cached_tokens"] == cached  # at least the first prompt's whole blocks
    assert trace["prompt_token_ids"] == second_ids
    assert (second.choices[0].message.content or "").split() == _want(hf, second_ids, MAX_TOKENS)


def test_the_pool_is_sized_in_latent_rows(served: tuple[ServerProcess, Any]) -> None:
    server, hf = served
    c = hf.config
    info = httpx.get(server.url("/server_info"), timeout=10).json()
    assert info["dtype"] == "float32"
    latent = c.kv_lora_rank + c.qk_rope_head_dim  # one latent row a token a layer: [c_kv | k_pe]
    bytes_per_block = c.num_hidden_layers * info["page_size"] * latent * 4  # float32
    assert info["num_kv_blocks"] == int(KV_CACHE_GIB * 2**30) // bytes_per_block
    assert info["max_total_num_tokens"] == info["num_kv_blocks"] * info["page_size"]


# ---- the same model with DeepSeek-V3.1's real chat template (tests/data/chat_templates/) -------------------
REAL_TEMPLATE = Path(__file__).parent.parent / "data" / "chat_templates" / "deepseek-ai-DeepSeek-V3.1.jinja"
# the template's markers, given ids of the 512-id model's vocabulary (the other ids stay words "t<i>")
MARKERS = {
    1: "<｜end▁of▁sentence｜>",
    3: "<｜begin▁of▁sentence｜>",
    4: "<｜User｜>",
    5: "<｜Assistant｜>",
    6: "</think>",
    7: "<think>",
}


@pytest.fixture(scope="module")
def served_real_template(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Any, Path]]:
    hf, _ = build("lora")
    folder = Path(tmp_path_factory.mktemp("deepseek-real")) / "tiny-deepseek-v3"
    hf.save_pretrained(folder)
    vocab = {MARKERS.get(i, f"t{i}"): i for i in range(VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tok.add_special_tokens(list(MARKERS.values()))  # matched whole, at their vocabulary ids
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": MARKERS[3],
        "eos_token": MARKERS[1],
        "add_bos_token": False,
        "chat_template": REAL_TEMPLATE.read_text(encoding="utf-8"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    proc = ServerProcess(
        "--model", str(folder), "--served-model-name", "tiny-deepseek", "--max-model-len", "128"
    )
    try:
        yield proc.start(), hf, folder
    finally:
        proc.stop()


def test_the_real_template_is_rendered_and_served_as_transformers_does(
    served_real_template: tuple[ServerProcess, Any, Path],
) -> None:
    """The folder's DeepSeek-V3.1 template: the server's prompt (the trace's text and ids) is what
    transformers' AutoTokenizer renders and encodes, and the greedy reply is transformers' generate on it."""
    from transformers import AutoTokenizer

    server, hf, folder = served_real_template
    ids = [8 + i % (VOCAB - 8) for i in prompt(14, seed=21)]  # words only, no marker ids
    messages: Any = [
        {"role": "system", "content": _words(prompt(4, seed=22)).replace("t0", "t9")},
        {"role": "user", "content": _words(ids)},
    ]
    reference = AutoTokenizer.from_pretrained(folder)
    want_text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = reference.encode(want_text, add_special_tokens=False)
    assert want_ids[0] == 3 and want_ids[-2:] == [5, 6]  # BOS ... <｜Assistant｜></think> (thinking off)
    reply = _client(server).chat.completions.create(
        model="tiny-deepseek", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "trace": True},
    )  # fmt: skip
    trace = (reply.model_extra or {})["trace"]
    assert trace["prompt_text"] == want_text
    assert trace["prompt_token_ids"] == want_ids
    generated = [s["token_id"] for s in trace["steps"] if s["token_id"] is not None]
    assert generated == _greedy(hf, want_ids, MAX_TOKENS)


def _greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """transformers' model, argmax n times over the whole sequence: no EOS stop (the server ignores EOS here,
    and id 1 is this folder's EOS), no cache."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]
