"""Experiment 7: one tool round trip with get_weather(city), every stage's text shown.

    1. render     the user's question with the tools, as the template renders them: a template with
                  a tool format (Qwen's <tool_call>, "hermes") renders `tools` itself; one without
                  (the embedded SmolLM2) gets the json convention of tools/specs.py in its
                  system message
    2. call       tool_choice "get_weather": LLM.chat turns it into a grammar, so the output always
                  parses, and returns the parsed call; greedy
    3. result     the call as an assistant message with tool_calls, and a canned weather report as
                  the `tool` message, rendered back through the template
    4. answer     a free (unconstrained) greedy reply with the tools still offered (tool_choice
                  "auto"); a model that calls the tool again (small ones do) gets a second try with
                  the tools withdrawn (tool_choice "none"), and that reply is the final answer

Only LLM.chat(tools=..., tool_choice=...) and LLM.render(tools=...) are used: the one implementation of
tool calling (tools/calling.py) that the server's chat endpoint calls too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from onecall import LLM, RequestOutput, SamplingParams, ToolCall, ToolChatOutput, ToolFormat
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.plots import bar_plot
from onecall.lab.report import md_code

NAME = "tools"
TITLE = "One tool round trip: get_weather(city)"

TOOL_NAME = "get_weather"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city's name, e.g. Paris"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = "What's the weather like in Paris right now?"
WEATHER = {"temperature_c": 18, "conditions": "light rain", "wind_kmh": 12}  # the canned tool result
CALL_MAX_TOKENS = 64  # the forced call takes about 25 tokens
ANSWER_MAX_TOKENS, QUICK_ANSWER_MAX_TOKENS = 96, 32


def _reply(
    llm: LLM, messages: list[dict[str, Any]], max_tokens: int, tool_choice: Any = "auto"
) -> ToolChatOutput:
    """One greedy reply through LLM.chat's tool calling: "auto" parses the calls, a named function
    forces one with a grammar, "none" withdraws the tools (earlier calls still render)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat(messages, params, tools=TOOLS, tool_choice=tool_choice)[0]


def run(ctx: LabContext) -> ExperimentResult:
    llm = ctx.llm
    fmt = ToolFormat.for_template(llm.tokenizer.chat_template)
    answer_max_tokens = QUICK_ANSWER_MAX_TOKENS if ctx.quick else ANSWER_MAX_TOKENS

    # 1. the question with the tools, as the template renders them; 2. the call, forced by a grammar
    ctx.progress(f"tools: render ({fmt.value} format) and the constrained call")
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = llm.render(history, tools=TOOLS)
    forced = _reply(llm, history, CALL_MAX_TOKENS, {"type": "function", "function": {"name": TOOL_NAME}})
    call_out = forced.output
    call = forced.tool_calls[0] if forced.tool_calls else None
    arguments = _arguments(call)

    # 3. the call and its result back through the template
    ctx.progress("tools: tool result and the final answer")
    city = arguments.get("city") if isinstance(arguments, dict) else None
    history += _round_trip_messages(call, {"city": city, **WEATHER})
    second = llm.render(history, tools=TOOLS)

    # 4. the answer with the tools still offered (tool_choice "auto", as an agent loop sends it); a
    #    model that calls the tool again is answered once more with the tools withdrawn ("none")
    auto = _reply(llm, history, answer_max_tokens)
    auto_out, answer = auto.output, auto
    if auto.tool_calls:
        ctx.progress("tools: the model called again; answering with the tools withdrawn")
        answer = _reply(llm, history, answer_max_tokens, tool_choice="none")
    answer_out = answer.output

    shared = len(os.path.commonprefix([first.text, second.text]))
    results: dict[str, Any] = {
        "format": fmt.value,
        "rendered_prompt": first.text,
        "rendered_prompt_tokens": len(first.token_ids),
        "call_text": call_out.text,
        "call_finish_reason": call_out.finish_reason,
        "api_finish_reason": "tool_calls" if forced.finish_reason == "tool_calls" else None,
        "call": None if call is None else {"name": call.name, "arguments": arguments},
        "arguments_valid": _valid_arguments(arguments),
        "tool_result": history[-1],
        "second_prompt_added": second.text[shared:],
        "second_prompt_tokens": len(second.token_ids),
        "second_cached_tokens": auto_out.num_cached_tokens,
        "auto_reply": auto_out.text,
        "auto_called_again": bool(auto.tool_calls),
        "auto_finish_reason": auto_out.finish_reason,
        "final_answer": answer.content or "",
        "final_tools_withdrawn": bool(auto.tool_calls),
        "final_finish_reason": answer_out.finish_reason,
        "final_output_tokens": len(answer_out.token_ids),
        "calls": _call_sizes(
            {"1: forced call": call_out, "2: reply, tools offered": auto_out}
            | ({"3: reply, tools withdrawn": answer_out} if auto.tool_calls else {})
        ),
    }
    plot = bar_plot(
        ctx.out_dir / "tools_calls.png",
        [c["call"] for c in results["calls"]],
        {
            "prompt tokens": [c["prompt_tokens"] for c in results["calls"]],
            "from the prefix cache": [c["cached_tokens"] for c in results["calls"]],
            "generated": [c["output_tokens"] for c in results["calls"]],
        },
        title=f"The round trip's calls, {ctx.llm.info.model_name}",
        xlabel="call",
        ylabel="tokens",
    )
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        results=results,
        seed_rows=_seed_rows(ctx, results),
        markdown=_markdown(ctx, results),
        plots=[plot],
    )


