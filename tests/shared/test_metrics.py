"""shared.metrics: vLLM's metric names and types, the per-request timer the frontend calls, the
gRPC server interceptor (go-grpc-prometheus's names and Go's code spellings), and the /metrics
endpoint; promtool accepts what they export."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from shared.metrics import catalog
from shared.metrics.grpc_server import GrpcServerMetrics, code_of
from shared.metrics.http_server import MetricsServer, start_metrics_server
from shared.metrics.requests import RequestMetrics
from tests.shared.metrics_helpers import promtool_problems

# vLLM's types (vllm/v1/metrics/loggers.py), written out independently of the catalog.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


def test_the_catalog_has_vllms_names_types_and_labels() -> None:
    vllm = {spec.name: spec for spec in catalog.ALL_METRICS if spec.name.startswith("vllm:")}
    assert {name: str(spec.kind) for name, spec in vllm.items()} == VLLM_TYPES
    assert all(spec.labels[:2] == ("model_name", "engine") for spec in vllm.values())
    assert catalog.REQUEST_SUCCESS.labels[2:] == ("finished_reason",)
    assert catalog.PROMPT_TOKENS.series_names == ("vllm:prompt_tokens_total",)
    assert catalog.TTFT_BUCKETS[0] == 0.001 and catalog.TTFT_BUCKETS[-1] == 2560.0
    assert catalog.REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert catalog.build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert catalog.build_1_2_5_buckets(0) == (1,)


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "e1", **labels})


def test_the_request_timer_records_what_its_caller_sees() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", max_model_len=2048)
    clock = FakeClock()
    timer = metrics.start_request("e1", num_prompt_tokens=30, clock=clock)
    clock.now += 0.25
    timer.on_tokens(1)
    clock.now += 0.5
    timer.on_tokens(3)  # merged deltas: one gap
    timer.on_tokens(0)  # a message without tokens: no gap
    clock.now += 0.25
    timer.finish("stop")
    timer.finish("abort")  # only the first finish counts
    assert _sample(registry, "vllm:time_to_first_token_seconds_sum") == 0.25
    assert _sample(registry, "vllm:inter_token_latency_seconds_count") == 1
    assert _sample(registry, "vllm:inter_token_latency_seconds_sum") == 0.5
    assert _sample(registry, "vllm:e2e_request_latency_seconds_sum") == 1.0
    assert _sample(registry, "vllm:request_generation_tokens_sum") == 4
    assert _sample(registry, "vllm:request_prompt_tokens_bucket", le="50.0") == 1
    assert _sample(registry, "vllm:request_success_total", finished_reason="stop") == 1
    assert _sample(registry, "vllm:request_success_total", finished_reason="abort") is None
    # Phases only the engine sees are not made up.
    assert _sample(registry, "vllm:request_queue_time_seconds_count") is None


def test_request_metrics_without_phases_do_not_declare_them() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", max_model_len=2048, phases=False)
    metrics.start_request("", num_prompt_tokens=3).finish("stop")
    names = {family.name for family in registry.collect()}
    assert "vllm:e2e_request_latency_seconds" in names
    assert not names & {"vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                        "vllm:request_decode_time_seconds"}  # fmt: skip
    with pytest.raises(ValueError, match="without the phases"):
        metrics.observe_phases("", 0.1, None, None)


# ---- the gRPC interceptor ------------------------------------------------------------------

SERVICE = "test.v1.ProbeService"


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"bad":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    if request == b"bug":
        raise RuntimeError("a bug")
    if request == b"quiet":
        context.set_code(grpc.StatusCode.NOT_FOUND)  # a status set without raising
    return request


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"one"
    if request == b"busy":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    yield b"two"


async def _calls(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary")
        stream = channel.unary_stream(f"/{SERVICE}/Stream")
        for payload in (b"ok", b"ok", b"bad", b"bug", b"quiet"):
            with (
                pytest.raises(grpc.aio.AioRpcError)
                if payload != b"ok"
                else contextlib.nullcontext()
            ):
                await unary(payload)
        assert [m async for m in stream(b"fine")] == [b"one", b"two"]
        with pytest.raises(grpc.aio.AioRpcError):
            _ = [m async for m in stream(b"busy")]
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        watch.cancel()


async def _serve_and_call(registry: CollectorRegistry) -> None:
    server = grpc.aio.server(interceptors=[GrpcServerMetrics(registry)])
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await asyncio.wait_for(_calls(f"127.0.0.1:{port}"), 30)
        for _ in range(100):  # the cancelled Watch is counted once its handler unwinds
            if registry.get_sample_value("grpc_server_handling_seconds_count", _WATCH):
                break
            await asyncio.sleep(0.05)
    finally:
        await server.stop(grace=None)


_WATCH = {"grpc_type": "server_stream", "grpc_service": "grpc.health.v1.Health",
          "grpc_method": "Watch"}  # fmt: skip


def _handled(registry: CollectorRegistry, method: str, code: str) -> float | None:
    grpc_type = "unary" if method == "Unary" else "server_stream"
    labels = {"grpc_type": grpc_type, "grpc_service": SERVICE, "grpc_method": method}
    return registry.get_sample_value("grpc_server_handled_total", {**labels, "grpc_code": code})


def test_the_interceptor_counts_calls_by_method_and_code_and_times_them() -> None:
    registry = CollectorRegistry()
    asyncio.run(_serve_and_call(registry))
    assert _handled(registry, "Unary", "OK") == 2
    assert _handled(registry, "Unary", "InvalidArgument") == 1
    assert _handled(registry, "Unary", "Unknown") == 1
    assert _handled(registry, "Unary", "NotFound") == 1
    assert _handled(registry, "Stream", "OK") == 1
    assert _handled(registry, "Stream", "ResourceExhausted") == 1
    labels = {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "Unary"}
    assert registry.get_sample_value("grpc_server_started_total", labels) == 5
    assert registry.get_sample_value("grpc_server_handling_seconds_count", labels) == 5
    watch_code = {**_WATCH, "grpc_code": "Canceled"}
    assert registry.get_sample_value("grpc_server_handled_total", watch_code) == 1
    assert promtool_problems(generate_latest(registry).decode()) == []


class EndedCall:
    """What code_of reads of a call that ended: the time its deadline had left (None: no
    deadline) and the status its servicer set (None: none)."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def code(self) -> grpc.StatusCode | None:
        return None


