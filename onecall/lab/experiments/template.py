"""Experiment 3: the chat template matters. Five questions in three formats, and where attention goes.

    own template   LLM.chat([user: q])                 <|im_start|>...<|im_end|> control tokens
    raw            LLM.generate(q)                     the bare question, no control tokens
    llama2 tags    LLM.generate("[INST] q [/INST]")   another family's format: plain text to this model

Greedy, 32 tokens at most. "Clean" = the model stopped by itself (finish_reason "stop": an EOS or
stop token, no stop strings are set) with a non-empty answer; hitting the cap is not clean.

Then, on the first question in the model's own format, LLM.attention_probs (a separate plain
forward that returns attention probabilities; the serving path never computes them): per layer,
the share of the final position's attention (averaged over heads) that lands on control-token
positions. Position 0 is shown on its own: it is a control token here and, as in most decoders, an
"attention sink" that takes much of the attention whatever it holds.
"""

from __future__ import annotations

from typing import Any

from onecall import RequestOutput, SamplingParams
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import line_plot
from onecall.lab.report import md_code, md_table

NAME = "template"
TITLE = "Chat template: clean answers, and the attention control tokens get"

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
)
FORMATS = ("own template", "raw", "llama2 tags")
MAX_TOKENS = 32


def run(ctx: LabContext) -> ExperimentResult:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    formats: dict[str, Any] = {}
    for i, fmt in enumerate(FORMATS, 1):
        ctx.progress(f"format {i}/{len(FORMATS)}: {fmt}, {len(QUESTIONS)} questions")
        if fmt == "own template":
            outs = ctx.llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
        else:
            prompts = list(QUESTIONS) if fmt == "raw" else [f"[INST] {q} [/INST]" for q in QUESTIONS]
            outs = ctx.llm.generate(prompts, params)
        answers = [_answer(ctx, q, out) for q, out in zip(QUESTIONS, outs, strict=True)]
        formats[fmt] = {"answers": answers, "num_clean": sum(a["clean"] for a in answers)}

    ctx.progress("attention probabilities of the final position, per layer")
    attention = _attention(ctx)
    plot = line_plot(
        ctx.out_dir / "template_attention.png",
        list(range(len(attention["control_share_per_layer"]))),
        {
            "on control-token positions": attention["control_share_per_layer"],
            "on position 0 alone": attention["position0_share_per_layer"],
            "uniform attention (control positions / all)": [attention["control_fraction_of_positions"]]
            * len(attention["control_share_per_layer"]),
        },
        title=f"Final position's attention on control tokens, {ctx.llm.info.model_name}",
        xlabel="layer",
        ylabel="share of attention",
        markers=False,
    )
    results = {
        "max_tokens": MAX_TOKENS,
        "questions": list(QUESTIONS),
        "formats": formats,
        "attention": attention,
    }
    return ExperimentResult(
        NAME,
        TITLE,
        results,
        _seed_rows(formats, attention),
        _markdown(ctx.llm.info.model_name, formats, attention),
        [plot],
    )


def _answer(ctx: LabContext, question: str, out: RequestOutput) -> dict[str, Any]:
    stop = out.trace.stop_reason
    stop_text = ctx.llm.tokenizer.decode([stop], skip_special_tokens=False) if isinstance(stop, int) else stop
    return {
        "question": question,
        "answer": out.text,
        "finish_reason": out.finish_reason,
        "stop_token": stop_text,
        "num_output_tokens": len(out.token_ids),
        "clean": out.finish_reason == "stop" and bool(out.text.strip()),
    }


