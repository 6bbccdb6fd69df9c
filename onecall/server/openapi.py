"""The OpenAPI 3.1 document behind GET /openapi.json, and the offline page behind GET /docs.

The handlers read their bodies themselves (state.parse_body: size limit first, then strict
validation), so FastAPI cannot infer any schema from their signatures. This module states them:
ROUTES maps each route to the pydantic models it reads and writes, and `openapi_schema` builds
the document from those models' own JSON schemas, with every model under components/schemas and referenced by $ref.

onecall's fields beyond OpenAI's API are marked `x-onecall-extension: true` and described from
EXTENSIONS (protocol.py keeps its wire models free of prose; the descriptions live here, once).
A test checks that every extension named here exists on a request model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from onecall import __version__
from onecall.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from onecall.server.protocol_info import (
    FlushCacheResponse,
    LoadResponse,
    ModelInfoResponse,
    RenderList,
    RenderResponse,
    ServerInfoResponse,
)
from onecall.server.protocol_responses import ResponseObject, ResponsesRequest


@dataclass(frozen=True)
class RouteDoc:
    method: Literal["get", "post"]
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    media_type: str = "application/json"
    needs_key: bool = True


ROUTES: dict[str, RouteDoc] = {
    "/v1/chat/completions": RouteDoc(
        "post",
        "Chat completion (stream: text/event-stream of chat.completion.chunk objects)",
        ChatCompletionRequest,
        ChatCompletionResponse,
    ),
    "/v1/completions": RouteDoc(
        "post",
        "Text completion (stream: text/event-stream of the same object)",
        CompletionRequest,
        CompletionResponse,
    ),
    "/v1/responses": RouteDoc(
        "post",
        "Responses API on the chat pipeline (stateless: previous_response_id refused; stream: its events)",
        ResponsesRequest,
        ResponseObject,
    ),
    "/v1/models": RouteDoc("get", "The served model", response=ModelList),
    "/v1/models/{model}": RouteDoc("get", "One model by name", response=ModelCard),
    "/tokenize": RouteDoc("post", "Prompt or chat messages to token ids", TokenizeRequest, TokenizeResponse),
    "/detokenize": RouteDoc("post", "Token ids to text", DetokenizeRequest, DetokenizeResponse),
    "/tokenizer_info": RouteDoc(
        "get", "The tokenizer's bos/eos, chat template and window (vLLM's)", response=TokenizerInfoResponse
    ),
    "/model_info": RouteDoc(
        "get", "Model identity and limits (SGLang's get_model_info)", response=ModelInfoResponse
    ),
    "/get_model_info": RouteDoc("get", "Alias of /model_info", response=ModelInfoResponse),
    "/server_info": RouteDoc("get", "Settings and live engine state", response=ServerInfoResponse),
    "/get_server_info": RouteDoc("get", "Alias of /server_info", response=ServerInfoResponse),
    "/get_load": RouteDoc("get", "Requests in flight and KV tokens held", response=LoadResponse),
    "/v1/chat/completions/render": RouteDoc(
        "post",
        "The prompt's token ids for a chat body, nothing generated",
        ChatCompletionRequest,
        RenderResponse,
    ),
    "/v1/completions/render": RouteDoc(
        "post", "The prompts' token ids for a completion body, one per prompt", CompletionRequest, RenderList
    ),
    "/flush_cache": RouteDoc("post", "Drop the prefix cache", response=FlushCacheResponse),
    "/health": RouteDoc(
        "get", "200 when the engine runs; 503 loading or dead", response=HealthResponse, needs_key=False
    ),
    "/metrics": RouteDoc(
        "get", "Prometheus text (onecall_*; open with --open-metrics)", media_type="text/plain"
    ),
    "/": RouteDoc("get", "The trace viewer (HTML)", media_type="text/html", needs_key=False),
    "/openapi.json": RouteDoc("get", "This document", needs_key=False),
    "/docs": RouteDoc(
        "get", "A page listing these routes (offline)", media_type="text/html", needs_key=False
    ),
}

# Request fields that OpenAI's API does not have, with what they do.
EXTENSIONS: dict[str, str] = {
    "top_k": "Sample among the k likeliest tokens (None or 0: all).",
    "min_p": "Drop tokens whose probability is below min_p times the top token's.",
    "repetition_penalty": "Divide positive logits (multiply negative ones) of tokens already seen.",
    "ignore_eos": "Keep generating past the end-of-sequence token, up to max_tokens.",
    "min_tokens": "Suppress stop conditions until this many tokens are generated.",
    "stop_token_ids": "Token ids that end generation, besides the model's EOS.",
    "skip_special_tokens": "Leave control tokens out of the returned text.",
    "trace": "Return the engine's per-request trace (`trace` on the response; a list for n > 1; on the "
    "last chunk when streaming): prompt ids, cached prefix, queue/prefill/decode timeline, per-step batches.",
    "trace_level": '"basic" or "full": full adds each output token\'s logit provenance and implies trace.',
    "cache_salt": "Requests share prefix-cache entries only with requests of the same salt (on a server "
    "with several keys, of the same tenant too, unless it shares its cache).",
    "structured_outputs": "Exactly one of json, regex, choice, grammar: constrains the output.",
    "chat_template_kwargs": "Extra variables for the model's chat template (e.g. enable_thinking).",
    "add_generation_prompt": "End the rendered prompt with the assistant turn's opening.",
    "reasoning_content": "A thinking template's <think> block, apart from the answer.",
}

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def openapi_schema() -> dict[str, Any]:
    """The whole document (a fresh dict each call; the app caches it)."""
    # 1. every model's schema. Responses too in validation mode: their serializer (omit_if_none) is a
    # wrap function whose schema pydantic cannot see through; their fields are the same, and a field
    # with a default is exactly one that may be left out.
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorResponse, "validation")]
    for doc in ROUTES.values():
        for model in (doc.request, doc.response):
            if model is not None:
                models.append((model, "validation"))
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = defs.get("$defs", {})
    _mark_extensions(schemas)

    # 2. the paths, each body pointing at its model
    paths: dict[str, Any] = {}
    for path, doc in ROUTES.items():
        op: dict[str, Any] = {"summary": doc.summary, "responses": {}}
        if doc.request is not None:
            body = refs[(doc.request, "validation")]
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        schema: dict[str, Any] = {"type": "object" if doc.media_type == "application/json" else "string"}
        if doc.response is not None:
            schema = refs[(doc.response, "validation")]
        op["responses"]["200"] = {"description": "OK", "content": {doc.media_type: {"schema": schema}}}
        op["responses"]["default"] = {
            "description": "An OpenAI-shaped error",
            "content": {"application/json": {"schema": _ERROR_REF}},
        }
        if doc.needs_key:
            op["security"] = [{"bearer": []}]
        if "{model}" in path:
            op["parameters"] = [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        paths[path] = {doc.method: op}

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "onecall",
            "version": __version__,
            "description": "OpenAI-compatible API; fields marked x-onecall-extension are onecall's own.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            # enforced only when the server runs with --api-key or --api-keys-file
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _mark_extensions(schemas: dict[str, Any]) -> None:
    for schema in schemas.values():
        for name, prop in schema.get("properties", {}).items():
            if name in EXTENSIONS:
                prop["description"] = EXTENSIONS[name]
                prop["x-onecall-extension"] = True


# /docs: a page with no script from anywhere else; it fetches /openapi.json from this server and
# lists each route with its request body's fields (extensions marked). Works air-gapped.
DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>onecall API</title>
<style>body{font:14px system-ui,sans-serif;max-width:60em;margin:2em auto}code{background:#eee}
.ext{color:#a40}h2{font-size:1.1em;margin-top:1.5em}td{vertical-align:top;padding:2px 8px}</style>
</head><body><h1>onecall API</h1>
<p>Machine-readable: <a href="/openapi.json">/openapi.json</a> (OpenAPI 3.1).
Fields in <span class="ext">orange</span> are onecall extensions.</p><div id="out">loading...</div>
<script>
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
fetch("/openapi.json").then(r => r.json()).then(doc => {
  const schemas = doc.components.schemas, out = [];
  const name = ref => ref && ref.$ref ? ref.$ref.split("/").pop() : null;
  for (const [path, ops] of Object.entries(doc.paths)) for (const [method, op] of Object.entries(ops)) {
    out.push(`<h2><code>${method.toUpperCase()} ${esc(path)}</code> ${esc(op.summary || "")}` +
             (op.security ? " (API key)" : "") + "</h2>");
    const body = op.requestBody && name(op.requestBody.content["application/json"].schema);
    if (body) {
      out.push(`<p>body: <b>${esc(body)}</b></p><table>`);
      for (const [f, p] of Object.entries(schemas[body].properties || {}))
        out.push(`<tr><td class="${p["x-onecall-extension"] ? "ext" : ""}"><code>${esc(f)}</code></td>` +
                 `<td>${esc(p.description || "")}</td></tr>`);
      out.push("</table>");
    }
  }
  document.getElementById("out").innerHTML = out.join("");
}).catch(e => { document.getElementById("out").textContent = "could not load /openapi.json: " + e; });
</script></body></html>
"""
