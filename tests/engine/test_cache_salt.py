"""cache_salt through the official openai client (chat completions, in process over the tiny engine):
a repeat under the same salt reads the cached prefix, the same prompt under another salt (or none)
reads nothing of it, and the trace names the salt only by a hash."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.tiny_engine import tiny_engine


@pytest.mark.slow
def test_requests_share_cached_prefixes_only_under_one_salt() -> None:
    async def main() -> None:
        app = create_app(AsyncEngine(tiny_engine()), ServerConfig(served_model_name="tiny"))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall/v1") as http:
                client = openai.AsyncOpenAI(base_url="http://onecall/v1", api_key="x", http_client=http)
                messages: Any = [{"role": "user", "content": "Tell me a long story about a cat and a dog."}]

                async def cached(salt: str | None) -> tuple[int, dict[str, Any]]:
                    extra: dict[str, Any] = {"trace": True} | ({"cache_salt": salt} if salt else {})
                    r = await client.chat.completions.create(
                        model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra
                    )
                    assert r.usage is not None and r.usage.prompt_tokens_details is not None
                    return r.usage.prompt_tokens_details.cached_tokens or 0, r.model_extra["trace"]  # type: ignore[index]

                first, trace = await cached("tenant-a")
                assert first == 0 and len(trace["sampling"]["cache_salt_sha256"]) == 12
                assert "tenant-a" not in str(trace)
                assert (await cached("tenant-a"))[0] > 0  # its own prefix
                assert (await cached("tenant-b"))[0] == 0  # not another tenant's
                assert (await cached(None))[0] == 0  # nor the unsalted cache's

    asyncio.run(asyncio.wait_for(main(), timeout=120))
