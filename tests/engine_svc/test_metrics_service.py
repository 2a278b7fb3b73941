"""The engine service's /metrics end to end (two data-parallel ranks, tiny model, chunked
prefill forced): every request and token is accounted for, per rank; promtool accepts the
exposition; and a real Prometheus scraping it every second answers a rate and a quantile."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import catalog
from tests.service_processes import (
    ServiceProcess,
    StreamResult,
    consume,
    engine_stub,
    generate_request,
    run_async,
    scrape_metrics,
    start_service,
)
from tests.shared.metrics_helpers import promtool_problems
from tests.shared.prometheus_server import PrometheusServer

MAX_TOKENS = 12
WAVE = 6  # requests at once


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log_path = tmp_path_factory.mktemp("metrics-service") / "service.log"
    # A 32-token step budget: longer prompts prefill in chunks, some steps sample nothing.
    extra = ("--data-parallel-size", "2", "--max-num-batched-tokens", "32")
    running = start_service(tiny_model_dir, log_path, *extra)
    yield running
    running.stop()


async def _load(address: str, num_waves: int, min_duration_s: float = 0.0) -> list[StreamResult]:
    """Waves of WAVE requests with distinct random prompts, `num_waves` of them, or more (up
    to 4x) until `min_duration_s` has passed."""
    rng = np.random.default_rng(11)
    results: list[StreamResult] = []
    start = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_stub(channel)
        for wave in range(4 * num_waves):
            if wave >= num_waves and time.monotonic() - start >= min_duration_s:
                break
            requests = [
                generate_request(
                    f"load-{wave}-{i}",
                    rng.integers(3, 49152, size=int(rng.integers(20, 70))).tolist(),
                    MAX_TOKENS,
                    ignore_eos=True,
                )
                for i in range(WAVE)
            ]
            results += await asyncio.gather(*(consume(stub, r, StreamResult()) for r in requests))
    return results


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _total(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str
) -> float:
    return sum(
        value
        for labels, value in samples[name]
        if all(labels.get(key) == wanted for key, wanted in match.items())
    )


def test_every_request_and_token_is_accounted_for(service: ServiceProcess) -> None:
    async def body() -> tuple[list[StreamResult], StreamResult]:
        results = await _load(service.address, num_waves=2)
        async with grpc.aio.insecure_channel(service.address) as channel:
            bad = generate_request("bad", [], MAX_TOKENS)  # INVALID_ARGUMENT: empty prompt
            return results, await consume(engine_stub(channel), bad, StreamResult())

    results, rejected = run_async(body)
    assert [r.code for r in results] == [None] * len(results)
    assert rejected.code == grpc.StatusCode.INVALID_ARGUMENT
    # A call is counted after its status went out: wait for the last ones' counts.
    service.metric_total_reaching("grpc_server_handled_total", 1, grpc_code="InvalidArgument")
    service.metric_total_reaching(
        "grpc_server_handled_total", len(results), grpc_method="Generate", grpc_code="OK"
    )
    text = scrape_metrics(service.metrics_url)
    samples = _samples(text)
    for spec in catalog.ALL_METRICS:
        assert samples[spec.series_names[0]], f"{spec.name} has no series"
    num_requests = len(results)
    num_tokens = sum(len(r.token_ids) for r in results)
    assert num_tokens == num_requests * MAX_TOKENS
    assert _total(samples, "vllm:generation_tokens_total") == num_tokens
    for engine in ("0", "1"):
        assert _total(samples, "vllm:generation_tokens_total", engine=engine) > 0
        assert _total(samples, "vllm:num_requests_running", engine=engine) == 0
        assert _total(samples, "vllm:kv_cache_usage_perc", engine=engine) == 0
    # Every prompt token the engines computed is counted, prefill chunks that sampled
    # nothing included: computed = queried - prefix-cache hits (no preemption here).
    assert _total(samples, "vllm:num_preemptions_total") == 0
    queried = _total(samples, "vllm:prefix_cache_queries_total")
    hits = _total(samples, "vllm:prefix_cache_hits_total")
    assert _total(samples, "vllm:prompt_tokens_total") == queried - hits > 0
    assert _total(samples, "vllm:request_success_total", finished_reason="length") == num_requests
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                 "request_prefill_time", "request_decode_time"):  # fmt: skip
        assert _total(samples, f"vllm:{name}_seconds_count") == num_requests, name
    itl_count = _total(samples, "vllm:inter_token_latency_seconds_count")
    assert itl_count == num_requests * (MAX_TOKENS - 1)
    generate = {"grpc_service": "engine.v1.EngineCoreService", "grpc_method": "Generate"}
    assert _total(samples, "grpc_server_handled_total", grpc_code="OK", **generate) >= num_requests
    assert _total(samples, "grpc_server_handled_total", grpc_code="InvalidArgument") == 1
    assert promtool_problems(text) == []


def test_the_service_process_reports_its_memory_cpu_and_collections(
    service: ServiceProcess,
) -> None:
    samples = _samples(scrape_metrics(service.metrics_url))
    assert _total(samples, "process_resident_memory_bytes") > 10e6
    assert _total(samples, "process_cpu_seconds_total") > 0
    assert 0 < time.time() - _total(samples, "process_start_time_seconds") < 3600
    assert {labels["generation"] for labels, _ in samples["python_gc_collections_total"]} == {
        "0",
        "1",
        "2",
    }
    assert samples["python_info"] and samples["process_open_fds"]


def test_prometheus_scrapes_the_service_and_answers_rate_and_quantile(
    service: ServiceProcess, tmp_path: Path
) -> None:
    prometheus = PrometheusServer(tmp_path, {"engine": f"127.0.0.1:{service.metrics_port}"})
    try:
        prometheus.wait_ready()
        prometheus.wait_for('up{job="engine"}', timeout_s=15)
        run_async(lambda: _load(service.address, num_waves=3, min_duration_s=5.0), 60)
        rate = prometheus.wait_for("sum(rate(vllm:generation_tokens_total[30s]))", 15)
        assert rate[0] > 0
        ttft_median = prometheus.wait_for(
            "histogram_quantile(0.5, sum by (le) "
            "(rate(vllm:time_to_first_token_seconds_bucket[30s])))",
            15,
        )
        assert 0 < ttft_median[0] < 60
        per_engine = prometheus.wait_for(
            "sum by (engine) (rate(vllm:iteration_tokens_total_count[30s]))", 15
        )
        assert len(per_engine) == 2
        prometheus.wait_for(
            'sum(rate(grpc_server_handled_total{grpc_method="Generate",grpc_code="OK"}[30s]))', 15
        )
    finally:
        prometheus.stop()
