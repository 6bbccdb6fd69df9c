"""Prompt logprobs, echo, prompt batches and best_of: the engine first, then the server.

Engine and library (tiny random-weight models, float32 on CPU):
- the summed logprob of a continuation (what evaluation harnesses score multiple choice by) from
  SamplingParams(prompt_logprobs=0, max_tokens=0) equals transformers' log_softmax over the same
  ids, for Llama and Qwen2, whole and in chunks of 3 tokens (chunked prefill collects per chunk).
  Tolerance: 1e-4 absolute per token logprob (our logits match transformers' to 1e-4,
  test_model_numerics.py; log_softmax adds rounding of the same order), 1e-3 on a sum over the
  continuation's tokens (at most 6 here). Measured: at most 5e-6 per token and 6e-6 on a sum,
  on logprobs down to -9.5;
- a request collecting prompt logprobs reuses nothing from the prefix cache (cached positions have
  no logits), gets the same values as on a cold engine, and leaves its KV for later requests;
- max_tokens 0 scores without sampling; SamplingParams refuses max_tokens 0 without prompt_logprobs;
- best_of keeps the candidates with the highest cumulative logprob (the sum of their logprobs).

Server (a real `onecall serve` subprocess with the embedded model, the official openai client):
batches of prompts (strings and token-id lists) numbered prompt-major with usage summed, streamed
too; echo with logprobs (first prompt token None, then the prompt's logprobs, then the generated
tokens'); max_tokens 0 with echo; best_of against the same seeds' n candidates; each bad input a 400
naming its field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from onecall import LLM
from onecall.errors import InvalidParameterError
from onecall.sampling_params import SamplingParams
from onecall.server.serving_completion import best_candidates
from tests.helpers.make_models import hf_and_ours
from tests.helpers.server_process import ServerProcess, assert_error
from tests.helpers.tiny_engine import run_all, tiny_engine

TOKEN_ATOL = 1e-4  # per prompt-token logprob, ours vs transformers (float32)
SUM_ATOL = 1e-3  # a continuation's summed logprob, ours vs transformers

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    attn_implementation="eager",
)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_hidden_layers=2, tie_word_embeddings=False)),
}
CONTEXT = [17, 301, 45, 99, 250, 3, 77, 410, 12, 64, 199]
CONTINUATIONS = [[88, 120, 7], [5, 6, 7, 8, 9, 10], [400]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_ours(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    config_cls, model_cls, extra = FAMILIES[request.param]
    return hf_and_ours(config_cls(**_COMMON, **extra), model_cls, weight_scale=0.15)


def hf_prompt_logprobs(hf: Any, ids: list[int]) -> list[float]:
    """log P(ids[t] | ids[:t]) for t >= 1, from transformers' full forward."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[t - 1, ids[t]].item() for t in range(1, len(ids))]


SCORE = SamplingParams(max_tokens=0, prompt_logprobs=0)


# ---- engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 3], ids=["whole", "chunks_of_3"])
def test_summed_continuation_logprob_equals_transformers(hf_ours: tuple[Any, Any], chunk: int | None) -> None:
    hf, ours = hf_ours
    config = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = tiny_engine(model=ours, **config)
    prompts = {f"c{i}": CONTEXT + cont for i, cont in enumerate(CONTINUATIONS)}
    outs = run_all(engine, prompts, SCORE)
    for i, cont in enumerate(CONTINUATIONS):
        out = outs[f"c{i}"]
        ids = CONTEXT + cont
        assert out.finish_reason == "length" and out.token_ids == [] and out.prompt_token_ids == ids
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        ours_lps = [lp for lp in out.prompt_logprobs[1:] if lp is not None]
        reference = hf_prompt_logprobs(hf, ids)
        assert len(ours_lps) == len(reference) == len(ids) - 1
        assert max(abs(a - b) for a, b in zip(ours_lps, reference, strict=True)) <= TOKEN_ATOL
        tail = slice(len(CONTEXT) - 1, None)  # the continuation's tokens
        assert abs(sum(ours_lps[tail]) - sum(reference[tail])) <= SUM_ATOL
    if chunk is not None:  # the prompts really went through in chunks
        assert all(s.num_tokens <= chunk for o in outs.values() for s in o.trace.steps)
        assert max(sum(s.kind == "prefill" for s in o.trace.steps) for o in outs.values()) >= 4
    engine.block_manager.check_invariants()


