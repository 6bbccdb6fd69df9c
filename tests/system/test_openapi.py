"""GET /openapi.json and GET /docs (server/openapi.py), in-process over the tiny engine.

The document is checked structurally as OpenAPI 3.1: its version and info, every route the app
serves under paths, every $ref resolving to a schema under components, the POST routes' request
bodies pointing at the real protocol models (messages, prompt, tokens, the `trace` extension
described and marked), responses referencing their models. /docs is HTML that loads
/openapi.json and nothing from another origin; in Chromium (marked server and browser) it lists
every route. Both are open even with --api-key.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from onecall.server.openapi import EXTENSIONS, ROUTES
from onecall.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tests.helpers.server_process import ServerProcess
from tests.helpers.tiny_engine import tiny_engine

KEY = "sk-openapi"


def _get(*paths: str) -> tuple[list[str], list[httpx.Response]]:
    """The app's own route paths, and GET of each path (no key sent; the server has one)."""
    app = create_app(AsyncEngine(tiny_engine()), ServerConfig(api_key=KEY))
    routes = [r.path for r in app.routes if isinstance(r, APIRoute)]

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                return [await client.get(p) for p in paths]

    return routes, asyncio.run(main())


def _body_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    prefix = "#/components/schemas/"
    assert ref.startswith(prefix)
    schema: dict[str, Any] = doc["components"]["schemas"][ref.removeprefix(prefix)]
    return schema


def test_openapi_document_is_structurally_openapi_3_and_covers_every_route() -> None:
    routes, (r,) = _get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    # 1. the top level
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "onecall" and doc["info"]["version"]
    assert set(doc) <= {"openapi", "info", "paths", "components", "servers", "security", "tags"}
    # 2. every served route is documented, with its method, and nothing else is
    want = {re.sub(r"\{(\w+):path\}", r"{\1}", p) for p in routes}
    assert set(doc["paths"]) == want == set(ROUTES)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert method in {"get", "post"} and "200" in op["responses"], (path, method)
            for code, resp in op["responses"].items():
                assert resp["description"] and resp["content"], (path, code)
    # 3. every $ref resolves
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs and refs <= set(doc["components"]["schemas"])
    # 4. the POST bodies are the real models, with the extension documented
    chat, completion = _body_schema(doc, "/v1/chat/completions"), _body_schema(doc, "/v1/completions")
    assert set(ChatCompletionRequest.model_fields) == set(chat["properties"])
    assert set(CompletionRequest.model_fields) == set(completion["properties"])
    assert "messages" in chat["required"] and "prompt" in completion["required"]
    for schema in (chat, completion):
        trace = schema["properties"]["trace"]
        assert trace["type"] == "boolean" and trace["x-onecall-extension"] is True and trace["description"]
        assert "x-onecall-extension" not in schema["properties"]["temperature"]
    assert "tokens" in _body_schema(doc, "/detokenize")["required"]
    # 5. responses and auth
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_every_extension_described_is_a_request_field() -> None:
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    fields |= set(ChatMessage.model_fields) | {"reasoning_content"}  # a message's extra field
    assert set(EXTENSIONS) <= fields


def test_docs_is_a_self_contained_page_over_openapi_json() -> None:
    _, (r,) = _get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert 'fetch("/openapi.json")' in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from another origin
    assert "default-src 'none'" in r.headers["content-security-policy"]


@pytest.mark.server
@pytest.mark.browser
def test_docs_renders_every_route_in_chromium() -> None:
    """The page's script runs under its CSP, fetches the document and lists the routes, offline."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.fail(f"{chromium} is missing: run `make test`, which installs Debian's chromium")
    from playwright.sync_api import expect, sync_playwright

    proc = ServerProcess("--api-key", KEY, "--max-model-len", "256").start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(chromium), headless=True, args=["--no-sandbox", "--disable-gpu"]
            )
            try:
                page = browser.new_page()
                errors: list[str] = []
                urls: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("request", lambda req: urls.append(req.url))
                page.goto(proc.url("/docs"))
                expect(page.locator("h2").first).to_be_visible(timeout=20_000)
                text = page.locator("#out").inner_text()
                for path, doc in ROUTES.items():
                    assert f"{doc.method.upper()} {path}" in text
                assert page.locator("td.ext code", has_text="trace").count() >= 2  # chat and completions
                assert not errors
                assert all(u.startswith(proc.url("")) for u in urls), urls  # nothing from elsewhere
            finally:
                browser.close()
    finally:
        assert proc.stop() == 0
