"""Experiment 2: a multi-turn chat re-sends its history every turn; the prefix cache makes that cheap.

    for each template (the model's own, the named "qwen3-style"):
        for turn k = 1..N: messages += [user_k]
            cache on   ctx.llm: reply (greedy, capped), trace: cached tokens, prefilled, TTFT, divergence
            cache off  a second LLM(enable_prefix_caching=False): the same prompt, one token: prefilled, TTFT
            messages += [assistant: the reply's text]         (what a client does)

The cache keeps the previous call's prompt and reply (all but the last sampled token, whose KV was
never computed), so turn k+1 should reuse all of it: "new turn appended". The qwen3-style template
drops the empty <think></think> block that it wrote at the end of turn k's prompt once that reply is
history, so turn k+1 parts from the cached path just before it: "template rewrote an earlier turn",
N tokens before the end of the previous prompt (the seed: 4 tokens, on Qwen3; here N is the block's
length in this model's vocabulary, measured by rendering the generation prompt with and without it).
The divergence itself comes from the trace: its index and the two differing tokens (decoded here).
The report's words name what ran: the model, its own template, the think block as it tokenized.

Turn 1 may reuse tokens an earlier call left in the shared cache (the default system prompt): the
cache is per server, not per conversation.

A hybrid model (LLM.info.state_bytes_per_sequence > 0: linear-attention layers with a fixed state per
sequence beside the attention layers' KV) resumes a hit only where a snapshot of that state exists
(docs/design.md, "Prefix caching for a hybrid model"): the hit is the KV match cut back to the longest
snapshot inside it. For one, each turn also records the trace's KV match (`num_kv_matched_tokens`),
where the state resumed (`state_resumed_at`, = num_cached_tokens), the matched tokens recomputed for
want of a snapshot between the two, and which snapshot it was, as far as this chat's own turns tell
(a turn's finish: its prompt and fed reply tokens; a prompt's end; a prompt's last 64-token boundary);
the report adds the state's size, the snapshot count and what the 64-token granularity cost per turn
with each template. A model without a linear state gets the report it always had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onecall import LLM, RequestOutput, SamplingParams, get_named_template
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import line_plot
from onecall.lab.report import md_table

USER_TURNS = (
    "Hi! I'm planning a small web app to track my book collection.",
    "Which database would you suggest for it?",
    "How should I structure the table for books?",
    "What fields should an author table have?",
    "How do I link books to authors?",
    "Should I add an index on the title?",
    "What is a good way to back up the database?",
    "How would I add user accounts later?",
    "Any tips for testing the app?",
    "Thanks! Can you sum up the plan in one sentence?",
)
NAME = "prefix_cache"
TITLE = f"Prefix cache: a {len(USER_TURNS)}-turn chat, history re-sent vs cached"

TEMPLATES = ("own", "qwen3-style")  # "own": the model's template; the others are named templates
MAX_REPLY_TOKENS, QUICK_MAX_REPLY_TOKENS = 40, 8
QUICK_TURNS = 4
SEED_PREFILLED_RESENT, SEED_PREFILLED_CACHED = 5549, 999  # over the seed's 10 turns, on Qwen3-8B
# A hybrid's aligned state snapshot: a multiple of this many tokens inside each prompt, at least
# SNAPSHOT_MARGIN before its end; where exactly, LLM.info.aligned_snapshot says (engine/state_slots.py)
SNAPSHOT_ALIGN, SNAPSHOT_MARGIN = 64, 16


@dataclass
class _Previous:
    """What the cache holds after a turn: its prompt and the reply tokens whose KV was computed."""

    num_prompt_tokens: int
    num_reply_tokens: int  # output tokens minus the last one (sampled, never run through the model)

    @property
    def end(self) -> int:
        return self.num_prompt_tokens + self.num_reply_tokens

    @property
    def aligned(self) -> int:
        """A hybrid's aligned snapshot in this prompt (0: none): LLM.info.aligned_snapshot's rule."""
        return _aligned(self.num_prompt_tokens)


def run(ctx: LabContext) -> ExperimentResult:
    num_turns = QUICK_TURNS if ctx.quick else len(USER_TURNS)
    max_tokens = QUICK_MAX_REPLY_TOKENS if ctx.quick else MAX_REPLY_TOKENS
    ctx.progress("loading a second copy of the model with the prefix cache disabled")
    off_llm = LLM(**{**ctx.engine_kwargs, "enable_prefix_caching": False})
    chats: dict[str, Any] = {}
    for template in TEMPLATES:
        turns = _chat(ctx, off_llm, template, num_turns, max_tokens)
        chats[template] = {"turns": turns, "totals": _totals(turns)}
    results = {
        "num_turns": num_turns,
        "max_reply_tokens": max_tokens,
        "user_turns": list(USER_TURNS[:num_turns]),
        "templates": chats,
        "think_block": think_block(ctx.llm, get_named_template("qwen3-style")),
    }
    info = ctx.llm.info
    if info.state_bytes_per_sequence > 0:  # a hybrid: what its state costs (a model without one: no key)
        results["hybrid"] = {
            "state_bytes_per_sequence": info.state_bytes_per_sequence,
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "state_snapshots": info.state_snapshots,
            "snapshot_align": SNAPSHOT_ALIGN,
            "snapshot_margin": SNAPSHOT_MARGIN,
        }
        # the lab's rule must be the engine's: checked against the public LLM.info once per run
        assert all(info.aligned_snapshot(n) == _aligned(n) for n in range(1, 400)), "snapshot rule changed"
    model = ctx.llm.info.model_name
    return ExperimentResult(
        NAME,
        TITLE,
        results,
        _seed_rows(model, results),
        _markdown(model, results),
        _plots(ctx, chats),
    )


def think_block(llm: LLM, source: str) -> dict[str, Any]:
    """The empty reasoning block a template adds to the generation prompt (unless enable_thinking),
    as this model's tokenizer splits it: the tokens by which such a template breaks the cached path."""
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    with_block = llm.render(messages, chat_template=source)
    without = llm.render(messages, chat_template=source, chat_template_kwargs={"enable_thinking": True})
    assert with_block.text.startswith(without.text) and (
        with_block.token_ids[: len(without.token_ids)] == without.token_ids
    ), "the block is appended to the generation prompt"
    ids = with_block.token_ids[len(without.token_ids) :]
    return {
        "text": with_block.text[len(without.text) :],
        "num_tokens": len(ids),
        "tokens": [llm.tokenizer.decode([i], skip_special_tokens=False) for i in ids],
    }


