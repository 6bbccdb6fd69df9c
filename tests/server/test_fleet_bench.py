"""benchmarks/bench_fleet.py's arithmetic, without the router (not a test dependency) or any process:
the nearest-rank percentiles, the fleet hit rate over successful requests only, the 404s read from
uvicorn's access log, and the Prometheus sums the request split comes from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fleet.py"
    spec = importlib.util.spec_from_file_location("bench_fleet", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fleet"] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert bench.percentile(values, 0.5) == 50.0 and bench.percentile(values, 0.99) == 99.0
    assert bench.percentile([7.0], 0.99) == 7.0 and bench.percentile([], 0.5) is None


def test_summary_counts_only_successful_requests_in_the_hit_rate() -> None:
    Record = bench.Record
    records = [
        Record(start=0.0, end=1.0, ttft=0.2, prompt_tokens=100, cached_tokens=0, completion_tokens=8),
        Record(start=1.0, end=2.0, ttft=0.1, prompt_tokens=150, cached_tokens=120, completion_tokens=8),
        Record(start=2.0, end=2.5, error="APIConnectionError: Connection error."),
    ]
    s = bench.summarize("x", records, 4.0, {"8001": 2})
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["hit_rate"] == round(120 / 250, 4) and s["prompt_tokens"] == 250
    assert s["ttft_p50_ms"] == 100.0 and s["ttft_p99_ms"] == 200.0
    assert s["requests_per_s"] == 0.5 and s["output_tokens_per_s"] == 4.0
    assert s["requests_per_replica"] == {"8001": 2} and s["errors"] == [
        "APIConnectionError: Connection error."
    ]


def test_404s_are_read_from_the_access_log_by_path() -> None:
    log = "\n".join(
        [
            'INFO:     127.0.0.1:5 - "POST /v1/chat/completions/render HTTP/1.1" 404 Not Found',
            'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
            'INFO:     127.0.0.1:6 - "POST /flush_cache?x=1 HTTP/1.1" 404 Not Found',
            'INFO:     127.0.0.1:6 - "POST /v1/chat/completions/render HTTP/1.1" 404 Not Found',
        ]
    )
    assert bench.ACCESS_LOG.findall(log) == [
        "/v1/chat/completions/render",
        "/flush_cache",
        "/v1/chat/completions/render",
    ]


def test_metric_sum_adds_every_label_set_of_one_name_only() -> None:
    text = "\n".join(
        [
            "# HELP onecall_request_success_total Requests finished.",
            'onecall_request_success_total{finished_reason="stop"} 3.0',
            'onecall_request_success_total{finished_reason="length"} 4.0',
            "onecall_request_success_total_created 1.7e9",
        ]
    )
    assert bench.metric_sum(text, "onecall_request_success_total") == 7.0
