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
from tests.frontend_svc.frontend_helpers import frontend_stub, greedy
from tests.service_processes import (
    NOT_SERVING,
    SERVING,
    FrontendProcess,
    ServiceProcess,
    run_async,
    wait_all_serving,
)

PROMPTS = [f"Request number {i} goes to some engine" for i in range(8)]
TOKENS_EACH = 300  # long enough that all of a test's requests are picked while in flight


class Cluster:
    def __init__(self, engines: list[ServiceProcess], frontend: FrontendProcess) -> None:
        self.engines = engines
        self.frontend = frontend


@pytest.fixture
def cluster(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own for each test: two of them kill engines, and none may depend
    on running before or after those (a start costs a few seconds)."""
    engines = [ServiceProcess(tiny_model_dir, tmp_path / f"engine-{i}.log") for i in range(2)]
    frontend = FrontendProcess(
        [e.address for e in engines], tmp_path / "frontend.log", "--tokenizer", str(tiny_model_dir)
    )
    wait_all_serving([*engines, frontend])
    yield Cluster(engines, frontend)
    for process in (frontend, *engines):
        process.stop()


def requests_served(engines: list[ServiceProcess], frontend: str, count: int) -> list[int]:
    """Sends `count` requests through the frontend at once, each generating exactly
    TOKENS_EACH tokens, and returns how many each engine served, from the engines' own
    token counts. (A load read while streaming is no measure here: the tiny model outruns
    the frontend, so an engine can be done with requests its client is still reading.)"""
    before = [engine.settled_generation_tokens() for engine in engines]
    run_async(lambda: generate_all(frontend, count))
    generated = [e.settled_generation_tokens() - b for e, b in zip(engines, before, strict=True)]
    assert all(tokens % TOKENS_EACH == 0 for tokens in generated), generated
    return [tokens // TOKENS_EACH for tokens in generated]


async def generate_all(frontend: str, count: int) -> None:
    async with grpc.aio.insecure_channel(frontend) as channel:
        stub = frontend_stub(channel)
        params = greedy(TOKENS_EACH, ignore_eos=True)
        requests = [pb.GenerateRequest(prompt=p, sampling_params=params) for p in PROMPTS[:count]]
        responses = await asyncio.gather(*(stub.Generate(r, timeout=60) for r in requests))
    assert [r.usage.completion_tokens for r in responses] == [TOKENS_EACH] * count


def generate_texts(frontend: str) -> list[str]:
    async def body() -> list[str]:
        async with grpc.aio.insecure_channel(frontend) as channel:
            stub = frontend_stub(channel)
            requests = [pb.GenerateRequest(prompt=p, sampling_params=greedy(12)) for p in PROMPTS]
            responses = await asyncio.gather(*(stub.Generate(r, timeout=60) for r in requests))
            return [r.choices[0].text for r in responses]

    return list(run_async(body))


def test_requests_spread_over_both_engines(cluster: Cluster) -> None:
    served = requests_served(cluster.engines, cluster.frontend.address, 6)
    assert sum(served) == 6
    assert min(served) >= 2, f"served {served}: one engine got (almost) everything"


def test_with_one_engine_killed_new_requests_go_to_the_other(cluster: Cluster) -> None:
    expected = generate_texts(cluster.frontend.address)
    killed, survivor = cluster.engines
    killed.stop()  # SIGKILL, engine processes included
    # At once: requests that still pick the dead engine are retried on the survivor.
    assert generate_texts(cluster.frontend.address) == expected
    assert requests_served([survivor], cluster.frontend.address, 4) == [4]
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
    assert cluster.frontend.wait_health(NOT_SERVING, timeout_s=10) == NOT_SERVING
    with grpc.insecure_channel(cluster.frontend.address) as channel:
        request = pb.GenerateRequest(prompt="anyone?", sampling_params=greedy(4))
        with pytest.raises(grpc.RpcError) as caught:
            frontend_stub(channel).Generate(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