def _chat(
    ctx: LabContext, off_llm: LLM, template: str, num_turns: int, max_tokens: int
) -> list[dict[str, Any]]:
    """One conversation, turn by turn: the reply from the cached LLM, the same prompt on the uncached one."""
    source = None if template == "own" else get_named_template(template)
    reply_params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first_token = SamplingParams(temperature=0.0, max_tokens=1)  # cache off: prefill + TTFT are enough
    turns: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    earlier: list[_Previous] = []  # this chat's turns so far (a hybrid's snapshots are named by them)
    for k in range(num_turns):
        ctx.progress(f"{template} template: turn {k + 1}/{num_turns}")
        messages.append({"role": "user", "content": USER_TURNS[k]})
        on = ctx.llm.chat(messages, reply_params, chat_template=source)[0]
        off = off_llm.chat(messages, first_token, chat_template=source)[0]
        turns.append(_turn(ctx.llm, k + 1, on, off, earlier))
        earlier.append(_Previous(on.num_prompt_tokens, max(len(on.token_ids) - 1, 0)))
        messages.append({"role": "assistant", "content": on.text})
    return turns


def _turn(
    llm: LLM, k: int, on: RequestOutput, off: RequestOutput, earlier: list[_Previous]
) -> dict[str, Any]:
    """One turn's figures, and where (and why) its prompt left the cached path."""
    t, d = on.trace, on.trace.divergence
    previous = earlier[-1] if earlier else None
    # A hybrid's hit is cut back to a state snapshot: its KV match is the token match
    kv_matched = t.num_cached_tokens if t.num_kv_matched_tokens is None else t.num_kv_matched_tokens
    # The prompt matched the cache up to the divergence, or (no divergence) as far as the cache went.
    match_len = (
        d["index"] if d is not None else kv_matched + t.num_dropped_cache_tokens + int(t.cache_match_capped)
    )
    divergence = None
    if d is not None:
        text = [
            llm.tokenizer.decode([d[key]], skip_special_tokens=False)
            for key in ("prompt_token", "cached_token")
        ]
        divergence = {**d, "prompt_token_text": text[0], "cached_token_text": text[1]}
    cause, tokens_early, tokens_lost = _cause(match_len, previous)
    hybrid: dict[str, Any] = {}
    if t.state_resumed_at is not None:
        hybrid = {
            "num_kv_matched_tokens": kv_matched,
            "state_resumed_at": t.state_resumed_at,
            # matched in the KV cache but prefilled again: no state snapshot between the two
            "num_recomputed_tokens": kv_matched - t.state_resumed_at,
            "resumed_from": _resumed_from(t.state_resumed_at, earlier),
        }
    return {
        "turn": k,
        "num_prompt_tokens": on.num_prompt_tokens,
        "num_cached_tokens": on.num_cached_tokens,
        "prefilled_cache_on": t.num_prefilled_tokens,
        "prefilled_cache_off": off.trace.num_prefilled_tokens,
        "ttft_ms_cache_on": _ms(t.time_to_first_token),
        "ttft_ms_cache_off": _ms(off.trace.time_to_first_token),
        "reply": on.text,
        "num_reply_tokens": len(on.token_ids),
        "divergence": divergence,
        "match_len": match_len,
        "cause": cause,
        "tokens_early": tokens_early,  # before the end of the previous prompt
        "tokens_lost": tokens_lost,  # of what the previous call left cached (its prompt and reply)
        **hybrid,
    }


