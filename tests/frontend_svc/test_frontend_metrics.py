"""The frontend's /metrics with an engine behind it that leaves the client's view to it
(--no-request-metrics, as deployed): one series per client request (n choices together),
the phases only from the engine, nothing counted twice; promtool accepts the exposition; a
real Prometheus scraping both answers a rate from the engine and a quantile from the
frontend."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.frontend_protos import frontend_pb2 as pb
from tests.frontend_svc.frontend_helpers import frontend_stub, greedy
from tests.service_processes import (
    FrontendProcess,
    ServiceProcess,
    run_async,
    scrape_metrics,
    wait_all_serving,
)
from tests.shared.metrics_helpers import promtool_problems
from tests.shared.prometheus_server import PrometheusServer

MAX_TOKENS = 8


class Stack:
    def __init__(self, engine: ServiceProcess, frontend: FrontendProcess) -> None:
        self.engine = engine
        self.frontend = frontend


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("frontend-metrics")
    engine = ServiceProcess(tiny_model_dir, logs / "engine.log", "--no-request-metrics")
    frontend = FrontendProcess(
        [engine.address], logs / "frontend.log", "--tokenizer", str(tiny_model_dir)
    )
    wait_all_serving([engine, frontend])
    yield Stack(engine, frontend)
    for process in (frontend, engine):
        process.stop()


def _request(index: int, n: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=f"Request number {index} says",
        sampling_params=greedy(MAX_TOKENS, ignore_eos=True, n=n),
    )


async def _load(address: str, requests: list[pb.GenerateRequest]) -> list[pb.GenerateResponse]:
    """Streams every request at once; each stream's last response (with usage)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_stub(channel)

        async def last(request: pb.GenerateRequest) -> pb.GenerateResponse:
            return [r async for r in stub.GenerateStream(request, timeout=60)][-1]

        return list(await asyncio.gather(*(last(r) for r in requests)))


def _totals(url: str) -> dict[str, float]:
    """Each sample name's sum over its series."""
    text = scrape_metrics(url)
    totals: dict[str, float] = {"text": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    assert promtool_problems(text) == []
    return totals


def test_each_client_request_is_counted_once_by_the_frontend(stack: Stack) -> None:
    requests = [_request(i) for i in range(4)] + [_request(4, n=2)]
    streams = {"grpc_method": "GenerateStream", "grpc_code": "OK"}
    streams_before = stack.frontend.metric_total("grpc_server_handled_total", **streams)
    finals = run_async(lambda: _load(stack.frontend.address, requests))
    completion_tokens = sum(final.usage.completion_tokens for final in finals)
    assert completion_tokens == 6 * MAX_TOKENS
    # A call is counted after its status went out: wait for the last one's count.
    expected_streams = streams_before + len(requests)
    handled = stack.frontend.metric_total_reaching(
        "grpc_server_handled_total", expected_streams, **streams
    )
    assert handled == expected_streams
    frontend = _totals(stack.frontend.metrics_url)
    assert frontend["vllm:request_success_total"] == 5  # n=2 is one client request
    assert frontend["vllm:time_to_first_token_seconds_count"] == 5
    assert frontend["vllm:e2e_request_latency_seconds_count"] == 5
    assert frontend["vllm:request_generation_tokens_sum"] == completion_tokens
    exported = scrape_metrics(stack.frontend.metrics_url)
    for phase in ("queue", "prefill", "decode"):  # only engines see them: not even declared
        assert f"vllm:request_{phase}_time_seconds" not in exported
    engine = _totals(stack.engine.metrics_url)
    assert engine["vllm:request_queue_time_seconds_count"] == 6  # one per choice
    assert engine["vllm:request_decode_time_seconds_count"] == 6
    assert engine["vllm:generation_tokens_total"] == completion_tokens
    for name in ("time_to_first_token_seconds_count", "request_success_total"):
        assert f"vllm:{name}" not in engine, name  # the frontend's to count


def test_prometheus_scrapes_both_services(stack: Stack, tmp_path: Path) -> None:
    targets = {
        "engine": f"127.0.0.1:{stack.engine.metrics_port}",
        "frontend": f"127.0.0.1:{stack.frontend.metrics_port}",
    }
    prometheus = PrometheusServer(tmp_path, targets)
    try:
        prometheus.wait_ready()
        prometheus.wait_for("count(up == 1) >= 2", timeout_s=15)  # both targets scraped
        start = time.monotonic()
        for wave in range(20):  # at least 4 s of load, over several scrapes
            run_async(functools.partial(_load, stack.frontend.address, [_request(wave)] * 4), 60)
            if time.monotonic() - start > 4.0:
                break
        prometheus.wait_for('sum(rate(vllm:generation_tokens_total{job="engine"}[30s]))', 15)
        ttft = prometheus.wait_for(
            "histogram_quantile(0.5, sum by (le) "
            '(rate(vllm:time_to_first_token_seconds_bucket{job="frontend"}[30s])))',
            15,
        )
        assert 0 < ttft[0] < 60
        finished = prometheus.wait_for("sum by (job) (rate(vllm:request_success_total[30s]))", 15)
        assert len(finished) == 1  # the frontend's series only: dashboards count once
        # Each service's own process, under the names every Prometheus Python client uses.
        prometheus.wait_for("count(process_resident_memory_bytes > 1e7) >= 2", 15)
        prometheus.wait_for('count(python_gc_collections_total{generation="2"}) >= 2', 15)
    finally:
        prometheus.stop()
