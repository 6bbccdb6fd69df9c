"""Grammars over harmony's channels (gpt-oss): a forced tool call, or a final answer that must match.

A gpt-oss answer is not one text but messages in channels (text/harmony.py). The prompt ends in
`<|start|>assistant`; what the model may write next is, for

    tool_choice "required" / a named function        a call, after an optional analysis message:
        [<|channel|>analysis<|message|>...<|end|><|start|>assistant]
        <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
      or the recipient in the role header, as openai-harmony renders a call in the history:
         to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{args}<|call|>
    structured outputs (response_format, ...)        a final message, after an optional analysis:
        [<|channel|>analysis<|message|>...<|end|><|start|>assistant]
        <|channel|>final<|message|>BODY<|return|>

Both are llguidance Lark grammars whose markers are special-token references (<|channel|> is one
token of o200k_harmony), compiled and applied like any other (sampling/grammar.py). <|call|> and
<|return|> are harmony's stop tokens, so the request ends where the grammar does; the output is
parsed by the same HarmonyChoiceParser as an unforced one.

The analysis message is allowed because gpt-oss reasons before it acts (forbidding it would force an
answer without the model's reasoning), but it is bounded: at most `analysis_tokens` tokens (the
caller gives half of the request's token limit), so a forced call or answer always fits in what is
left. Its text is free (any bytes, never a special token).

Arguments and JSON bodies are generated compact, one space after ',' and ':' (as elsewhere in
onecall), with objects closed (no invented keys) unless structured outputs allow additional
properties. A user's own Lark grammar cannot be nested inside harmony's (its rule names would
collide with ours): that kind is refused with an InvalidParameterError naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from onecall.errors import InvalidParameterError
from onecall.sampling.json_schema import close_objects
from onecall.sampling_params import StructuredOutputsParams
from onecall.tools.calling import ChatTools
from onecall.tools.specs import tool_functions

_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANALYSIS = (
    'analysis: <|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant"\n'
    "thought[max_tokens={n}]: /(?s:.*)/\n"
)


def analysis_budget(max_tokens: int) -> int:
    """Tokens an analysis message may take before a forced call or answer: half the request's limit."""
    return max(0, max_tokens // 2)


def _json(schema: Any, *, close: bool) -> str:
    body = close_objects(schema) if close else schema
    if isinstance(body, dict):
        body = body | {"x-guidance": dict(_JSON_LAYOUT) | dict(body.get("x-guidance") or {})}
    return "%json " + json.dumps(body)


def _head(analysis_tokens: int) -> str:
    if analysis_tokens <= 0:
        return ""
    return _ANALYSIS.format(n=analysis_tokens)


def harmony_constraint(
    tools: ChatTools | None, asked: tuple[StructuredOutputsParams, str] | None, max_tokens: int
) -> tuple[StructuredOutputsParams, str] | None:
    """What a harmony request's output must match, and the field its errors name: a forced call
    (tool_choice "required" or a named function), else the structured outputs `asked` for (with the
    field they came in), else None. `max_tokens` is the request's token limit (analysis_budget)."""
    budget = analysis_budget(max_tokens)
    if tools is not None and tools.choice.mode == "required":
        grammar = harmony_call_grammar(tools.tools or [], tools.choice.name, analysis_tokens=budget)
        return StructuredOutputsParams(grammar=grammar), "tools"
    if asked is not None:
        so, field = asked
        return StructuredOutputsParams(
            grammar=harmony_final_grammar(so, field, analysis_tokens=budget)
        ), field
    return None


def harmony_call_grammar(
    tools: list[dict[str, Any]], required_name: str | None, *, analysis_tokens: int
) -> str:
    """The Lark grammar of one call (of `required_name`, or of any offered function when None), after
    an optional analysis message of at most `analysis_tokens` tokens (none when 0)."""
    functions = tool_functions(tools)
    if required_name is not None:
        functions = tuple(f for f in functions if f.name == required_name)
    if not functions:
        raise InvalidParameterError("tool_choice", f"no offered function is named {required_name!r}")
    rules = [f"start: {'analysis? ' if analysis_tokens > 0 else ''}call\n", _head(analysis_tokens)]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))) + "\n")
    for i, f in enumerate(functions):
        to = json.dumps(f" to=functions.{f.name}")
        in_channel = json.dumps(f"commentary to=functions.{f.name} ")
        rules.append(
            f'call_{i}: (<|channel|> {in_channel} | {to} <|channel|> "commentary ") '
            f'<|constrain|> "json" <|message|> args_{i} <|call|>\n'
        )
        rules.append(f"args_{i}: {_json(f.parameters, close=True)}\n")
    return "".join(rules)


def harmony_final_grammar(so: StructuredOutputsParams, field: str, *, analysis_tokens: int) -> str:
    """The Lark grammar of a final message whose text matches `so` (JSON schema, any JSON object, a
    regex or a choice), after an optional analysis message. `field` names the request's parameter in
    the error for a kind harmony cannot nest (a Lark grammar of the user's)."""
    if so.kind == "json":
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        body = _json(schema or {}, close=not so.allow_additional_properties)
    elif so.kind == "json_object":
        body = _json({"type": "object"}, close=False)
    elif so.kind == "regex":
        body = "/" + (so.regex or "").replace("/", "\\/") + "/"
    elif so.kind == "choice":
        body = " | ".join(json.dumps(c) for c in so.choice or ())
    else:
        raise InvalidParameterError(
            field,
            f"a {so.kind} constraint cannot be nested in gpt-oss's (harmony) channels; "
            "use a JSON schema, a regex or a choice",
        )
    return (
        f"start: {'analysis? ' if analysis_tokens > 0 else ''}final\n"
        + _head(analysis_tokens)
        + 'final: <|channel|> "final" <|message|> body <|return|>\n'
        + f"body: {body}\n"
    )