def test_top_prompt_logprobs_are_the_likeliest_tokens() -> None:
    engine = tiny_engine(max_num_batched_tokens=5)
    ids = list(range(300, 317))
    out = run_all(engine, {"a": ids}, SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0))["a"]
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(ids)
    assert out.prompt_top_logprobs[0] is None
    for lp, top in zip(out.prompt_logprobs[1:], out.prompt_top_logprobs[1:], strict=True):
        assert top is not None and len(top) == 3 and lp is not None
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-6
    assert len(out.token_ids) == 2  # and it generated as usual after its prompt


def test_prompt_logprobs_bypass_the_prefix_cache() -> None:
    ids = list(range(500, 530))
    cold = run_all(tiny_engine(), {"a": ids}, SCORE)["a"]
    engine = tiny_engine()
    plain = SamplingParams(max_tokens=1, temperature=0)
    run_all(engine, {"warm": ids}, plain)  # the whole prompt is in the prefix cache now
    assert engine.block_manager.peek(ids).num_cached_tokens == len(ids) - 1
    scored = run_all(engine, {"scored": ids}, SCORE)["scored"]
    assert scored.num_cached_tokens == 0 and scored.trace.num_cached_tokens == 0
    assert scored.trace.num_prefilled_tokens == len(ids)  # every position ran through the model
    assert scored.trace.sampling["prompt_logprobs"] == 0
    assert scored.prompt_logprobs is not None and cold.prompt_logprobs is not None
    assert max(abs(a - b) for a, b in zip(scored.prompt_logprobs[1:], cold.prompt_logprobs[1:])) <= 1e-5  # type: ignore[operator]
    again = run_all(engine, {"again": ids}, plain)["again"]  # a plain request still hits the cache
    assert again.num_cached_tokens == len(ids) - 1
    engine.block_manager.check_invariants()


def test_preemption_while_collecting_keeps_each_entry_once() -> None:
    """A pool too small for both prompts preempts one (recompute): its prompt logprobs come out once
    per token, equal to an unpressed run's within 2e-4 (this tiny model's logprobs reach about -40,
    and chunking changes float32's summation order), and so do its tokens."""
    prompts = {"a": list(range(200, 240)), "b": list(range(600, 640))}
    params = SamplingParams(max_tokens=10, prompt_logprobs=1, temperature=0, ignore_eos=True)
    reference = run_all(tiny_engine(), prompts, params)
    engine = tiny_engine(num_blocks=16, block_size=4, max_num_batched_tokens=6)
    outs = run_all(engine, prompts, params)
    assert sum(o.trace.num_preemptions for o in outs.values()) >= 1
    for rid, out in outs.items():
        ref = reference[rid]
        assert out.token_ids == ref.token_ids
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs or []) == 40
        diffs = [abs(a - b) for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:])]  # type: ignore[operator]
        assert max(diffs) <= 2e-4
    engine.block_manager.check_invariants()


def test_max_tokens_zero_needs_prompt_logprobs_and_fits_a_full_window() -> None:
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    engine = tiny_engine(num_blocks=8, block_size=4)  # a 32-token window
    out = run_all(engine, {"full": list(range(1000, 1032))}, SCORE)["full"]
    assert (
        out.finish_reason == "length" and out.prompt_logprobs is not None and len(out.prompt_logprobs) == 32
    )


def test_llm_generate_returns_prompt_logprobs() -> None:
    llm = LLM(engine=tiny_engine())
    (out,) = llm.generate([[7, 8, 9, 10]], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 4
    assert out.prompt_top_logprobs is not None and all(len(t or []) == 1 for t in out.prompt_top_logprobs[1:])
    (plain,) = llm.generate([[7, 8, 9, 10]], SamplingParams(max_tokens=1, temperature=0))
    assert plain.prompt_logprobs is None and plain.cumulative_logprob is None


def test_best_of_keeps_the_highest_cumulative_logprobs() -> None:
    engine = tiny_engine()
    params = {
        f"k{i}": SamplingParams(max_tokens=6, temperature=1.0, seed=10 + i, logprobs=0) for i in range(5)
    }
    outs = run_all(engine, dict.fromkeys(params, "Once upon a time"), params)
    candidates = [outs[f"k{i}"] for i in range(5)]
    for out in candidates:
        assert out.logprobs is not None and out.cumulative_logprob is not None
        assert out.cumulative_logprob == pytest.approx(
            sum(lp for lp in out.logprobs if lp is not None), abs=1e-4
        )
    scores = [o.cumulative_logprob for o in candidates]
    assert len(set(scores)) > 1, "seeded candidates should differ"
    best = best_candidates(candidates, 2)
    assert [o.cumulative_logprob for o in best] == sorted(scores, reverse=True)[:2]  # type: ignore[type-var]
    assert best_candidates(candidates, 5) == candidates  # best_of == n: the choices as they are


# ---- server ------------------------------------------------------------------------------------------
COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "512", "--max-waiting", "16", num_threads=2)
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.create(model=None, **kw)  # type: ignore[arg-type]


