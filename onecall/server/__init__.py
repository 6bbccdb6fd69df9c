"""The OpenAI-compatible HTTP server: `onecall serve`.

    protocol.py            the wire schema (pure pydantic: no torch, no FastAPI, no engine)
    params.py              wire request -> SamplingParams and prompts (the one conversion)
    app.py                 create_app(): the routes
    state.py               ServerConfig, ServerState: the engine's life (loading, ready, shut down)
    tenants.py             tenants (named API keys): auth, each tenant's prefix-cache namespace
    serving_chat.py        POST /v1/chat/completions
    serving_completion.py  POST /v1/completions
    serving_common.py      what both share: n choices, usage, logprobs
    serving_tokens.py      POST /tokenize, /detokenize
    serving_responses.py   POST /v1/responses on the chat pipeline
    serving_info.py        what routers call: /model_info, /server_info, /get_load, render, /flush_cache
    kv_events.py           the radix cache's block inserts and evictions as vLLM's KV events (ZMQ)
    openapi.py             /openapi.json and the offline /docs page
    sse.py                 server-sent events from the response models
    http_errors.py         typed errors -> OpenAI-style error bodies and statuses
    async_engine.py        AsyncEngine: one thread owns the Engine; asyncio talks to it through
                           commands and per-request streams, so a step never blocks the event loop
    engine_loop.py         that thread (EngineLoop): commands, steps, outputs to the streams, death
    engine_commands.py     the commands asyncio sends it (add, abort, reset the prefix cache, shut down)
    metrics.py             Metrics: the Prometheus registry behind GET /metrics (onecall_*)

Nothing is imported here, so importing one server module does not load the others.
"""