def _attention(ctx: LabContext) -> dict[str, Any]:
    rendered = ctx.llm.render([{"role": "user", "content": QUESTIONS[0]}])
    probs = ctx.llm.attention_probs(rendered)  # (num_layers, num_prompt_tokens)
    control = [i for i, is_control in enumerate(rendered.is_control) if is_control]
    per_layer = probs[:, control].sum(dim=-1).tolist()
    peak = max(range(len(per_layer)), key=per_layer.__getitem__)
    return {
        "prompt": rendered.text,
        "num_prompt_tokens": len(rendered.token_ids),
        "first_token": ctx.llm.tokenizer.decode(rendered.token_ids[:1], skip_special_tokens=False),
        "control_positions": control,
        "control_tokens": [
            ctx.llm.tokenizer.decode([rendered.token_ids[i]], skip_special_tokens=False) for i in control
        ],
        "control_fraction_of_positions": len(control) / len(rendered.token_ids),
        "control_share_per_layer": per_layer,
        "position0_share_per_layer": probs[:, 0].tolist(),
        "control_share_mean": sum(per_layer) / len(per_layer),
        "position0_share_mean": probs[:, 0].mean().item(),
        "peak_layer": peak,  # 0-based
        "peak_share": per_layer[peak],
    }


def _seed_rows(formats: dict[str, Any], att: dict[str, Any]) -> list[SeedRow]:
    n = len(QUESTIONS)
    clean = ", ".join(f"{formats[f]['num_clean']}/{n}" for f in FORMATS)
    uniform = (
        f"uniform attention would give {att['control_fraction_of_positions']:.1%} "
        f"({len(att['control_positions'])} of {att['num_prompt_tokens']} positions)"
    )
    return [
        SeedRow(
            "clean answers: own template, raw, Llama-2 tags", "5/5, 0/5, 0/5", clean, _why_not_clean(formats)
        ),
        SeedRow(
            "final position's attention on control tokens, mean over layers",
            "59.1%",
            f"{att['control_share_mean']:.1%}",
            uniform,
        ),
        SeedRow(
            "... at its peak layer",
            "91.4% (layer 30)",
            f"{att['peak_share']:.1%} (layer {att['peak_layer']} of {len(att['control_share_per_layer'])}, from 0)",
            "Qwen3-8B has 36 layers",
        ),
    ]


def _why_not_clean(formats: dict[str, Any]) -> str:
    """What the unclean answers did, per format: ran to the cap, or ended at once with nothing."""
    parts = []
    for fmt in FORMATS:
        answers = formats[fmt]["answers"]
        capped = sum(a["finish_reason"] == "length" for a in answers)
        empty = sum(a["finish_reason"] == "stop" and not a["answer"].strip() for a in answers)
        if capped or empty:
            parts.append(f"{fmt}: {capped} ran to the cap, {empty} ended at once, empty")
    return "; ".join(parts)


def _markdown(model: str, formats: dict[str, Any], att: dict[str, Any]) -> str:
    n = len(QUESTIONS)
    parts = [
        f"{model}: {n} short questions, greedy, at most {MAX_TOKENS} tokens. **Clean** means the model "
        "stopped by itself (an end-of-turn token) with a non-empty answer; running into the cap is not clean.",
        md_table(["format", "clean answers"], [[f, f"{formats[f]['num_clean']}/{n}"] for f in FORMATS]),
    ]
    for fmt in FORMATS:
        rows = [
            [
                a["question"],
                a["answer"].strip(),
                a["finish_reason"] + (f" (`{a['stop_token']}`)" if a["stop_token"] else ""),
                "yes" if a["clean"] else "no",
            ]
            for a in formats[fmt]["answers"]
        ]
        parts += [f"### {fmt}", md_table(["question", "answer", "finish", "clean"], rows)]
    shares = att["control_share_per_layer"]
    parts += [
        "### Where the final position looks",
        f"The first question in {model}'s own format; control-token positions "
        f"{att['control_positions']} of {att['num_prompt_tokens']}:",
        md_code(att["prompt"]),
        f"Averaged over heads, the final position puts **{att['control_share_mean']:.1%}** of its attention on "
        f"control tokens (mean over {len(shares)} layers), **{att['peak_share']:.1%}** at layer "
        f"{att['peak_layer']} (0-based), against {att['control_fraction_of_positions']:.1%} if it attended "
        f"uniformly. Position 0 alone, `{att['first_token']}`, takes {att['position0_share_mean']:.1%} on average: the "
        "attention sink, a position the heads park their attention on when nothing else is relevant.",
    ]
    return "\n\n".join(parts)
