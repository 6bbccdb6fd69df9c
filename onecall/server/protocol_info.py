"""Wire models of the server-introspection routes that routers poll: pure pydantic.

    GET /model_info, /get_model_info     ModelInfoResponse   what SGLang's get_model_info answers
    GET /server_info, /get_server_info   ServerInfoResponse  the server's settings and live engine state
    GET /get_load                        LoadResponse        requests in flight (vllm-router reads `load`)
    POST /v1/chat/completions/render     RenderResponse      the prompt's token ids, nothing generated
    POST /v1/completions/render          RenderList          one RenderResponse per prompt
    POST /flush_cache                    FlushCacheResponse  the prefix cache dropped

The names follow SGLang's native API (sgl-router's worker discovery reads `model_path`,
`served_model_name`, `max_context_length`, `tokenizer_path`, `is_generation`; vllm-router, a fork
of it, the same), so either router registers onecall replicas without a translation layer; fields SGLang has no name for are
onecall's own and say so in their descriptions. Every value comes from the running engine at the
moment of the request: nothing here is configured twice.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, RootModel

from onecall.server.protocol_base import ResponseModel


class _InfoModel(ResponseModel):
    # `model_path` and friends are SGLang's names; pydantic reserves `model_*` unless told otherwise
    model_config = ConfigDict(protected_namespaces=())


class ModelInfoResponse(_InfoModel):
    model_path: str = Field(description="The model's own name (its file or folder name).")
    served_model_name: str = Field(description="The name requests use in `model` (--served-model-name).")
    tokenizer_path: str = Field(description="Where the tokenizer came from: the same files as the model.")
    is_generation: bool = Field(default=True, description="Always true: onecall serves generative models.")
    max_context_length: int = Field(description="Prompt plus output tokens one request may hold.")
    vocab_size: int
    architectures: list[str] = Field(description="The model family onecall runs it as, e.g. ['llama'].")
    eos_token_ids: list[int]
    bos_token_id: int | None
    supports_vision: bool = False
    preferred_sampling_params: dict[str, float | int] | None = None
    weight_version: str = "default"


class InternalState(ResponseModel):
    """The live engine state (SGLang reports one of these per scheduler; onecall has one engine)."""

    num_running_reqs: int = Field(description="Requests in the running batch.")
    num_waiting_reqs: int = Field(description="Requests queued, not yet running.")
    num_used_tokens: int = Field(description="KV slots held by live sequences (used blocks x block size).")
    kv_cache_usage: float = Field(description="Fraction of KV blocks held by live sequences (0 to 1).")
    num_free_blocks: int = Field(description="onecall: KV blocks on the free list.")
    num_cached_blocks: int = Field(
        description="onecall: KV blocks held only by the prefix cache (evictable)."
    )
    prefix_cache_hit_rate: float | None = Field(
        description="onecall: hit tokens over queried tokens since start (None before the first query)."
    )
    num_state_snapshots: int | None = Field(
        default=None,
        description="onecall, a hybrid model: prefix snapshots of the linear-attention state held now.",
    )


class ServerInfoResponse(_InfoModel):
    model_path: str
    served_model_name: str
    tokenizer_path: str
    version: str = Field(description="onecall's package version.")
    max_total_num_tokens: int = Field(description="KV slots in all: num_kv_blocks x block_size.")
    max_running_requests: int = Field(description="--max-num-seqs.")
    max_queued_requests: int = Field(description="--max-waiting: beyond it a request gets a 429.")
    max_prefill_tokens: int = Field(description="Per-step token budget (chunked prefill).")
    chunked_prefill_size: int = Field(description="The same budget: prompts longer than it are chunked.")
    context_length: int
    page_size: int = Field(description="Tokens per KV block.")
    num_kv_blocks: int = Field(description="onecall: KV blocks in the pool.")
    disable_radix_cache: bool = Field(description="True when the prefix cache is off (--no-prefix-caching).")
    state_bytes_per_sequence: int | None = Field(
        default=None,
        description="onecall, a hybrid model (linear-attention layers): the fixed state one sequence "
        "carries besides its KV, which each prefix snapshot holds too (None for other models).",
    )
    max_state_snapshots: int | None = Field(
        default=None, description="onecall, a hybrid model: prefix snapshots kept at most (--state-snapshots)."
    )
    tp_size: int = 1
    dp_size: int = 1
    device: str
    dtype: str
    internal_states: list[InternalState]


class LoadResponse(ResponseModel):
    """vllm-router's /get_load shape: it reads `load`; the rest is for people and other tools.

    SGLang's router reads a different shape (a list of {dp_rank, num_tokens}) and shows -1 for
    this one; it routes cache_aware all the same (its own in-flight counts), but power_of_two
    needs the load it cannot parse.
    """

    load: int = Field(description="Requests in flight: running plus waiting.")
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int = Field(description="KV slots held by live sequences.")


class RenderResponse(ResponseModel):
    """vLLM's render answer (the fields of its GenerateRequest that a text-only server fills): the
    token ids the same body sent to the completion route would prefill. vllm-router reads
    `token_ids` to route by the real prompt; without this route it tokenizes through /tokenize."""

    request_id: str
    token_ids: list[int] = Field(description="The prompt as the engine would see it (template applied).")
    model: str = Field(description="The served model name.")
    features: None = Field(default=None, description="Multimodal features: always null (text only).")


class RenderList(RootModel[list[RenderResponse]]):
    """/v1/completions/render: one RenderResponse per prompt, in order (a batch of prompts is a list)."""


class FlushCacheResponse(ResponseModel):
    """POST /flush_cache (SGLang's name; vLLM's is /reset_prefix_cache): the prefix cache was dropped.
    Running requests keep their KV blocks; later requests start with nothing cached."""

    flushed: bool = True
    message: str = "prefix cache dropped; running requests keep their blocks"