def _resumed_from(resumed_at: int, earlier: list[_Previous]) -> dict[str, Any]:
    """Which state snapshot a hybrid resumed from, as far as this chat's turns tell: {"snapshot":
    "finish" (after a turn's prompt and fed reply), "prompt end", "aligned" (a prompt's last
    SNAPSHOT_ALIGN boundary), "other" (another call's) or "none" (from scratch), "turn": the turn's
    number or None}. The latest turn first, a finish before a prompt end before a boundary."""
    if resumed_at == 0:
        return {"snapshot": "none", "turn": None}
    for j in range(len(earlier), 0, -1):
        p = earlier[j - 1]
        for kind, at in (("finish", p.end), ("prompt end", p.num_prompt_tokens), ("aligned", p.aligned)):
            if resumed_at == at:
                return {"snapshot": kind, "turn": j}
    return {"snapshot": "other", "turn": None}


def _cause(match_len: int, previous: _Previous | None) -> tuple[str, int | None, int | None]:
    if previous is None:
        return "first turn of this chat", None, None
    lost = max(previous.end - match_len, 0)
    if lost == 0:
        return "new turn appended", 0, 0
    if match_len >= previous.num_prompt_tokens:
        return f"the re-sent reply tokenized differently, {lost} tokens early", 0, lost
    early = previous.num_prompt_tokens - match_len
    return f"template rewrote an earlier turn: {early} tokens before the previous prompt's end", early, lost


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    last = turns[-1]
    totals: dict[str, Any] = {
        "prefilled_cache_on": sum(t["prefilled_cache_on"] for t in turns),
        "prefilled_cache_off": sum(t["prefilled_cache_off"] for t in turns),
        "prompt_tokens_sent": sum(t["num_prompt_tokens"] for t in turns),
        "last_turn_ttft_ms_cache_on": last["ttft_ms_cache_on"],
        "last_turn_ttft_ms_cache_off": last["ttft_ms_cache_off"],
        "tokens_early_after_turn_1": sorted({t["tokens_early"] for t in turns[1:]}),
    }
    if "state_resumed_at" in last:  # a hybrid: KV-matched tokens prefilled again, for want of a snapshot
        totals["recomputed_tokens"] = sum(t["num_recomputed_tokens"] for t in turns)
    return totals


def _plots(ctx: LabContext, chats: dict[str, Any]) -> list[Any]:
    x = list(range(1, len(next(iter(chats.values()))["turns"]) + 1))
    prefilled, ttft = {}, {}
    for template, chat in chats.items():
        for mode in ("on", "off"):
            label = f"{template} template, cache {mode}"
            prefilled[label] = [t[f"prefilled_cache_{mode}"] for t in chat["turns"]]
            ttft[label] = [t[f"ttft_ms_cache_{mode}"] for t in chat["turns"]]
    return [
        line_plot(
            ctx.out_dir / "prefix_cache_prefilled.png",
            x,
            prefilled,
            title=f"Tokens prefilled per turn, {ctx.llm.info.model_name}",
            xlabel="turn",
            ylabel="tokens prefilled",
        ),
        line_plot(
            ctx.out_dir / "prefix_cache_ttft.png",
            x,
            ttft,
            title=f"Time to first token per turn, {ctx.llm.info.model_name}",
            xlabel="turn",
            ylabel="TTFT (ms)",
        ),
    ]


