"""Frontend subprocesses beside engine subprocesses (tests.engine_svc.service_helpers), all on
free 127.0.0.1 ports and started in parallel; and a witness that tells whether the engine
really aborted a request the frontend gave up on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from tests.engine_svc.service_helpers import (
    REPO_ROOT,
    ServiceProcess,
    free_port,
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
