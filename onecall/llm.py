"""LLM: the Python entry point. `LLM().generate(...)`, `.chat(...)`, and streaming forms.

Every method drives the same Engine.add_request / step loop; nothing here knows
about tensors, except attention_probs(), which runs the model's separate inspection
path (model/attention_probe.py) for the lab. `LLM.info` (a ModelInfo) says what is loaded and
how it runs, so callers (the CLI, the lab) never read the engine's insides. Chat conversations are rendered with the model's own template
(the seed's point: without it the model does not stop cleanly) and the render
(text, ids, control-token mask) goes into each request's trace.

A harmony model (gpt-oss: text/harmony.py's speaks_harmony, the server's own test) is chatted with
as the server does it: the conversation (and tools) rendered by openai-harmony, the request stopped
at <|return|> or <|call|>, and the output parsed from its token ids: the final channel is the text
(content), analysis the `reasoning`, commentary calls to functions.* the tool_calls. chat() then
returns HarmonyChatOutput (a RequestOutput with `reasoning`) or, with tools, HarmonyToolChatOutput (a
ToolChatOutput with `reasoning`). A forced tool_choice ("required" or a named function) and
structured outputs become a grammar over harmony's channels, as in the server
(tools/harmony_grammar.py); a chat_template is refused (an InvalidParameterError naming it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine, RequestOutput
from onecall.engine.state_slots import aligned_snapshot
from onecall.errors import ContextLengthExceededError, InvalidParameterError
from onecall.model.attention_probe import last_position_attention
from onecall.sampling_params import SamplingParams
from onecall.text.chat_template import RenderedPrompt, render_chat
from onecall.text.harmony import HarmonyStream, parse_harmony, render_harmony, speaks_harmony, stop_token_ids
from onecall.tools.calling import ChatTools, ToolChatOutput
from onecall.tools.calls import ToolCall
from onecall.tools.harmony_grammar import harmony_constraint

Prompt = str | list[int]
Message = dict[str, Any]
Params = SamplingParams | Sequence[SamplingParams] | None  # one for all prompts, or one per prompt
ToolChoiceParam = str | dict[str, Any] | None  # OpenAI's tool_choice; None: "auto" with tools


@dataclass(frozen=True)
class ModelInfo:
    """What an LLM has loaded and how it runs (`LLM.info`): for reports, logs and bandwidth
    arithmetic. Plain values only, so `dataclasses.asdict(info)` is JSON. The shape fields keep
    Hugging Face's names."""

    model_name: str  # the GGUF file's stem or the Hugging Face folder's name
    device: str  # "cpu", "cuda:0", ...
    dtype: str  # the weights' compute dtype: "float32", "bfloat16", "float16"
    kernels: str  # what the projections run on on this device (the --kernels switch's outcome)
    kv_cache_dtype: str  # what the K/V cache holds (the model's dtype unless kv_cache_dtype says otherwise)
    max_model_len: int  # the longest prompt + output, in tokens
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    weight_bytes_per_step: int  # weight bytes a one-token decode step streams (LLM.weight_bytes_read(1))
    kv_bytes_per_token: int  # K and V of one cached position over all layers (that hold K and V)
    # a hybrid model (linear-attention layers beside attention ones: model/state_cache.py): the fixed
    # state one sequence carries, which a prefix snapshot holds too, and how many snapshots are kept;
    # 0 for other models
    state_bytes_per_sequence: int = 0
    state_snapshots: int = 0

    def aligned_snapshot(self, num_prompt_tokens: int) -> int:
        """A hybrid model: the prompt position of the aligned state snapshot a prompt of this length
        leaves (engine/state_slots.py; 0: none, and always 0 for other models)."""
        return aligned_snapshot(num_prompt_tokens) if self.state_bytes_per_sequence else 0

    def decode_step_bytes(self, num_positions: int) -> int:
        """Bytes a one-sequence decode step reads when it attends over `num_positions` positions:
        every weight once, plus K and V of each position in every attention layer, plus (a hybrid
        model) the sequence's linear-attention state, read and written once."""
        return (
            self.weight_bytes_per_step
            + self.kv_bytes_per_token * num_positions
            + 2 * self.state_bytes_per_sequence
        )


