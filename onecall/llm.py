"""LLM: the Python entry point. `LLM().generate(...)`, `.chat(...)`, and streaming forms.

Every method drives the same Engine.add_request / step loop; nothing here knows
about tensors, except attention_probs(), which runs the model's separate inspection
path (model/attention_probe.py) for the lab. Chat conversations are rendered with the model's own template
(the seed's point: without it the model does not stop cleanly) and the render
(text, ids, control-token mask) goes into each request's trace.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine, RequestOutput
from onecall.errors import ContextLengthExceededError, InvalidParameterError
from onecall.model.attention_probe import last_position_attention
from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import RenderedPrompt, render_chat

Prompt = str | list[int]
Message = dict[str, Any]
Params = SamplingParams | Sequence[SamplingParams] | None  # one for all prompts, or one per prompt


class LLM:
    """An engine with a model loaded. `model=None` is the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        *,
        engine: Engine | None = None,
        **config_kwargs: Any,
    ) -> None:
        self.engine = engine or Engine(EngineConfig(model=model, dtype=dtype, device=device, **config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # ---- prompts -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], params: Params = None) -> list[RequestOutput]:
        """Complete one prompt or a batch of them (str or token ids); outputs in input order.

        `params` is one SamplingParams for all, or a list with one per prompt (e.g. a
        different structured_outputs schema for each)."""
        return self._run_all(_as_prompt_list(prompts), params)

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield an output per new token (delta_text / delta_token_ids), the last one finished."""
        yield from self._stream(prompt, params)

    # ---- chat --------------------------------------------------------------------------------
    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> RenderedPrompt:
        """The prompt a chat request sends: text, ids, control-token mask. `chat_template` (Jinja
        source, e.g. onecall.text.templates.get_named_template("qwen3-style")) replaces the model's."""
        return render_chat(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=chat_template_kwargs,
            template=chat_template,
        )

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: Params = None,
        *,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them; params as in generate().
        render_kwargs (tools, chat_template_kwargs, ...) and chat_template go to render()."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [
            self.render(conv, chat_template=chat_template, **render_kwargs)  # type: ignore[arg-type]
            for conv in convs
        ]
        return self._run_all(rendered, params)

    def chat_stream(
        self,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> Iterator[RequestOutput]:
        yield from self._stream(self.render(messages, chat_template=chat_template, **render_kwargs), params)

    # ---- inspection --------------------------------------------------------------------------
    def attention_probs(self, prompt: Prompt | RenderedPrompt) -> torch.Tensor:
        """(num_layers, num_prompt_tokens) float32: per layer, the attention the prompt's last position
        pays to every position, averaged over heads (rows sum to 1). A separate plain forward
        (model/attention_probe.py): no KV cache, nothing shared with the engine's requests."""
        ids = self.engine.prompt_token_ids(prompt)
        if len(ids) > self.engine.max_model_len:
            raise ContextLengthExceededError(len(ids), self.engine.max_model_len)
        return last_position_attention(self.engine.parts.model, torch.tensor(ids, dtype=torch.int64))

    def weight_bytes_read(self, rows: int = 1) -> int:
        """Bytes of weights one forward over `rows` tokens (and their logits) streams from memory, in
        the form the loaded kernels read them: what a decode step's bandwidth divides by."""
        from onecall.model.packing import weight_bytes_read

        return weight_bytes_read(self.engine.parts.model, rows)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their own KV): later prompts are
        recomputed from scratch."""
        self.engine.reset_prefix_cache()

    # ---- the loop ----------------------------------------------------------------------------
    def _run_all(self, prompts: Sequence[Prompt | RenderedPrompt], params: Params) -> list[RequestOutput]:
        per_prompt = _per_prompt_params(params, len(prompts))
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            # Adding is inside the try: if prompt k is invalid, prompts 0..k-1 are aborted too,
            # instead of staying queued and running, unseen, during the next call.
            for p, sp in zip(prompts, per_prompt, strict=True):
                ids.append(self._add(p, sp))
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.error is not None:
                        raise out.error  # the step that ran it failed (the engine serves on)
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def _stream(
        self, prompt: Prompt | RenderedPrompt, params: SamplingParams | None
    ) -> Iterator[RequestOutput]:
        rid = self._add(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise out.error
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)  # no-op when finished; frees blocks if the caller stopped early

    def _add(self, prompt: Prompt | RenderedPrompt, params: SamplingParams | None) -> str:
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        return rid


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise InvalidParameterError(
        "prompts", f"must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
    )


def _per_prompt_params(params: Params, num_prompts: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidParameterError("params", "must be a SamplingParams or a list of them, one per prompt")
    if len(params) != num_prompts:
        raise InvalidParameterError("params", f"has {len(params)} entries for {num_prompts} prompts")
    return list(params)
