"""Tool calling, one home for what the server, the library (LLM.chat) and the lab share.

    specs.py    `tools` / `tool_choice` validated; the tools described to a template without a tool
                format; the schema or grammar that enforces a required or named call
    calls.py    tool calls out of model output: whole-text and streaming parsers (hermes and json)
    xml_calls.py  Qwen3.5's XML calls (<function=NAME><parameter=KEY>): scan, values typed by the
                schema, the forced-call grammar
    gemma4_calls.py  Gemma 4's calls (<|tool_call>call:NAME{key:value}<tool_call|>): scan, values typed
                as written, the forced-call grammar, tool results as the template's tool_responses
    harmony_grammar.py  gpt-oss: a forced call or structured outputs as a grammar over harmony's channels
    calling.py  ChatTools: one request's tools for one model's template (what to render, what to
                enforce, a parser per choice); ToolChatOutput, what LLM.chat returns with tools

It sits above the engine (calling.py reads a RequestOutput) and below the server and the library;
the server's ChoiceParser (server/serving_tools.py) turns its parsed calls into OpenAI deltas.
"""