@dataclass
class HarmonyChatOutput(RequestOutput):
    """LLM.chat's output for a harmony model (gpt-oss): `text` is the final channel's text ("" when
    it said nothing there), `reasoning` the analysis channel's (None when empty). token_ids, the
    trace and finish_reason are the engine's, for the whole completion. In LLM.chat_stream each
    output is one token's: `delta_text` and `delta_reasoning` what it added to each channel, `text`
    and `reasoning` the channels so far."""

    reasoning: str | None = None
    delta_reasoning: str = ""


@dataclass(frozen=True)
class HarmonyToolChatOutput(ToolChatOutput):
    """LLM.chat's output with tools for a harmony model: content is the final channel's text,
    tool_calls the commentary calls to functions.NAME (arguments as generated), `reasoning` the
    analysis channel's text (None when empty); `output` is the HarmonyChatOutput."""

    reasoning: str | None = None


class LLM:
    """An engine with a model loaded. `model=None` is the embedded SmolLM2-135M-Instruct.

    `tensor_parallel_size=N` (an EngineConfig field, like the other keyword arguments) splits the
    model over N processes that this one starts (engine/tp/workers.py); `close()`, or leaving a
    `with LLM(...) as llm:` block, stops them (they also stop when this process exits)."""

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

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op with one process). The LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- prompts -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], params: Params = None) -> list[RequestOutput]:
        """Complete one prompt or a batch of them (str or token ids); outputs in input order.

        `params` is one SamplingParams for all, or a list with one per prompt (e.g. a
        different structured_outputs schema for each). To score text as evaluation harnesses do,
        ask for `prompt_logprobs=0, max_tokens=0`: each output's `prompt_logprobs` then holds
        log P(token | the tokens before it) for every prompt token (None for the first)."""
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
        tool_choice: ToolChoiceParam = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> RenderedPrompt:
        """The prompt a chat request sends: text, ids, control-token mask. `chat_template` (Jinja
        source, e.g. onecall.text.templates.get_named_template("qwen3-style")) replaces the model's.
        `tools` are offered as chat(tools=...) offers them: through a template with a tool format, else
        in the system message (tools/specs.py's convention); tool_choice "none" withdraws them.
        A harmony model's prompt is openai-harmony's rendering (chat_template_kwargs' reasoning_effort
        is the one option it takes)."""
        if self.speaks_harmony:
            chat_tools = (
                ChatTools.build(tools, tool_choice, self.tokenizer)
                if tools is not None or tool_choice is not None
                else None
            )
            return self._render_harmony(
                messages,
                chat_tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
        template_tools = None
        if tools is not None or tool_choice is not None:
            chat_tools = ChatTools.build(tools, tool_choice, self.tokenizer)
            messages, template_tools = chat_tools.template_inputs(messages)
        return render_chat(
            self.tokenizer,
            messages,
            tools=template_tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=chat_template_kwargs,
            template=chat_template,
        )

    @overload
    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: Params = None,
        *,
        tools: None = None,
        tool_choice: None = None,
        parallel_tool_calls: bool | None = None,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> list[RequestOutput]: ...

    @overload
    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: Params = None,
        *,
        tools: list[dict[str, Any]],
        tool_choice: ToolChoiceParam = None,
        parallel_tool_calls: bool | None = None,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> list[ToolChatOutput]: ...

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: Params = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoiceParam = None,
        parallel_tool_calls: bool | None = None,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> list[RequestOutput] | list[ToolChatOutput]:
        """One conversation (a list of messages) or a batch of them; params as in generate().
        render_kwargs (chat_template_kwargs, ...) and chat_template go to render().

        With `tools` (OpenAI's shape) and `tool_choice` ("auto" when omitted, "none", "required",
        {"type": "function", "function": {"name": ...}}) the tools are rendered through the
        template (or its system message, tools/specs.py's convention), a grammar forces the
        call when tool_choice requires one, and each result is a ToolChatOutput: content,
        tool_calls (id, name, arguments_json) and the API's finish_reason, as the server answers.

        A harmony model (gpt-oss) is rendered by openai-harmony and its output split by channel, as
        the server splits it: HarmonyChatOutput (text: the final channel, reasoning: analysis) or,
        with tools, HarmonyToolChatOutput (content, tool_calls, reasoning). A forced tool_choice and
        structured outputs are refused for it (InvalidParameterError naming the field)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.speaks_harmony:
            return self._chat_harmony(
                convs,  # type: ignore[arg-type]
                params,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                chat_template=chat_template,
                **render_kwargs,
            )
        if tools is None and tool_choice is None:
            rendered = [
                self.render(conv, chat_template=chat_template, **render_kwargs)  # type: ignore[arg-type]
                for conv in convs
            ]
            return self._run_all(rendered, params)
        return self._chat_with_tools(
            convs,  # type: ignore[arg-type]
            params,
            ChatTools.build(tools, tool_choice, self.tokenizer, parallel_tool_calls=parallel_tool_calls),
            chat_template=chat_template,
            **render_kwargs,
        )

    def _chat_with_tools(
        self,
        convs: list[list[Message]],
        params: Params,
        tools: ChatTools,
        *,
        chat_template: str | None,
        **render_kwargs: Any,
    ) -> list[ToolChatOutput]:
        """LLM.chat with tools: render with them, constrain when a call is required, parse the calls."""
        per_prompt = [tools.sampling_params(p) for p in _per_prompt_params(params, len(convs))]
        rendered: list[RenderedPrompt] = []
        template_kwargs = render_kwargs.pop("chat_template_kwargs", None)
        rendered = []
        for conv in convs:
            messages, template_tools = tools.template_inputs(conv)
            rendered.append(
                render_chat(
                    self.tokenizer,
                    messages,
                    tools=template_tools,
                    template_kwargs=template_kwargs,
                    template=chat_template,
                    **render_kwargs,  # add_generation_prompt
                )
            )
        return [tools.parse(out) for out in self._run_all(rendered, per_prompt)]

    # ---- harmony (gpt-oss) ---------------------------------------------------------------------
    @functools.cached_property
    def speaks_harmony(self) -> bool:
        """Is the loaded model chatted with in harmony (gpt-oss), as the server decides it?"""
        return speaks_harmony(self.tokenizer)

    def _render_harmony(
        self,
        messages: list[Message],
        tools: ChatTools | None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> RenderedPrompt:
        """A harmony model's prompt, as the server renders it; what harmony cannot take is refused."""
        if chat_template is not None:
            raise InvalidParameterError(
                "chat_template",
                "gpt-oss (harmony) models are rendered by openai-harmony, not a chat template",
            )
        if not add_generation_prompt:
            raise InvalidParameterError(
                "add_generation_prompt", "a gpt-oss (harmony) prompt always ends in the assistant's turn"
            )
        effort = (chat_template_kwargs or {}).get("reasoning_effort")
        if effort is not None and not isinstance(effort, str):
            raise InvalidParameterError(
                "chat_template_kwargs", "reasoning_effort must be 'low', 'medium' or 'high'"
            )
        return render_harmony(messages, tools.tools if tools else None, reasoning_effort=effort)

    def _harmony_params(
        self, params: SamplingParams | None, tools: ChatTools | None = None
    ) -> SamplingParams:
        """`params` with harmony's stop tokens added (<|return|>, <|call|>), and a forced call's or
        structured outputs' constraint as a grammar over harmony's channels (tools/harmony_grammar.py)."""
        params = params if params is not None else SamplingParams()
        if tools is not None and tools.choice.mode == "required" and params.structured_outputs is not None:
            raise InvalidParameterError(
                "structured_outputs",
                "cannot be combined with a forced tool_choice, which sets the output's grammar",
            )
        asked = (params.structured_outputs, "structured_outputs") if params.structured_outputs else None
        constraint = harmony_constraint(tools, asked, params.max_tokens)
        if constraint is not None:
            params = dataclasses.replace(params, structured_outputs=constraint[0])
        extra = tuple(sorted(set(stop_token_ids()) - set(params.stop_token_ids)))
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)

    def _chat_harmony(
        self,
        convs: list[list[Message]],
        params: Params,
        *,
        tools: list[dict[str, Any]] | None,
        tool_choice: ToolChoiceParam,
        parallel_tool_calls: bool | None,
        chat_template: str | None,
        **render_kwargs: Any,
    ) -> list[RequestOutput] | list[ToolChatOutput]:
        """LLM.chat for a harmony model: openai-harmony's prompt, its stop tokens, the output split by
        channel (text/parse_harmony, the server's parser)."""
        with_tools = tools is not None or tool_choice is not None
        chat_tools = None
        if with_tools:
            chat_tools = ChatTools.build(
                tools, tool_choice, self.tokenizer, parallel_tool_calls=parallel_tool_calls
            )
        per_prompt = [self._harmony_params(p, chat_tools) for p in _per_prompt_params(params, len(convs))]
        rendered = [
            self._render_harmony(conv, chat_tools, chat_template=chat_template, **render_kwargs)
            for conv in convs
        ]
        outputs = [_split_harmony(out) for out in self._run_all(rendered, per_prompt)]
        if chat_tools is None:
            plain: list[RequestOutput] = [out for out, _ in outputs]
            return plain
        with_calls: list[ToolChatOutput] = [
            HarmonyToolChatOutput(
                out, out.text or None, calls if chat_tools.parallel else calls[:1], reasoning=out.reasoning
            )
            for out, calls in outputs
        ]
        return with_calls

    def chat_stream(
        self,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        **render_kwargs: Any,
    ) -> Iterator[RequestOutput]:
        """Yield an output per new token of one conversation's reply. A harmony model's prompt is
        openai-harmony's, its stop tokens end it, and each output is a HarmonyChatOutput split by
        channel as it streams: final -> text / delta_text, analysis -> reasoning / delta_reasoning."""
        rendered = self.render(messages, chat_template=chat_template, **render_kwargs)
        if not self.speaks_harmony:
            yield from self._stream(rendered, params)
            return
        stream, text, reasoning = HarmonyStream(), "", ""
        for out in self._stream(rendered, self._harmony_params(params)):
            d = stream.feed(out.delta_token_ids)
            if out.finished:
                d.add(stream.finish())
            text, reasoning = text + d.content, reasoning + d.reasoning
            fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if f.init}
            fields.update(text=text, delta_text=d.content)
            yield HarmonyChatOutput(**fields, reasoning=reasoning or None, delta_reasoning=d.reasoning)

    # ---- inspection --------------------------------------------------------------------------
    @functools.cached_property
    def info(self) -> ModelInfo:
        """The loaded model, device, dtypes, kernels and shape; fixed once the model is loaded."""
        parts, cfg = self.engine.parts, self.engine.model_config
        kv_dtype = parts.kv_cache.k.dtype
        kv_per_layer = cfg.num_key_value_heads * cfg.head_dim * kv_dtype.itemsize  # K or V of one position
        state = cfg.linear_state_shape
        return ModelInfo(
            model_name=parts.model_name,
            device=str(self.engine.device),
            dtype=_dtype_name(parts.dtype),
            kernels=parts.kernels,
            kv_cache_dtype=_dtype_name(kv_dtype),
            max_model_len=self.engine.max_model_len,
            vocab_size=cfg.vocab_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            weight_bytes_per_step=self.weight_bytes_read(1),
            kv_bytes_per_token=2 * cfg.num_kv_layers * kv_per_layer,
            state_bytes_per_sequence=0 if state is None else state.bytes_per_slot(parts.dtype),
            state_snapshots=0 if state is None else self.engine.config.num_state_snapshots,
        )

    def attention_probs(self, prompt: Prompt | RenderedPrompt) -> torch.Tensor:
        """(num_layers, num_prompt_tokens) float32: per layer, the attention the prompt's last position
        pays to every position, averaged over heads (rows sum to 1). A separate plain forward
        (model/attention_probe.py): no KV cache, nothing shared with the engine's requests."""
        if self.engine.config.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "tensor_parallel_size", "attention_probs() runs the model in this process alone: use 1"
            )
        ids = self.engine.prompt_token_ids(prompt)
        if len(ids) > self.engine.max_model_len:
            raise ContextLengthExceededError(len(ids), self.engine.max_model_len)
        return last_position_attention(self.engine.parts.model, torch.tensor(ids, dtype=torch.int64))

    def weight_bytes_read(self, rows: int = 1) -> int:
        """Bytes of weights one forward over `rows` tokens (and their logits) streams from memory, in
        the form the loaded kernels read them: what a decode step's bandwidth divides by."""
        from onecall.loading.packing import weight_bytes_read

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


def _split_harmony(out: RequestOutput) -> tuple[HarmonyChatOutput, list[ToolCall]]:
    """A finished harmony completion -> (the output with the final channel as its text and the
    analysis as its reasoning, the calls to functions.*), parsed from its token ids."""
    parsed = parse_harmony(out.token_ids)
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if f.init}
    fields["text"] = parsed.content or ""
    split = HarmonyChatOutput(**fields, reasoning=parsed.reasoning_content)
    return split, [ToolCall(id=i, name=name, arguments_json=args) for i, name, args in parsed.calls]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