def _seed_rows(model: str, results: dict[str, Any]) -> list[SeedRow]:
    chats, num_turns, block = results["templates"], results["num_turns"], results["think_block"]
    own, qwen = chats["own"]["totals"], chats["qwen3-style"]["totals"]
    short = "" if num_turns == len(USER_TURNS) else f"{num_turns} turns (quick form); "
    early = ", ".join(str(e) for e in qwen["tokens_early_after_turn_1"]) or "-"
    resent = "fewer" if own["prefilled_cache_off"] < SEED_PREFILLED_RESENT else "more"
    rows = [
        SeedRow(
            f"tokens prefilled over {num_turns} turns, re-sent / cached",
            f"{SEED_PREFILLED_RESENT:,} / {SEED_PREFILLED_CACHED:,}",
            f"{own['prefilled_cache_off']:,} / {own['prefilled_cache_on']:,}",
            short + f"{model} with its own template, replies greedy and capped at "
            f"{results['max_reply_tokens']} tokens: {resent} tokens re-sent than in the seed's Qwen3-8B chat",
        ),
        SeedRow(
            f"time to first token at turn {num_turns}, re-sent / cached",
            "139 ms / 64.2 ms",
            f"{_fmt_ms(own['last_turn_ttft_ms_cache_off'])} / {_fmt_ms(own['last_turn_ttft_ms_cache_on'])}",
            short + "the re-sent prompt grows every turn; the cached prefill stays one turn long",
        ),
        SeedRow(
            "Qwen3-style template: the match breaks N tokens early",
            "4 tokens",
            f"{early} tokens (every turn after the first)",
            f"the empty think block is {block['num_tokens']} tokens in {model}'s vocabulary "
            f"({_pieces(block['tokens'])}); in Qwen3's, <think> and </think> are single tokens",
        ),
    ]
    hybrid = results.get("hybrid")
    if hybrid is not None:
        rows.append(
            SeedRow(
                "hybrid: KV-matched tokens recomputed for want of a state snapshot, own / qwen3-style",
                "- (Qwen3-8B has no linear-attention layers)",
                f"{own['recomputed_tokens']:,} / {qwen['recomputed_tokens']:,}",
                f"{short}{model} carries a {hybrid['state_bytes_per_sequence']:,}-byte state per sequence; "
                "a hit resumes only at a snapshot of it: a turn's finish, a prompt's end or its last "
                f"{hybrid['snapshot_align']}-token boundary",
            )
        )
    return rows


def _pieces(tokens: list[str]) -> str:
    return " + ".join(f"`{t!r}`" for t in tokens)


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f} ms"


