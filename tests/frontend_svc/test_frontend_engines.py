"""One frontend over two engine subprocesses (tiny model): requests spread over both; when one
engine is killed, new requests go to the other without a client seeing an error; with none
left, the frontend reports NOT_SERVING and answers UNAVAILABLE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shared.frontend_protos import frontend_pb2 as pb
from shared.protos import engine_pb2
from tests.engine_svc.service_helpers import (
    NOT_SERVING,
    SERVING,
    ServiceProcess,
    engine_stub,
    run_async,
)
from tests.frontend_svc.service_processes import (
    FrontendProcess,
    frontend_stub,
    greedy,
    wait_all_serving,
)

PROMPTS = [f"Request number {i} goes to some engine" for i in range(8)]
STREAM_TOKENS = 1000  # near the tiny model's 1,024 positions: streams that last
MAX_READINGS = 3


class Cluster:
    def __init__(self, engines: list[ServiceProcess], frontend: FrontendProcess) -> None:
        self.engines = engines
        self.frontend = frontend


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("frontend-engines")
    engines = [ServiceProcess(tiny_model_dir, logs / f"engine-{i}.log") for i in range(2)]
    frontend = FrontendProcess(
        [e.address for e in engines], logs / "frontend.log", "--tokenizer", str(tiny_model_dir)
    )
    wait_all_serving([*engines, frontend])
    yield Cluster(engines, frontend)
    for process in (frontend, *engines):
        process.stop()


async def engine_load(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await engine_stub(channel).GetLoads(engine_pb2.GetLoadsRequest(), timeout=5)
    return sum(load.num_running + load.num_waiting for load in response.loads)


async def loads_while_streaming(frontend: str, engines: list[str], count: int) -> list[int]:
    """Starts `count` long streams, reads each stream's first message, and returns each
    engine's load at that point; then cancels the streams. On a loaded machine a stream can
    end before the loads are read (the tiny model is fast), which spoils the reading: it is
    then taken again, a bounded number of times."""
    for _ in range(MAX_READINGS):
        loads, all_streaming = await _read_loads_while_streaming(frontend, engines, count)
        if all_streaming:
            return loads
    raise AssertionError(f"in {MAX_READINGS} readings a stream always ended too soon")


async def _read_loads_while_streaming(
    frontend: str, engines: list[str], count: int
) -> tuple[list[int], bool]:
    async with grpc.aio.insecure_channel(frontend) as channel:
        stub = frontend_stub(channel)
        calls = [
            stub.GenerateStream(
                pb.GenerateRequest(
                    prompt=PROMPTS[i], sampling_params=greedy(STREAM_TOKENS, ignore_eos=True)
                )
            )
            for i in range(count)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*(call.read() for call in calls)), 60)
            loads = [await engine_load(address) for address in engines]
            return loads, not any(call.done() for call in calls)
        finally:
            for call in calls:
                call.cancel()


def generate_texts(frontend: str) -> list[str]:
    async def body() -> list[str]:
        async with grpc.aio.insecure_channel(frontend) as channel:
            stub = frontend_stub(channel)
            requests = [pb.GenerateRequest(prompt=p, sampling_params=greedy(12)) for p in PROMPTS]
            responses = await asyncio.gather(*(stub.Generate(r, timeout=60) for r in requests))
            return [r.choices[0].text for r in responses]

    return list(run_async(body))


def test_requests_spread_over_both_engines(cluster: Cluster) -> None:
    addresses = [e.address for e in cluster.engines]
    loads = run_async(lambda: loads_while_streaming(cluster.frontend.address, addresses, 6))
    assert sum(loads) == 6
    assert min(loads) >= 2, f"loads {loads}: one engine got (almost) everything"


def test_with_one_engine_killed_new_requests_go_to_the_other(cluster: Cluster) -> None:
    expected = generate_texts(cluster.frontend.address)
    killed, survivor = cluster.engines
    killed.stop()  # SIGKILL, engine processes included
    # At once: requests that still pick the dead engine are retried on the survivor.
    assert generate_texts(cluster.frontend.address) == expected
    loads = run_async(
        lambda: loads_while_streaming(cluster.frontend.address, [survivor.address], 4)
    )
    assert loads == [4]
    assert cluster.frontend.health() == SERVING
    deadline = time.monotonic() + 10
    with grpc.insecure_channel(cluster.frontend.address) as channel:
        while time.monotonic() < deadline:
            info = frontend_stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            if info.num_healthy_engines == 1:
                break
            time.sleep(0.1)
    assert (info.num_engines, info.num_healthy_engines) == (2, 1)


def test_with_no_engine_left_the_frontend_is_not_serving_and_unavailable(
    cluster: Cluster,
) -> None:
    for engine in cluster.engines:
        engine.stop()
    deadline = time.monotonic() + 10
    while cluster.frontend.health() == SERVING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.frontend.health() == NOT_SERVING
    with grpc.insecure_channel(cluster.frontend.address) as channel:
        request = pb.GenerateRequest(prompt="anyone?", sampling_params=greedy(4))
        with pytest.raises(grpc.RpcError) as caught:
            frontend_stub(channel).Generate(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
