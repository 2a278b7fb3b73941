"""A witness of engine steps, to tell whether a request that a client gave up on was really
aborted in the engine, in engine steps rather than seconds."""

from __future__ import annotations

import threading
import time

import grpc

from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.engine_svc.service_helpers import ServiceProcess


class EngineWitness:
    """A long request straight to the engine, counting its tokens on a thread. It gains one
    token per engine step, so its count is the engine's clock."""

    def __init__(self, engine: ServiceProcess) -> None:
        self.channel = grpc.insecure_channel(engine.address)
        self.stub = engine_pb2_grpc.EngineCoreServiceStub(self.channel)
        request = pb.GenerateRequest(
            request_id="witness",
            prompt_token_ids=[7, 8, 9],
            sampling_params=pb.SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
        )
        self.call = self.stub.Generate(request, timeout=60)
        self.steps = 0
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._count, daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the witness got no token"

    def _count(self) -> None:
        try:
            for response in self.call:
                self.steps += len(response.token_ids)
                self.started.set()
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def num_requests(self) -> int:
        loads = self.stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads
        return sum(load.num_running + load.num_waiting for load in loads)

    def steps_until_alone(self, timeout_s: float = 10.0) -> int:
        """The witness's step count once it is the engine's only request."""
        deadline = time.monotonic() + timeout_s
        while self.num_requests() != 1:
            assert time.monotonic() < deadline, f"other requests still ran after {timeout_s} s"
            time.sleep(0.01)
        return self.steps

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()
