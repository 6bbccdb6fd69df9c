"""Named chat templates that ship with onecall, for experiments that need a template other than the model's.

    get_named_template("qwen3-style") -> Jinja source, for render_chat(..., template=...) or
                                         LLM.chat(..., chat_template=...)

"qwen3-style" renders the ChatML layout of the embedded SmolLM2 (`<|im_start|>role\\n...<|im_end|>\\n`,
no default system prompt) with the one habit of Qwen3's template that the seed measured: with thinking
off, the generation prompt carries an empty reasoning block

    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

but once that reply becomes an earlier turn of the history, the block is dropped (only the text after
the last `</think>` is kept). So the next prompt differs from the cached previous one just before that
reply, and the prefix-cache match breaks "N tokens early" every turn: N is the block's length in
tokens (4 for Qwen3, where <think> and </think> are single tokens; more where they are plain text).
`enable_thinking=True` (a template variable) leaves the block out of the generation prompt, so the
model writes its own reasoning, as Qwen3's template does.

The server keeps using only the model's own template; these are for the Python API and the lab.
"""

from __future__ import annotations

from onecall.errors import InvalidParameterError

# Written for this project, modeled on the behaviour of Qwen3's template described above.
QWEN3_STYLE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

NAMED_TEMPLATES: dict[str, str] = {
    "qwen3-style": QWEN3_STYLE,
}


def get_named_template(name: str) -> str:
    """The Jinja source of a named template; InvalidParameterError naming the choices otherwise."""
    try:
        return NAMED_TEMPLATES[name]
    except KeyError:
        choices = ", ".join(sorted(NAMED_TEMPLATES))
        raise InvalidParameterError(
            "chat_template", f"no named template {name!r}; choose one of: {choices}"
        ) from None