def _markdown(model: str, results: dict[str, Any]) -> str:
    chats, max_tokens, block = results["templates"], results["max_reply_tokens"], results["think_block"]
    parts = [
        f"{model}. Fixed user messages; each reply is the model's own (greedy, at most {max_tokens} "
        "tokens), appended to the history as a client would. Cache on: the shared LLM; cache off: a "
        "second LLM built with `enable_prefix_caching=False`, sent the same prompt. The divergence is where "
        "the prompt left the cached path (from the trace); none means the cache simply ran out, after the "
        "previous reply."
    ]
    hybrid = results.get("hybrid")
    header = ["turn", "prompt", "cached", "prefilled on / off", "TTFT on / off", "divergence", "cause"]
    if hybrid is not None:  # the hit (cached) is where the state resumed, within the KV match
        header[2:3] = ["KV match", "cached (state resumed at)", "resumed from"]
    for template, chat in chats.items():
        rows = []
        for t in chat["turns"]:
            d = t["divergence"]
            where = (
                "-"
                if d is None
                else (f"@{d['index']}: `{d['prompt_token_text']!r}` vs cached `{d['cached_token_text']!r}`")
            )
            cached: list[Any] = [t["num_cached_tokens"]]
            if hybrid is not None:
                prev = chat["turns"][t["turn"] - 2] if t["turn"] > 1 else None
                cached = [t["num_kv_matched_tokens"], t["state_resumed_at"], _resumed_from_text(t, prev)]
            rows.append(
                [
                    t["turn"],
                    t["num_prompt_tokens"],
                    *cached,
                    f"{t['prefilled_cache_on']} / {t['prefilled_cache_off']}",
                    f"{_fmt_ms(t['ttft_ms_cache_on'])} / {_fmt_ms(t['ttft_ms_cache_off'])}",
                    where,
                    t["cause"],
                ]
            )
        tot = chat["totals"]
        name = f"{model}'s own template" if template == "own" else f"the `{template}` template"
        total = (
            f"Total prefilled: **{tot['prefilled_cache_on']:,}** tokens with the cache, "
            f"**{tot['prefilled_cache_off']:,}** re-sent ({tot['prompt_tokens_sent']:,} prompt tokens sent)."
        )
        if hybrid is not None:
            total += (
                f" Of those prefilled with the cache, **{tot['recomputed_tokens']:,}** were in the KV match "
                "but past the last state snapshot inside it, so computed again."
            )
        parts += [f"### With {name}", md_table(header, rows), total]
    retokenized = [
        (f"{template} turn {t['turn']}", t["divergence"])
        for template, chat in chats.items()
        for t in chat["turns"]
        if t["cause"].startswith("the re-sent reply")
    ]
    if retokenized:
        d = next((d for _, d in retokenized if d is not None), None)
        example = (
            ""
            if d is None
            else f" (at the first: `{d['cached_token_text']!r}` generated, where encoding the text gives "
            f"`{d['prompt_token_text']!r}`)"
        )
        parts.append(
            f"At {', '.join(where for where, _ in retokenized)} the match broke inside the previous reply: "
            "the model generated a token sequence that its tokenizer does not produce from the same "
            f"text{example}. A client sends text, not tokens, so the reply is re-tokenized and the cache "
            "cannot match past that point."
        )
    parts.append(
        f"The qwen3-style template writes an empty think block, `{block['text']!r}`, after the last "
        "`<|im_start|>assistant\\n` but leaves it out of earlier assistant turns, as Qwen3's does with "
        f"thinking off; {model} splits it into {block['num_tokens']} tokens ({_pieces(block['tokens'])}). "
        "So each turn's prompt rewrites the end of the one before, and the cached path is lost from "
        "there: the previous reply is prefilled again every turn."
    )
    if hybrid is not None:
        parts += _hybrid_markdown(model, results)
    return "\n\n".join(parts)


_SNAPSHOT_NAMES = {
    "finish": "the finish of turn {turn} (its prompt and fed reply)",
    "prompt end": "the prompt end of turn {turn}",
    "aligned": "the {align}-token boundary in turn {turn}'s prompt",
    "other": "a snapshot another call left",
    "none": "from scratch",
}


def _resumed_from_text(t: dict[str, Any], prev: dict[str, Any] | None) -> str:
    """A hybrid turn's "resumed from" cell: the snapshot, and why the hit was shorter than the match."""
    if t["num_kv_matched_tokens"] == 0:
        return "-"
    r = t["resumed_from"]
    text = _SNAPSHOT_NAMES[r["snapshot"]].format(turn=r["turn"], align=SNAPSHOT_ALIGN)
    if t["num_recomputed_tokens"] == 0:
        return text
    text += (
        f": no snapshot between {t['state_resumed_at']} and {t['num_kv_matched_tokens']}, "
        f"{_tokens(t['num_recomputed_tokens'])} of the match recomputed"
    )
    skipped = _boundary_past_match(t, prev)
    if skipped is not None:
        text += f" (turn {t['turn'] - 1}'s {SNAPSHOT_ALIGN}-token boundary, {skipped}, lies past the match)"
    return text


def _boundary_past_match(t: dict[str, Any], prev: dict[str, Any] | None) -> int | None:
    """The previous prompt's aligned snapshot when it lies past this turn's KV match (a template that
    rewrote the prompt's end from before it), so that the state went back further; else None."""
    if prev is None:
        return None
    boundary = _aligned(prev["num_prompt_tokens"])
    return boundary if boundary > t["num_kv_matched_tokens"] else None


def _aligned(num_prompt_tokens: int) -> int:
    """Where a hybrid's aligned snapshot of a prompt of this length is (0: none)."""
    return max(num_prompt_tokens - 1 - SNAPSHOT_MARGIN, 0) // SNAPSHOT_ALIGN * SNAPSHOT_ALIGN


def _tokens(n: int) -> str:
    return f"{n:,} token" if n == 1 else f"{n:,} tokens"


def _turn_numbers(turns: list[int]) -> str:
    return ("turn " if len(turns) == 1 else "turns ") + ", ".join(str(k) for k in turns)


