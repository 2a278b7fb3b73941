"""vllm.grpc.engine.VllmEngine over the engine client: each method converts, delegates and
converts back; shared.grpc_errors maps every exception to its status code. Embed, profiling
and KV-event subscriptions answer UNIMPLEMENTED saying why (a generative, text-only engine),
as a status of ours: the generated base class raised NotImplementedError, which gRPC logged
as an error with its traceback at every call (smg subscribes to KV events as it connects)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import NoReturn, TypeAlias

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine_svc.client.async_client import AsyncMPClient
from engine_svc.server.convert import proto_field_names
from engine_svc.server.vllm_compat import convert
from engine_svc.server.vllm_compat.parallel_sampling import child_requests, merged_outputs
from engine_svc.server.vllm_compat.responses import GenerateResponses
from engine_svc.server.vllm_compat.tokenizer_bundle import archive_chunks, build_archive
from shared.errors import EngineDeadError, EngineUnavailableError
from shared.grpc_errors import DEFAULT_STREAM_WRITE_TIMEOUT_S, stream_errors, unary_errors

Context: TypeAlias = grpc.aio.ServicerContext
# Engine fields vLLM's contract names its own way, for INVALID_ARGUMENT's field.
VLLM_FIELDS = {"prompt_token_ids": "tokenized.input_ids"}
FLUSH_RETRY_S = 0.05  # FlushCache with a timeout: how often to retry while blocks are in use


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    stream_write_timeout_s = DEFAULT_STREAM_WRITE_TIMEOUT_S  # a client reading nothing: dropped

    def __init__(self, client: AsyncMPClient, model_dir: Path, model_name: str) -> None:
        self.client = client
        self.model_dir = model_dir
        self.model_name = model_name
        self.model = convert.ModelMetadata.read(model_dir)
        self.started_at = time.time()
        self.last_request_at = 0.0
        # The engine request ids of each request in flight with n > 1.
        self.children: dict[str, list[str]] = {}

    @stream_errors
    async def Generate(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncGenerator[vpb.GenerateResponse, None]:
        engine_request = convert.to_engine_request(request)
        children = child_requests(engine_request, request.sampling_params.n or 1)
        self.last_request_at = time.time()
        prompt = engine_request.prompt_token_ids
        sequences = [GenerateResponses(prompt, request.stream, i) for i in range(len(children))]
        if len(children) > 1:  # Abort names the request; its children are what the engine runs
            self.children[engine_request.request_id] = [c.request_id for c in children]
        # If the call is cancelled (the gateway's client went away), closing the outputs
        # closes client.generate() of every child, which aborts its engine request.
        outputs = merged_outputs(self.client.generate, children)
        try:
            async with contextlib.aclosing(outputs):
                with proto_field_names(VLLM_FIELDS):
                    async for index, output in outputs:
                        for response in sequences[index].on_output(output):
                            yield response
        finally:
            self.children.pop(engine_request.request_id, None)

    @unary_errors
    async def Abort(self, request: vpb.AbortRequest, context: Context) -> vpb.AbortResponse:
        ids = convert.to_abort_ids(request)
        await self.client.abort_requests_async(
            [child for i in ids for child in self.children.get(i, [i])]
        )
        return vpb.AbortResponse()

    @unary_errors
    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: Context
    ) -> vpb.HealthCheckResponse:
        try:
            self.client.check_accepting()
        except (EngineDeadError, EngineUnavailableError) as error:
            return vpb.HealthCheckResponse(healthy=False, message=str(error))
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    @unary_errors
    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: Context
    ) -> vpb.GetModelInfoResponse:
        infos = self.client.ready_engine_infos
        return convert.to_model_info(self.model_dir, self.model_name, infos, self.model)

    @unary_errors
    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: Context
    ) -> vpb.GetServerInfoResponse:
        state = convert.ServerState(
            num_active_requests=sum(self.client.num_unfinished),
            started_at=self.started_at,
            last_request_at=self.last_request_at,
        )
        return convert.to_server_info(state, self.client.ready_engine_infos)

    @unary_errors
    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: Context
    ) -> vpb.GetLoadsResponse:
        loads = await self.client.get_loads_async()
        return convert.to_loads_response(request, loads, self.client.ready_engine_infos)

    @stream_errors
    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncGenerator[common_pb2.GetTokenizerChunk, None]:
        self.client.check_accepting()
        archive = await asyncio.to_thread(build_archive, self.model_dir)
        for data, digest in archive_chunks(archive):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def Embed(self, request: vpb.EmbedRequest, context: Context) -> vpb.EmbedResponse:
        await _unimplemented(context, "Embed: this engine generates text; it serves no embeddings")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await _unimplemented(context, "StartProfile: this engine has no profiler to start")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await _unimplemented(context, "StopProfile: this engine has no profiler to stop")

    async def SubscribeKvEvents(  # type: ignore[override]
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> None:
        """A server stream that ends at once (a coroutine: gRPC takes one as a stream)."""
        await _unimplemented(
            context, "SubscribeKvEvents: this engine publishes no KV-cache events; poll GetLoads"
        )

    @unary_errors
    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        """Retry until no request holds KV blocks, for up to timeout_s (0: one try)."""
        deadline = time.monotonic() + max(0.0, request.timeout_s)
        while not await self.client.reset_prefix_cache_async():
            if time.monotonic() >= deadline:
                message = "requests hold KV blocks; the prefix cache was kept"
                return common_pb2.FlushCacheResponse(success=False, message=message)
            await asyncio.sleep(FLUSH_RETRY_S)
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")


async def _unimplemented(context: Context, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
    raise AssertionError("not reached: abort raises")