@pytest.mark.server
def test_a_batch_of_prompts_numbers_choices_prompt_major(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "One, two, three,"]
    single = [complete(client, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    r = complete(client, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in single for _ in range(2)]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in single)
    ids = [post_tokens(client, p) for p in prompts]
    by_ids = complete(client, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in single]
    chunks = list(complete(client, prompt=prompts, n=2, max_tokens=4, temperature=0, stream=True,
                           stream_options={"include_usage": True}))  # fmt: skip
    texts = [""] * 4
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in r.choices]
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def post_tokens(client: openai.OpenAI, text: str) -> list[int]:
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    tokens: list[int] = httpx.post(f"{base}/tokenize", json={"prompt": text}).json()["tokens"]
    return tokens


@pytest.mark.server
def test_echo_with_logprobs_leads_with_the_prompt(client: openai.OpenAI) -> None:
    ids = post_tokens(client, PROMPT)
    plain = complete(client, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2).choices[0]
    r = complete(client, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True).choices[0]
    lp = r.logprobs
    assert r.text == PROMPT + plain.text
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == len(ids) + 3
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens[: len(ids)]) == PROMPT
    assert lp.text_offset[len(ids)] == len(PROMPT) and lp.text_offset == sorted(lp.text_offset)
    assert lp.tokens[len(ids) :] == plain.logprobs.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-3)
    streamed = list(
        complete(client, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True)
    )
    first = streamed[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == lp.tokens[: len(ids)]
    assert "".join(ch.text for c in streamed for ch in c.choices) == r.text


@pytest.mark.server
def test_scoring_a_continuation_with_max_tokens_0(client: openai.OpenAI) -> None:
    """What a harness sends: echo, logprobs, max_tokens 0. The greedy continuation's tokens, scored
    as prompt, get the logprobs they were generated with (tolerance 1e-3: a decode step and a
    prefill compute the same logits in another order)."""
    ids = post_tokens(client, PROMPT)
    gen = complete(
        client,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "trace": True},
    )
    choice = gen.choices[0]
    out_ids = [step["token_id"] for step in gen.model_extra["trace"]["steps"] if step["token_id"] is not None]
    scored = complete(client, prompt=ids + out_ids, max_tokens=0, echo=True, logprobs=0)
    s = scored.choices[0]
    assert s.text.endswith(choice.text) and s.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and len(s.logprobs.tokens) == scored.usage.prompt_tokens
    assert s.logprobs.tokens[-4:] == choice.logprobs.tokens
    assert s.logprobs.token_logprobs[-4:] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-3)
    assert sum(s.logprobs.token_logprobs[-4:]) == pytest.approx(sum(choice.logprobs.token_logprobs), abs=1e-3)
    echo_only = complete(client, prompt=PROMPT, max_tokens=0, echo=True)
    assert echo_only.choices[0].text == PROMPT and echo_only.choices[0].logprobs is None


@pytest.mark.server
def test_best_of_returns_the_likeliest_of_the_seeded_candidates(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, logprobs=0)
    all_three = complete(client, n=3, **kw)
    totals = [sum(c.logprobs.token_logprobs) for c in all_three.choices]
    best = complete(client, n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == all_three.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == all_three.usage.completion_tokens  # every candidate counts
    hidden = complete(client, n=1, best_of=2, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=7)
    assert hidden.choices[0].logprobs is None  # ranking needed logprobs; the response shows none


BAD_INPUT: list[tuple[str, str, dict[str, Any], str]] = [
    ("echo_with_chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("best_of_below_n", COMPLETIONS, {"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    ("best_of_streamed", COMPLETIONS, {"prompt": "a", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("best_of_zero", COMPLETIONS, {"prompt": "a", "best_of": 0}, "best_of"),
    ("empty_prompt_list", COMPLETIONS, {"prompt": []}, "prompt"),
    ("mixed_prompt_list", COMPLETIONS, {"prompt": ["a", [1, 2]]}, "prompt"),
    ("mixed_token_list", COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    ("empty_prompt_in_batch", COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt"),
    ("max_tokens_0_without_echo", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("batch_over_queue", COMPLETIONS, {"prompt": ["a"] * 9, "n": 2}, "prompt"),
]  # fmt: skip


@pytest.mark.server
@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(
        httpx.post(server.url(path), json={"max_tokens": 2, **body}, timeout=60), 400, param=param
    )
    assert param in err["message"] or param == "prompt"
    ok = httpx.post(server.url(COMPLETIONS), json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text
