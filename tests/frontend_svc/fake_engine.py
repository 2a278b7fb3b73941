"""A scripted engine.v1.EngineCoreService in the test's own event loop, so the frontend's
failure handling can be driven exactly: fail before or after the first token, hang, refuse
input, and record which requests the frontend cancelled (what makes a real engine abort).
It serves each request the same way on its own Generate call or on a shared GenerateMany
call; with `multiplexed=False` it has no GenerateMany (UNIMPLEMENTED, as an older engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.protos import GENERATE_MANY_MAX_MESSAGE_BYTES, GENERATE_MANY_READY, engine_pb2_grpc
from shared.protos import engine_pb2 as pb
from tests.service_processes import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeEngine(engine_pb2_grpc.EngineCoreServiceServicer):
    """`mode`: "ok" (emit `tokens` one per message), "fail_before", "fail_after" (one token,
    then UNAVAILABLE: on GenerateMany, the whole call), "fail_after_alone" (the same, but
    on GenerateMany only the request's own error entry), "hang" (never answer), "invalid",
    "error" (FINISH_REASON_ERROR at once: the engine failed that request alone, as an
    exception in admitting it does).
    With `hold_after`, an "ok" stream emits that many tokens, then holds until the frontend
    cancels it: a test that checks for the cancel never races the stream's own end, however
    slow the machine. "unimplemented_later" ends a GenerateMany call UNIMPLEMENTED at its
    first message (a proxy's answer mid-call)."""

    multiplexed = True  # the default for new fakes; tests run with both
    # A GenerateMany call that never says it serves GenerateMany, and stays open.
    marker = True
    # The largest message the server takes, said in GenerateMany's initial metadata.
    max_message_bytes: int | None = None

    def __init__(self, tokens: list[int], mode: str = "ok", hold_after: int | None = None) -> None:
        self.tokens = tokens
        self.mode = mode
        self.hold_after = hold_after
        self.calls: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.many_calls = 0  # GenerateMany calls opened
        self.message_sizes: list[int] = []  # of each GenerateMany message, in bytes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()

    async def start(self, serving: bool = True) -> FakeEngine:
        options: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]
        if self.max_message_bytes is not None:
            options.append(("grpc.max_receive_message_length", self.max_message_bytes))
        self.server = server = grpc.aio.server(options=options)
        target = server if self.multiplexed else _WithoutGenerateMany(server)
        engine_pb2_grpc.add_EngineCoreServiceServicer_to_server(self, target)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_insecure_port(self.address)
        await server.start()
        await self.set_serving(serving)
        return self

    async def set_serving(self, serving: bool) -> None:
        await self.health.set("", SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(grace=None)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for response in self._script(request):
                yield response
        except _Failure as failure:
            await context.abort(failure.code, failure.message)

    async def GenerateMany(
        self, requests: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Each request runs its script in a task of its own; a request's failure is its own
        error entry, except "fail_after", which ends the whole call (a dead engine)."""
        self.many_calls += 1
        if not self.marker:
            await _until_cancelled()
        metadata: list[tuple[str, str]] = [GENERATE_MANY_READY]
        if self.max_message_bytes is not None:
            metadata.append((GENERATE_MANY_MAX_MESSAGE_BYTES, str(self.max_message_bytes)))
        await context.send_initial_metadata(metadata)
        out: asyncio.Queue[pb.GenerateManyResponse | _Failure] = asyncio.Queue()
        running: dict[str, asyncio.Task[None]] = {}

        async def serve(request: pb.GenerateRequest) -> None:
            try:
                async for response in self._script(request):
                    out.put_nowait(pb.GenerateManyResponse(outputs=[response]))
            except _Failure as failure:
                if self.mode == "fail_after":
                    out.put_nowait(failure)
                    return
                error = pb.RequestError(
                    request_id=request.request_id,
                    code=failure.code.value[0],
                    message=failure.message,
                )
                out.put_nowait(pb.GenerateManyResponse(errors=[error]))

        async def read() -> None:
            async for message in requests:
                self.message_sizes.append(message.ByteSize())
                if self.mode == "unimplemented_later":
                    out.put_nowait(_Failure(grpc.StatusCode.UNIMPLEMENTED, "not here"))
                    return
                for request in message.requests:
                    running[request.request_id] = asyncio.create_task(serve(request))
                for request_id in message.abort_request_ids:
                    if request_id in running:
                        running[request_id].cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await out.get()
                if isinstance(item, _Failure):
                    await context.abort(item.code, item.message)
                yield item
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()
            await asyncio.gather(reader, *running.values(), return_exceptions=True)

    async def _script(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses; a request not run to its end is recorded as cancelled."""
        self.calls.append(request)
        finished = False
        try:
            async for response in self._responses(request):
                yield response
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request.request_id)

    async def _responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        if self.mode == "fail_before":
            raise _Failure(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        if self.mode == "invalid":
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p: bad")
        if self.mode == "hang":
            await _until_cancelled()
        if self.mode == "error":
            yield pb.GenerateResponse(
                request_id=request.request_id,
                finish_reason=pb.FINISH_REASON_ERROR,
                error="RuntimeError: a fault this request met",
            )
            return
        limit = request.sampling_params.max_tokens or len(self.tokens)
        for count, token in enumerate(self.tokens[:limit], start=1):
            last = count == limit
            reason = pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[token], finish_reason=reason
            )
            if self.mode in ("fail_after", "fail_after_alone"):
                raise _Failure(grpc.StatusCode.UNAVAILABLE, "engine core died")

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


class _WithoutGenerateMany:
    """Registers the service's methods but GenerateMany, which the server then answers
    with UNIMPLEMENTED as a server built before it existed would."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # rebuilt from the registered handlers below, without GenerateMany

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        kept = {name: h for name, h in handlers.items() if name != "GenerateMany"}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, kept),))
        self.server.add_registered_method_handlers(service, kept)


class _Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _until_cancelled() -> None:
    """Waits on a future nothing resolves: only cancelling the call ends the wait."""
    await asyncio.get_running_loop().create_future()
