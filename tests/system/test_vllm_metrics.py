"""vLLM's metric names beside onecall's (server/metrics.py), and the Grafana dashboard that reads them.

In process over the tiny engine: chat completions (the second one a prefix-cache hit), a completion
and one aborted request, then a scrape of GET /metrics, parsed with prometheus_client's own parser:

1. every vllm: series the tools that read vLLM use is there, with vLLM's type, labels (model_name =
   the served name, engine = "0") and buckets, and holds exactly what its onecall_* twin holds
   (gauges, token counters, finished requests by reason, histograms' _count and _sum);
2. queue + prefill time add up to TTFT, request by request, so their sums agree;
3. deploy/grafana/onecall.json parses, takes its Prometheus datasource from a variable (no UID
   written in), and every metric name its queries use is in the scrape.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from onecall.sampling_params import SamplingParams
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from onecall.server.metrics import (
    VLLM_ITL_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    Metrics,
)
from tests.helpers.tiny_engine import tiny_engine

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "onecall.json"
LABELS = {"model_name": "tiny", "engine": "0"}
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]

# vllm: family -> (type, its onecall_* twin)
GAUGES = {
    "vllm:num_requests_running": "onecall_requests_running",
    "vllm:num_requests_waiting": "onecall_requests_waiting",
    "vllm:kv_cache_usage_perc": "onecall_kv_cache_usage",
}
COUNTERS = {
    "vllm:prompt_tokens": "onecall_prompt_tokens",
    "vllm:generation_tokens": "onecall_generation_tokens",
    "vllm:prefix_cache_queries": "onecall_prefix_cache_query_tokens",
    "vllm:prefix_cache_hits": "onecall_prefix_cache_hit_tokens",
    "vllm:num_preemptions": "onecall_preemptions",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("onecall_time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("onecall_inter_token_latency_seconds", VLLM_ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("onecall_e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("onecall_request_queue_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": (
        "onecall_request_prefill_time_seconds",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
}


@pytest.fixture(scope="module")
def scrape() -> dict[str, Any]:
    """The /metrics text after some traffic, and the responses' usage."""
    out: dict[str, Any] = {"usages": []}

    async def main() -> None:
        engine = AsyncEngine(tiny_engine(), metrics=Metrics())
        app = create_app(engine, ServerConfig(served_model_name="tiny"))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall", timeout=60) as http:
                for _ in range(2):
                    r = await http.post("/v1/chat/completions", json={
                        "messages": MESSAGES, "max_tokens": 4, "temperature": 0})  # fmt: skip
                    out["usages"].append(r.json()["usage"])
                r = await http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3})
                out["usages"].append(r.json()["usage"])
                # one request aborted after its first output (what a client that leaves causes)
                stream = await engine.add_request("aborted", "A long story", SamplingParams(max_tokens=50))
                async for _ in stream:
                    break
                await stream.abort()
                for _ in range(100):  # the abort's output reaches the metrics on the engine thread
                    out["text"] = (await http.get("/metrics")).text
                    if 'finished_reason="abort"' in out["text"] and _sample(
                        out["text"], "onecall_request_aborted_total"
                    ):
                        break
                    await asyncio.sleep(0.05)

    asyncio.run(main())
    return out


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(text: str, name: str, **labels: str) -> float:
    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return found[0] if found else 0.0


def test_vllm_series_hold_what_their_onecall_twins_hold(scrape: dict[str, Any]) -> None:
    text = scrape["text"]
    families = _families(text)
    for name, twin in GAUGES.items():
        assert families[name].type == "gauge", name
        (s,) = families[name].samples
        assert s.labels == LABELS and s.value == _sample(text, twin), name
    for name, twin in COUNTERS.items():
        assert families[name].type == "counter", name
        (s,) = [s for s in families[name].samples if s.name == f"{name}_total"]
        assert s.labels == LABELS and s.value == _sample(text, f"{twin}_total"), name
    usages = scrape["usages"]
    assert (
        _sample(text, "vllm:prefix_cache_hits_total")
        == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        > 0
    )
    assert _sample(text, "vllm:generation_tokens_total") >= sum(u["completion_tokens"] for u in usages) + 1
    # finished requests: vLLM's reasons, each shown; stop and length as onecall's, abort as its aborted
    success = families["vllm:request_success"]
    assert success.type == "counter"
    by_reason = {s.labels["finished_reason"]: s for s in success.samples if s.name.endswith("_total")}
    assert set(by_reason) == {"stop", "length", "abort", "error", "repetition"}
    for reason, s in by_reason.items():
        assert {k: v for k, v in s.labels.items() if k != "finished_reason"} == LABELS
        if reason in ("stop", "length"):
            assert s.value == _sample(text, "onecall_request_success_total", finish_reason=reason), reason
    assert by_reason["length"].value >= 3
    assert by_reason["abort"].value == _sample(text, "onecall_request_aborted_total") == 1
    assert by_reason["error"].value == by_reason["repetition"].value == 0
    for name, (twin, buckets) in HISTOGRAMS.items():
        assert families[name].type == "histogram", name
        samples = families[name].samples
        assert all(s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0" for s in samples)
        bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")], name  # vLLM's buckets
        for part in ("_count", "_sum"):
            assert _sample(text, name + part) == pytest.approx(_sample(text, twin + part), abs=1e-12), name
    assert _sample(text, "vllm:time_to_first_token_seconds_count") >= 4
    assert _sample(text, "vllm:e2e_request_latency_seconds_count") == 3  # the aborted one has none


def test_queue_and_prefill_add_up_to_ttft(scrape: dict[str, Any]) -> None:
    text = scrape["text"]
    count = _sample(text, "onecall_time_to_first_token_seconds_count")
    assert count == _sample(text, "onecall_request_queue_time_seconds_count")
    assert count == _sample(text, "onecall_request_prefill_time_seconds_count")
    parts = _sample(text, "onecall_request_queue_time_seconds_sum") + _sample(
        text, "onecall_request_prefill_time_seconds_sum"
    )
    assert parts == pytest.approx(_sample(text, "onecall_time_to_first_token_seconds_sum"), rel=1e-9)


def _strings(node: Any) -> list[tuple[str, str]]:
    """Every (key, string value) in a JSON tree."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in ([(k, v)] if isinstance(v, str) else _strings(v))]
    if isinstance(node, list):
        return [p for v in node for p in _strings(v)]
    return []


def test_the_grafana_dashboard_reads_only_series_that_exist(scrape: dict[str, Any]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    strings = _strings(dashboard)
    assert {v for k, v in strings if k == "uid"} == {"${datasource}"}  # no datasource UID written in
    queries = [v for k, v in strings if k in ("expr", "definition")]
    panels = dashboard["panels"]
    assert len(panels) >= 8 and all(
        p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in panels
    )
    exposed = {s.name for f in text_string_to_metric_families(scrape["text"]) for s in f.samples}
    used = {m for q in queries for m in re.findall(r"\b(?:onecall_\w+|vllm:\w+)", q)}
    assert used and used <= exposed, sorted(used - exposed)
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("hit rate", "queue + prefill", "throughput", "running and waiting", "kv cache"):
        assert topic in titles, topic
