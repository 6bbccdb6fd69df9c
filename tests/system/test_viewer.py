"""The trace viewer at GET /, over HTTP and in a real browser.

One `onecall serve` subprocess (embedded model, --api-key set). Over plain HTTP: the page is served
without the key, as self-contained HTML with a CSP that allows no other origin, and the trace has
`prompt_tokens` (one text per prompt token id) and the divergence's two tokens as text. In headless
Chromium (Debian's, driven by playwright; its own browser download cannot work offline): type a
message, send, wait for the answer, then check the control tokens of the rendered prompt, the
decode steps of the timeline and an output token's probability on hover; a second message must
show more cached tokens than the first (the history is cached), the same count as the usage's;
a third, under the JSON grammar, must show the allowed-token count under the output tokens. The page may request nothing but this server.
The screenshot goes to tests/artifacts/viewer.png (and the test's tmp_path).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.server  # every test here takes the `onecall serve` subprocess

KEY = "sk-viewer-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parents[1] / "artifacts"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", KEY, "--max-model-len", "1024", num_threads=2)
    try:
        yield proc.start()
    finally:
        proc.stop()


def chat(server: ServerProcess, content: str, **kw: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "trace": True, **kw}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


# ---- over HTTP ------------------------------------------------------------------------------------------
def test_page_is_open_self_contained_html(server: ServerProcess) -> None:
    r = httpx.get(server.url("/"), timeout=10)  # no API key: the page itself is open
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    html = r.text
    assert html.startswith("<!doctype html>") and 'data-testid="message-input"' in html
    # offline: no script, style, image or font from anywhere else
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "an external asset"
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", html)
    # the API itself still wants the key
    assert httpx.get(server.url("/v1/models"), timeout=10).status_code == 401


def test_trace_has_prompt_token_texts(server: ServerProcess) -> None:
    t = chat(server, "What is the capital of France?", max_tokens=2)["trace"]
    assert len(t["prompt_tokens"]) == len(t["prompt_token_ids"]) > 0
    assert "".join(t["prompt_tokens"]) == t["prompt_text"]  # ASCII prompt: every token is whole characters
    assert t["prompt_tokens"][0] == "<|im_start|>" and t["prompt_is_control"][0]
    # same prefix, different country: the cached path diverges at the country's token
    t = chat(server, "What is the capital of Spain?", max_tokens=1)["trace"]
    d = t["divergence"]
    assert d is not None and t["num_cached_tokens"] == d["index"] > 0, t
    assert (d["prompt_token_text"], d["cached_token_text"]) == (" Spain", " France")
    assert t["prompt_tokens"][d["index"]] == " Spain"


# ---- in the browser -----------------------------------------------------------------------------------
@pytest.mark.browser
def test_viewer_in_chromium(server: ServerProcess, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make test`, which installs Debian's chromium")
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1200})
            errors: list[str] = []
            urls: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda req: urls.append(req.url))
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(server.url("/"))
            # 1. the key (the page loads without it; its API calls need it)
            expect(page.get_by_test_id("model")).to_have_text("API key needed")
            page.get_by_test_id("api-key").fill(KEY)
            page.get_by_test_id("api-key").press("Tab")  # change: stored, models fetched again
            expect(page.get_by_test_id("model")).to_contain_text("SmolLM2")
            page.get_by_test_id("temperature").fill("0")
            page.get_by_test_id("max-tokens").fill("40")
            # 2. first message: the answer, the prompt's control tokens, the timeline, a probability
            send(page, "What is the capital of France?", 0)
            answer = page.get_by_test_id("answer").nth(0).text_content() or ""
            assert answer.strip(), "empty answer"
            control = page.locator('[data-testid="prompt-token"][data-control="1"]').all_text_contents()
            assert "<|im_start|>" in control, control
            first_cached = int(page.get_by_test_id("cached-count").locator("b").inner_text())
            assert page.get_by_test_id("timeline-decode").count() > 0
            assert page.get_by_test_id("timeline-prefill").count() >= 1
            hover_shows_probability(page)
            # 3. second message: the history comes from the prefix cache
            send(page, "And what is the capital of Germany?", 1)
            cached = page.get_by_test_id("cached-count")
            num_cached = int(cached.locator("b").inner_text())
            assert num_cached > first_cached  # the first answer is in the cache too, not just the prompt
            assert cached.get_attribute("data-usage-cached") == str(num_cached)
            assert page.locator('[data-testid="prompt-token"][data-cached="1"]').count() == num_cached
            hover_shows_probability(page)
            # the screenshot shows the least certain token's alternatives
            probs = [
                float(p)
                for p in page.locator("[data-prob]").evaluate_all("es => es.map(e => e.dataset.prob)")
            ]
            page.get_by_test_id("output-token").nth(probs.index(min(probs))).hover()
            ARTIFACTS.mkdir(exist_ok=True)
            for path in (ARTIFACTS / "viewer.png", tmp_path / "viewer.png"):
                page.screenshot(path=str(path), full_page=True)
            # 4. a grammar: each output token shows how many tokens it allowed
            expect(page.get_by_test_id("grammar-note")).to_have_count(0)
            page.get_by_test_id("format").select_option("json_object")
            send(page, "Give the capital of Italy as JSON.", 2)
            expect(page.get_by_test_id("grammar-note")).to_be_visible()
            allowed = page.get_by_test_id("allowed-count").all_text_contents()
            assert allowed and all(re.fullmatch(r"\d+k?|·", a) for a in allowed), allowed
            assert any(a != "·" for a in allowed)
            page.screenshot(path=str(ARTIFACTS / "viewer-grammar.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    foreign = [u for u in urls if not (u.startswith(server.base_url) or u.startswith("data:"))]
    assert not foreign, f"the page reached beyond its server: {foreign}"


@pytest.mark.browser
def test_a_hybrid_models_shortened_hit_is_explained(server: ServerProcess) -> None:
    """A hybrid model's trace (num_kv_matched_tokens > num_cached_tokens: no state snapshot between the
    two) gets a callout with both numbers; an ordinary model's trace (None) gets none. The prompt card
    is rendered in the page from a trace like the server's."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make test`, which installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    trace = {
        "prompt_token_ids": list(range(10)), "prompt_tokens": [f"t{i}" for i in range(10)],
        "prompt_is_control": [False] * 10, "num_prompt_tokens": 10, "num_cached_tokens": 4,
        "divergence": None, "cache_match_capped": False, "num_kv_matched_tokens": 9, "state_resumed_at": 4,
    }  # fmt: skip
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(server.url("/"))
            shown = page.evaluate(
                """t => { const card = renderPrompt(t); document.body.append(card);
                          const n = card.querySelector('[data-testid="state-snapshot"]');
                          return n ? n.textContent : null; }""",
                trace,
            )
            assert shown is not None and "K/V for 9 tokens" in shown and "after token 4" in shown
            assert "the 5 tokens after it are prefilled again" in shown
            plain = page.evaluate(
                """t => renderPrompt(t).querySelector('[data-testid="state-snapshot"]') === null""",
                {**trace, "num_kv_matched_tokens": None, "state_resumed_at": None},
            )
            assert plain
        finally:
            browser.close()


def send(page: Any, message: str, index: int) -> None:
    """Type and send a message, then wait until answer `index` is done and its anatomy is drawn."""
    from playwright.sync_api import expect

    page.get_by_test_id("message-input").fill(message)
    page.get_by_test_id("send").click()
    bubble = page.get_by_test_id("assistant-message").nth(index)
    expect(bubble).to_have_attribute("data-done", "1", timeout=TIMEOUT_MS)
    assert "failed" not in (bubble.get_attribute("class") or ""), bubble.text_content()
    expect(page.get_by_test_id("anatomy")).to_have_attribute("data-call", str(index))


def hover_shows_probability(page: Any) -> None:
    token = page.get_by_test_id("output-token").first
    prob = float(token.get_attribute("data-prob"))
    assert 0.0 < prob <= 1.0
    token.hover()
    tip = page.get_by_test_id("tooltip")
    text = tip.inner_text()
    assert tip.is_visible() and re.search(r"p = \d+(\.\d+)?%", text), text
