"""onecall: an LLM inference engine that shows what one call really does.

    from onecall import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0))[0]
    print(out.text, out.trace.num_cached_tokens)

Heavy modules load lazily so `import onecall` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onecall.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from onecall.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from onecall.llm import LLM

        return LLM
    raise AttributeError(name)
