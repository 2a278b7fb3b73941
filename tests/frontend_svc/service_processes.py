"""Frontend subprocesses beside engine subprocesses (tests.engine_svc.service_helpers), all on
free 127.0.0.1 ports and started in parallel; and a witness that tells whether the engine
really aborted a request the frontend gave up on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as pb
from tests.engine_svc.service_helpers import (
    REPO_ROOT,
    ServiceProcess,
    StreamResult,
    consume,
    engine_stub,
    free_port,
    generate_request,
)


class FrontendProcess(ServiceProcess):
    """`python -m frontend_svc` in a session of its own; health, waits and stop() as for the
    engine service."""

    def __init__(self, engines: list[str], log_path: Path, *extra_args: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "frontend_svc", "--engine", *engines, "--host", "127.0.0.1",
            "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--engine-poll-interval", "0.2", *extra_args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )


def wait_all_serving(processes: list[ServiceProcess]) -> None:
    """Started together, waited for together; on failure every process is stopped."""
    try:
        for process in processes:
            process.wait_serving()
    except BaseException:
        for process in processes:
            process.stop()
        raise


def frontend_stub(channel: grpc.aio.Channel) -> frontend_pb2_grpc.GenerationServiceStub:
    return frontend_pb2_grpc.GenerationServiceStub(channel)


def greedy(max_tokens: int, **fields: Any) -> fpb.SamplingParams:
    return fpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **fields)


async def stream_texts(
    stub: frontend_pb2_grpc.GenerationServiceStub, request: fpb.GenerateRequest
) -> tuple[list[str], list[int], list[fpb.GenerateResponse]]:
    """Choice 0's text deltas and token ids, and every response."""
    responses = [r async for r in stub.GenerateStream(request, timeout=60)]
    deltas = [c.text for r in responses for c in r.choices if c.index == 0]
    token_ids = [t for r in responses for c in r.choices if c.index == 0 for t in c.token_ids]
    return deltas, token_ids, responses


class EngineWitness:
    """A long request sent straight to the engine. It gains one token per engine step, so
    its token count is the engine's clock: a request the frontend stopped was aborted if
    the engine is left running the witness alone within far fewer steps than that request
    asked for."""

    def __init__(self, engine_address: str, name: str) -> None:
        self.engine_address = engine_address
        self.request = generate_request(f"witness-{name}", [7, 8, 9], 1000, ignore_eos=True)
        self.result = StreamResult()

    async def __aenter__(self) -> EngineWitness:
        self.channel = grpc.aio.insecure_channel(self.engine_address)
        self.stub = engine_stub(self.channel)
        self.task = asyncio.create_task(consume(self.stub, self.request, self.result))
        await asyncio.wait_for(self.result.first_message.wait(), 30)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()

    @property
    def steps(self) -> int:
        return len(self.result.token_ids)

    async def steps_until_alone(self, timeout_s: float = 60.0) -> int:
        """The witness's step count when it is the engine's only request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loads = (await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads
            if sum(load.num_running + load.num_waiting for load in loads) == 1:
                return self.steps
            if self.task.done():
                raise AssertionError("the witness finished: the engine never ran it alone")
            await asyncio.sleep(0.01)
        raise AssertionError(f"the engine still had other requests after {timeout_s} s")