def _call_sizes(outputs: dict[str, RequestOutput]) -> list[dict[str, Any]]:
    return [
        {
            "call": name,
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "output_tokens": len(out.token_ids),
        }
        for name, out in outputs.items()
    ]


def _arguments(call: ToolCall | None) -> Any:
    if call is None:
        return None
    try:
        return json.loads(call.arguments_json)
    except json.JSONDecodeError:
        return call.arguments_json  # kept as text: _valid_arguments says no


def _valid_arguments(arguments: Any) -> bool:
    """The schema's rules by hand: an object with a non-empty string `city` and no other key."""
    return (
        isinstance(arguments, dict)
        and set(arguments) == {"city"}
        and isinstance(arguments["city"], str)
        and bool(arguments["city"].strip())
    )


def _round_trip_messages(call: ToolCall | None, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant's call (OpenAI shape) and the tool's reply to it."""
    if call is None:  # the grammar makes this unreachable unless the call was cut short
        return [{"role": "assistant", "content": "(no call)"}]
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": json.dumps(result)},
    ]


def _seed_rows(ctx: LabContext, r: dict[str, Any]) -> list[SeedRow]:
    call = r["call"]
    shown = "no call" if call is None else f"{call['name']}({json.dumps(call['arguments'])})"
    return [
        SeedRow(
            "forced tool call (grammar)",
            "not measured (the seed ends at the bridge to tool calling, 12:04)",
            f"{shown}, finish_reason {r['api_finish_reason']!r}",
            f"ours: {ctx.setting}; {r['format']} tool format",
        ),
        SeedRow(
            "second call: prompt tokens served by the prefix cache",
            "not measured",
            f"{r['second_cached_tokens']:,} of {r['second_prompt_tokens']:,}",
            "the tools block sits at the top of the prompt, so the round trip re-uses it (the seed's advice)",
        ),
    ]


def _markdown(ctx: LabContext, r: dict[str, Any]) -> str:
    fmt_note = (
        f"The template renders the tools itself ({r['format']} format)."
        if r["format"] != ToolFormat.JSON
        else "The template has no tool format, so the tools go into the system message as onecall's JSON "
        'convention (tools/specs.py) and the model answers `{"tool_calls": [...]}`.'
    )
    return "\n\n".join(
        [
            f"{ctx.setting}. {fmt_note}",
            f"**1. The prompt as rendered** ({r['rendered_prompt_tokens']} tokens):",
            _block(r["rendered_prompt"]),
            f"**2. The constrained call** (a grammar forces {TOOL_NAME}; engine finish_reason "
            f"{r['call_finish_reason']!r}, API finish_reason {r['api_finish_reason']!r}; arguments valid: "
            f"{r['arguments_valid']}):",
            _block(r["call_text"]),
            f"**3. The call and the tool result, as the second prompt adds them** ({r['second_prompt_tokens']} "
            f"tokens, {r['second_cached_tokens']} from the prefix cache):",
            _block(r["second_prompt_added"]),
            f"**4. The reply with the tools still offered** (finish_reason {r['auto_finish_reason']!r}"
            f"{'; it called the tool again' if r['auto_called_again'] else ''}):",
            _block(r["auto_reply"]),
            *(
                [
                    f'**5. The final answer, tools withdrawn** (tool_choice "none"; finish_reason '
                    f"{r['final_finish_reason']!r}, {r['final_output_tokens']} tokens):",
                    _block(r["final_answer"]),
                ]
                if r["final_tools_withdrawn"]
                else ["That reply is the final answer."]
            ),
        ]
    )


def _block(text: str) -> str:
    return md_code(text, "text")