class ExecuteBatchError(Exception):
    """As gRPC's, raised by an abort of a call already over."""


@pytest.mark.parametrize(
    ("error", "remaining", "code"),
    [
        # gRPC cancelled the handler at the deadline, or the client's own deadline cancel
        # arrived a few ms before the server's timer.
        (asyncio.CancelledError(), 0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        (asyncio.CancelledError(), 0.007, grpc.StatusCode.DEADLINE_EXCEEDED),
        (GeneratorExit(), 0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        # A cancel well before the deadline, or with none, is the client's.
        (asyncio.CancelledError(), 0.15, grpc.StatusCode.CANCELLED),
        (asyncio.CancelledError(), None, grpc.StatusCode.CANCELLED),
        # The servicer saw the deadline at the same moment and its abort failed.
        (ExecuteBatchError(), 0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        # A failure before the deadline is the servicer's, however close to it.
        (ExecuteBatchError(), 0.01, grpc.StatusCode.UNKNOWN),
        (RuntimeError("a bug"), None, grpc.StatusCode.UNKNOWN),
    ],
)
def test_a_call_ended_by_its_deadline_counts_as_deadline_exceeded_and_no_other(
    error: BaseException, remaining: float | None, code: grpc.StatusCode
) -> None:
    assert code_of(error, EndedCall(remaining)) == code  # type: ignore[arg-type]


# ---- the endpoint --------------------------------------------------------------------------


OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _get(url: str, accept: str = "*/*") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, "", ""


def test_the_endpoint_serves_vllm_names_as_text_and_frees_its_port_on_close() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", max_model_len=1024)
    timer = metrics.start_request("e1", num_prompt_tokens=5)
    timer.on_tokens(2)
    timer.finish("length")
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        status, content_type, text = _get(server.url)
        # Prometheus asks for OpenMetrics first; the names must keep their colons anyway.
        _, _, negotiated = _get(server.url, OPENMETRICS_ACCEPT)
        not_found, _, _ = _get(server.url.replace("/metrics", "/other"))
    finally:
        server.close()
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    assert not_found == 404
    success = 'vllm:request_success_total{engine="e1",finished_reason="length",model_name="m"}'
    assert success in text and success in negotiated
    assert "vllm_" not in negotiated
    # The frontend's registry (request metrics): promtool finds only vLLM's own names.
    assert promtool_problems(text) == []
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the scrape's TIME_WAIT
        sock.bind(("127.0.0.1", server.port))  # nobody listens there any more


def test_a_busy_metrics_port_is_logged_and_the_service_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert start_metrics_server(CollectorRegistry(), "127.0.0.1", port) is None
    assert f"cannot serve them on 127.0.0.1:{port}" in caplog.text
