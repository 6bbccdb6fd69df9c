"""`onecall serve` on a hybrid model folder (a tiny random Qwen3.5 with SmolLM2's tokenizer and chat
template, as a user's folder would be: tests/helpers/make_models.py write_tiny_hybrid_chat_folder),
driven by the official openai client: a chat turn, then the next turn re-sending the transcript hits
the prefix cache through a state snapshot (the usage and the trace say so), and /server_info reports
the state's size and snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.make_models import write_tiny_hybrid_chat_folder
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = write_tiny_hybrid_chat_folder(tmp_path_factory.mktemp("hybrid") / "tiny-qwen3.5")
    proc = ServerProcess("--model", str(Path(folder)), "--served-model-name", "tiny-qwen3.5", "--max-model-len", "1024")
    try:
        yield proc.start()
    finally:
        proc.stop()


def test_a_second_turn_resumes_from_the_first_turns_state(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="-", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Which database would you suggest for a small app?"}]
    first = client.chat.completions.create(
        model="tiny-qwen3.5", messages=messages, max_tokens=8, temperature=0  # type: ignore[arg-type]
    )
    reply = first.choices[0].message.content or ""
    assert first.usage is not None and first.usage.completion_tokens == 8
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why that one?"}]
    second = client.chat.completions.create(
        model="tiny-qwen3.5", messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
        extra_body={"trace": True},
    )  # fmt: skip
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    trace = (second.model_extra or {})["trace"]
    # the reply re-rendered as the model wrote it: the KV match runs through the first turn's fed
    # tokens, and the state resumes there (its finish snapshot), so every matched token is reused
    assert cached is not None and cached >= first.usage.prompt_tokens
    assert trace["state_resumed_at"] == cached == trace["num_kv_matched_tokens"]
    info = httpx.get(server.url("/server_info"), timeout=10).json()
    assert info["state_bytes_per_sequence"] > 0 and info["max_state_snapshots"] > 0
    assert info["internal_states"][0]["num_state_snapshots"] >= 1
