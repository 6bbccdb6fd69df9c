"""Experiment 1: the model remembers nothing between calls; memory is the client re-sending the history.

    call 1   [user: the fact]                                  -> reply
    call 2   [user: the question]                              (isolated: a fresh conversation)
    call 3   [user: the fact, assistant: reply, user: question] (the history re-sent)

All greedy, through LLM.chat. The weights are read-only while the model runs, so call 2 can only
guess; call 3 sees the fact in its prompt. Whether each answer contains "5439" is recorded, not
assumed: a small model may still fumble the number with the history in front of it, and the report
says so. Call 3 also shows the prefix cache at work: its prompt starts with call 1's.
"""

from __future__ import annotations

from typing import Any

from onecall import RequestOutput, SamplingParams
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.report import md_cell, md_table

NAME = "memory"
TITLE = "Memory: the model keeps nothing between calls"

FACT = "Remember this for later: our Postgres port is 5439."
QUESTION = "What is our Postgres port? Answer with the number."
PORT = "5439"
MAX_TOKENS, QUICK_MAX_TOKENS = 48, 24


def run(ctx: LabContext) -> ExperimentResult:
    max_tokens = QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    fact = {"role": "user", "content": FACT}
    question = {"role": "user", "content": QUESTION}

    ctx.progress("call 1/3: state the fact")
    first = ctx.llm.chat([fact], params)[0]
    ctx.progress("call 2/3: ask in an isolated call")
    isolated = ctx.llm.chat([question], params)[0]
    ctx.progress("call 3/3: ask with the history re-sent")
    history = [fact, {"role": "assistant", "content": first.text}, question]
    with_history = ctx.llm.chat(history, params)[0]

    calls = {"fact": _call(first), "isolated": _call(isolated), "with_history": _call(with_history)}
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        results={"fact": FACT, "question": QUESTION, "port": PORT, "max_tokens": max_tokens, "calls": calls},
        seed_rows=_seed_rows(calls, ctx.llm.info.model_name),
        markdown=_markdown(calls, max_tokens),
    )


def _call(out: RequestOutput) -> dict[str, Any]:
    return {
        "answer": out.text,
        "contains_port": PORT in out.text,
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "num_output_tokens": len(out.token_ids),
    }


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _seed_rows(calls: dict[str, dict[str, Any]], model: str) -> list[SeedRow]:
    iso, hist = calls["isolated"], calls["with_history"]
    note = (
        "" if not iso["contains_port"] else "it cannot know: a lucky guess, or the number is in the question"
    )
    if not hist["contains_port"]:
        note = f"the fact was in the prompt; {model} still did not copy it out"
    return [
        SeedRow(
            "isolated second call knows the port",
            "no (guessed the default 5432)",
            _yes_no(iso["contains_port"]),
            note,
        ),
        SeedRow("the same question with the history re-sent knows it", "yes", _yes_no(hist["contains_port"])),
    ]


def _markdown(calls: dict[str, dict[str, Any]], max_tokens: int) -> str:
    rows = []
    labels = {"fact": "1. the fact", "isolated": "2. isolated question", "with_history": "3. history re-sent"}
    for key, label in labels.items():
        c = calls[key]
        rows.append(
            [
                label,
                c["answer"].strip(),
                _yes_no(c["contains_port"]) if key != "fact" else "",
                f"{c['num_prompt_tokens']} ({c['num_cached_tokens']} cached)",
            ]
        )
    return "\n\n".join(
        [
            f"Call 1 says **{md_cell(FACT)}** Call 2 asks **{md_cell(QUESTION)}** in a new conversation; "
            "call 3 asks it again after re-sending call 1's exchange. Greedy, at most "
            f"{max_tokens} tokens each.",
            md_table(["call", "answer", f"contains {PORT}", "prompt tokens"], rows),
            "Nothing carries over between calls: the weights are read-only during inference and the "
            "engine keeps no conversation state. What looks like memory is the client sending the "
            "transcript again, and the prefix cache making that re-send cheap (call 3's cached tokens).",
        ]
    )
