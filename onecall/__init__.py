"""onecall: an LLM inference engine that shows what one call really does.

    from onecall import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0))[0]
    print(out.text, out.trace.num_cached_tokens)

The public API is `__all__`, and entry points built on the library (the lab) import nothing else:

    LLM, ModelInfo, RequestOutput               the engine behind a facade; what it loaded; what it returns
    SamplingParams, StructuredOutputsParams     a request's parameters
    RenderedPrompt, get_named_template          LLM.render's result; the templates onecall ships
    ToolChatOutput, ToolCall, ToolFormat        LLM.chat(tools=...)'s result, a parsed call, and how the
                                                model's template talks tools (tools/calling.py)
    OnecallError, InvalidParameterError         the errors a caller can cause

Everything but the parameters loads lazily, on first use, so `import onecall` stays cheap
(no torch, and none of onecall's subpackages).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onecall.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from onecall.engine.engine import RequestOutput
    from onecall.errors import InvalidParameterError, OnecallError
    from onecall.llm import LLM, ModelInfo
    from onecall.text.chat_template import RenderedPrompt
    from onecall.text.templates import get_named_template
    from onecall.tools.calling import ToolChatOutput
    from onecall.tools.calls import ToolCall
    from onecall.tools.specs import ToolFormat

# name -> the module that defines it, imported on first access
_LAZY: dict[str, str] = {
    "InvalidParameterError": "onecall.errors",
    "LLM": "onecall.llm",
    "ModelInfo": "onecall.llm",
    "OnecallError": "onecall.errors",
    "RenderedPrompt": "onecall.text.chat_template",
    "RequestOutput": "onecall.engine.engine",
    "ToolCall": "onecall.tools.calls",
    "ToolChatOutput": "onecall.tools.calling",
    "ToolFormat": "onecall.tools.specs",
    "get_named_template": "onecall.text.templates",
}

__all__ = [
    "InvalidParameterError",
    "LLM",
    "ModelInfo",
    "OnecallError",
    "RenderedPrompt",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "ToolCall",
    "ToolChatOutput",
    "ToolFormat",
    "get_named_template",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'onecall' has no attribute {name!r}")
