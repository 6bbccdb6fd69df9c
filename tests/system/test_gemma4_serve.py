"""`onecall serve` on a Gemma 4 model folder (tests/model/test_gemma4.py's tiny e2b variant: per-layer
inputs, KV-sharing layers, proportional RoPE, saved by transformers), driven by the official openai
client: a chat reply and a streamed reply are the tokens transformers' generate writes for the rendered
prompt, and a second request re-sending the first's prompt hits the prefix cache.

The tokenizer is a word-level one over the model's 512 ids ("t0" .. "t511", whitespace-split), and the
chat template joins the messages' words and ends the prompt with "t2", so the prompt's ids are known
and the reply's words are its ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.helpers.family_checks import write_word_level_tokenizer
from tests.helpers.server_process import ServerProcess
from tests.model.test_gemma4 import build
from tests.model.test_model_numerics import prompt

pytestmark = pytest.mark.server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t2{% endif %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Any]]:
    hf, _ = build("e2b")
    folder = Path(tmp_path_factory.mktemp("gemma4")) / "tiny-gemma4"
    hf.save_pretrained(folder)
    write_word_level_tokenizer(folder, bos_token="t3", add_bos_token=False, chat_template=TEMPLATE)
    proc = ServerProcess("--model", str(folder), "--served-model-name", "tiny-gemma4", "--max-model-len", "128")
    try:
        yield proc.start(), hf
    finally:
        proc.stop()


def _want(hf: Any, ids: list[int], n: int) -> list[str]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    return [f"t{i}" for i in out]


def test_chat_and_stream_are_transformers_generate(served: tuple[ServerProcess, Any]) -> None:
    server, hf = served
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="-", max_retries=0, timeout=60)
    ids = prompt(18, seed=11)  # past the 6-token sliding window
    messages: Any = [{"role": "user", "content": " ".join(f"t{i}" for i in ids)}]
    want = _want(hf, ids + [2], 8)
    kwargs: dict[str, Any] = dict(model="tiny-gemma4", messages=messages, max_tokens=8, temperature=0)
    first = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens == len(ids) + 1
    assert (first.choices[0].message.content or "").split() == want
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True, "trace": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.split() == want
    again = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16  # whole blocks of the re-sent prompt
    assert (again.choices[0].message.content or "").split() == want
