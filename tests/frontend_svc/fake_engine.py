"""A scripted engine.v1.EngineCoreService in the test's own event loop, so the frontend's
failure handling can be driven exactly: fail before or after the first token, hang, refuse
input, and record which calls the frontend cancelled (what makes a real engine abort)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.service_processes import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeEngine(engine_pb2_grpc.EngineCoreServiceServicer):
    """`mode`: "ok" (emit `tokens` one per message), "fail_before", "fail_after" (one token,
    then UNAVAILABLE), "hang" (never answer), "invalid". With `hold_after`, an "ok" stream
    emits that many tokens, then holds until the frontend cancels it: a test that checks for
    the cancel never races the stream's own end, however slow the machine."""

    def __init__(self, tokens: list[int], mode: str = "ok", hold_after: int | None = None) -> None:
        self.tokens = tokens
        self.mode = mode
        self.hold_after = hold_after
        self.calls: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer()

    async def start(self, serving: bool = True) -> FakeEngine:
        engine_pb2_grpc.add_EngineCoreServiceServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()
        await self.set_serving(serving)
        return self

    async def set_serving(self, serving: bool) -> None:
        await self.health.set("", SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        await self.server.stop(grace=None)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls.append(request)
        finished = False
        try:
            async for response in self._responses(request, context):
                yield response
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request.request_id)

    async def _responses(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.mode == "fail_before":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p: bad")
        if self.mode == "hang":
            await _until_cancelled()
        limit = request.sampling_params.max_tokens or len(self.tokens)
        for count, token in enumerate(self.tokens[:limit], start=1):
            last = count == limit
            reason = pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[token], finish_reason=reason
            )
            if self.mode == "fail_after":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "engine core died")
            if count == self.hold_after:
                await _until_cancelled()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model_name="fake", max_model_len=1024, vocab_size=49152, eos_token_ids=[2]
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        return pb.GetLoadsResponse(loads=[pb.RankLoad(rank=0)])


async def _until_cancelled() -> None:
    """Waits on a future nothing resolves: only cancelling the call ends the wait."""
    await asyncio.get_running_loop().create_future()