def _hybrid_markdown(model: str, results: dict[str, Any]) -> list[str]:
    """What changes for a hybrid: its state, snapshots only, their granularity and its cost per turn."""
    hybrid, chats, block = results["hybrid"], results["templates"], results["think_block"]
    state, kv, align = hybrid["state_bytes_per_sequence"], hybrid["kv_bytes_per_token"], SNAPSHOT_ALIGN
    parts = [
        "### What changes for a hybrid model",
        f"{model} is a hybrid: beside its attention layers' K and V ({kv:,} bytes per token), its "
        f"linear-attention layers carry one fixed-size state per sequence, **{state:,} bytes** here (as "
        f"much as {state / kv:,.1f} tokens of KV), and the engine keeps **{hybrid['state_snapshots']}** "
        "snapshots of it. That state sums up every token so far and cannot be rolled back, so a cached "
        "prefix is usable only up to a position whose state a snapshot holds: a prompt's end, its last "
        f"multiple of {align} tokens at least {SNAPSHOT_MARGIN} tokens before its end, and after every "
        "token a finished request was fed. A hit is the KV "
        "match cut back to the longest snapshot inside it (the trace's `num_kv_matched_tokens` and "
        "`state_resumed_at`); the matched tokens past it are prefilled again.",
    ]
    for template, chat in chats.items():
        turns, tot = chat["turns"], chat["totals"]
        if len(turns) < 2:
            continue
        name = f"{model}'s own template" if template == "own" else f"the `{template}` template"
        groups: dict[str, list[int]] = {}
        skipped: list[str] = []
        for prev, t in zip(turns, turns[1:], strict=False):
            r = t["resumed_from"]
            previous = r["turn"] == prev["turn"]
            key = {
                ("finish", True): "at the previous turn's finish",
                ("finish", False): "at an earlier turn's finish",
                ("aligned", True): f"at the previous prompt's last {align}-token boundary",
                ("aligned", False): f"at an earlier prompt's {align}-token boundary",
                ("prompt end", True): "at the previous prompt's end",
                ("prompt end", False): "at an earlier prompt's end",
            }.get((r["snapshot"], previous), _SNAPSHOT_NAMES[r["snapshot"]])
            groups.setdefault(key, []).append(t["turn"])
            boundary = _boundary_past_match(t, prev)
            if boundary is not None:
                skipped.append(
                    f"at turn {t['turn']} the previous prompt's last boundary, {boundary}, lay past the "
                    f"match ({t['num_kv_matched_tokens']}), so the state went back to "
                    f"{t['state_resumed_at']}: {_tokens(t['num_recomputed_tokens'])} recomputed"
                )
        where = "; ".join(f"{key} in {len(ks)} ({_turn_numbers(ks)})" for key, ks in groups.items())
        recomputed = [t["num_recomputed_tokens"] for t in turns[1:]]
        text = (
            f"With {name}, of turns 2-{turns[-1]['turn']} the state resumed {where}: "
            f"{_tokens(sum(recomputed))} of their KV match recomputed "
            f"({', '.join(str(r) for r in recomputed)} per turn)."
        )
        if skipped:
            said = "; ".join(skipped)
            text += f" {said[0].upper()}{said[1:]}."
        parts.append(
            text + f" Over all {len(turns)} turns it prefilled {tot['prefilled_cache_on']:,} tokens with "
            "the cache, where a model without a linear state, reusing every matched token, would prefill "
            f"{tot['prefilled_cache_on'] - tot['recomputed_tokens']:,}."
        )
    parts.append(
        "The own template re-sends the previous turn whole, so its match runs to exactly where the "
        "previous request stopped, which is where its finish snapshot is. The qwen3-style template "
        f"rewrites the previous prompt's last {block['num_tokens']} tokens (the think block), before that "
        "turn's prompt-end and finish snapshots, so its state resumes at the previous prompt's last "
        f"{align}-token boundary when that lies before the divergence, else at an earlier prompt's, or "
        f"from scratch (a prompt under {align + SNAPSHOT_MARGIN + 1} tokens has none). That is the "
        f"granularity: resuming at the previous prompt's boundary recomputes fewer than "
        f"{align + SNAPSHOT_MARGIN} matched tokens, on top of the previous reply that this template makes "
        f"any model prefill again; a rewrite of more than {SNAPSHOT_MARGIN} tokens could still reach past "
        f"the boundary, and the state would go back at least {align} tokens further."
    )
    return parts
