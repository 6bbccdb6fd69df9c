"""Multi-turn chat through the engine: the seed's prefix-cache measurements, on a tiny model.

The seed found that Qwen3's template rewrites earlier assistant turns (it drops their
<think>...</think> block), so the cached prefix of turn N stops matching a few tokens
early. This test renders a small Qwen3-style template, runs two turns through the
engine, and checks that the trace reports exactly where and why the match broke.
"""

from __future__ import annotations

from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import ChatTemplate, RenderedPrompt
from tests.helpers.tiny_engine import embedded_tokenizer, run_all, tiny_engine

# Like Qwen3's: earlier assistant turns lose their reasoning; with enable_thinking=False the
# generation prompt pre-fills an empty think block.
QWEN3_STYLE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' -%}{{ m.content.split('</think>')[-1].lstrip('\n') }}"
    "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think>\n\n</think>\n\n{%- endif -%}"
    "{%- endif -%}"
)


def render(messages: list[dict[str, str]]) -> RenderedPrompt:
    tok = embedded_tokenizer()
    text = ChatTemplate(QWEN3_STYLE).render(messages, add_generation_prompt=True, enable_thinking=False)
    ids = tok.encode(text)
    return RenderedPrompt(text, ids, [i in tok.special_ids for i in ids])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_template_rewrite_breaks_the_cache_match_where_the_think_block_was() -> None:
    tok = embedded_tokenizer()
    engine = tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    turn1 = [{"role": "user", "content": "Our Postgres port is 5439."}]
    p1 = render(turn1)
    out1 = run_all(engine, {"t1": p1}, params)["t1"]
    cached_path = p1.token_ids + out1.token_ids[:-1]  # the last sampled token has no KV yet

    turn2 = turn1 + [
        {"role": "assistant", "content": "<think>\n\n</think>\n\n" + out1.text},
        {"role": "user", "content": "What port?"},
    ]
    p2 = render(turn2)
    out2 = run_all(engine, {"t2": p2}, params)["t2"]

    # The engine reused exactly the longest common prefix, token-granular, and says where it broke.
    k = common_prefix(cached_path, p2.token_ids)
    assert out2.num_cached_tokens == k
    d = out2.trace.divergence
    assert d == {"index": k, "prompt_token": p2.token_ids[k], "cached_token": cached_path[k]}
    # ...and it broke where turn 1's generation prompt had the empty think block the template dropped.
    think_at = p1.text.rindex("<think>")
    assert len(tok.decode(cached_path[:k], skip_special_tokens=False)) <= think_at
    assert "<think>" in tok.decode(cached_path[k : k + 4], skip_special_tokens=False)
    assert k >= p1.text[:think_at].count("<|im_start|>")  # most of turn 1 was reused
    assert out2.trace.num_prefilled_tokens == len(p2.token_ids) - k


def test_ten_turn_chat_prefills_only_the_new_tokens() -> None:
    """The seed's 10-turn experiment: re-sent history costs little once its prefix is cached."""
    engine = tiny_engine(num_blocks=1024)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tok = embedded_tokenizer()
    template = ChatTemplate(tok.chat_template or "")
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    prefilled = sent = last_len = 0
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question number {turn}: what is {turn} + {turn}?"})
        text = template.render(messages, add_generation_prompt=True)
        ids = tok.encode(text)
        out = run_all(engine, {f"turn{turn}": ids}, params)[f"turn{turn}"]
        sent += len(ids)
        prefilled += out.trace.num_prefilled_tokens
        assert out.num_cached_tokens >= last_len - 1  # the whole previous prompt was reused
        last_len = len(ids)
        messages.append({"role": "assistant", "content": out.text})
    assert prefilled < sent / 3, (prefilled, sent)
