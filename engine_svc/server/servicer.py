"""engine.v1.EngineCoreService: each method converts, delegates to the engine client, and
converts back; shared.grpc_errors maps every exception to its status code."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TypeAlias

import grpc

from engine_svc.client.async_client import AsyncMPClient
from engine_svc.server import convert
from engine_svc.server.generate_many import GenerateManyCall
from engine_svc.server.tokenizer_files import read_chunks, tokenizer_files
from shared.grpc_errors import DEFAULT_STREAM_WRITE_TIMEOUT_S, stream_errors, unary_errors
from shared.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from shared.protos import GENERATE_MANY_MAX_MESSAGE_BYTES, GENERATE_MANY_READY, engine_pb2_grpc
from shared.protos import engine_pb2 as pb

Context: TypeAlias = grpc.aio.ServicerContext


class EngineCoreServicer(engine_pb2_grpc.EngineCoreServiceServicer):
    stream_write_timeout_s = DEFAULT_STREAM_WRITE_TIMEOUT_S  # a client reading nothing: dropped

    def __init__(
        self,
        client: AsyncMPClient,
        model_dir: Path,
        model_name: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.client = client
        self.model_dir = model_dir
        self.model_name = model_name
        self.max_message_bytes = max_message_bytes  # what the server takes, and sends
        self.shared_calls: set[GenerateManyCall] = set()
        self.ending_shared_calls = False

    def end_shared_calls(self) -> None:
        """Each GenerateMany call, and any opened from now on, ends with UNAVAILABLE once
        its requests have (the engine is going away)."""
        self.ending_shared_calls = True
        for call in self.shared_calls:
            call.close()

    @stream_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        # If the call is cancelled, closing client.generate() aborts the engine request.
        outputs = self.client.generate(convert.to_engine_request(request))
        async with contextlib.aclosing(outputs):
            with convert.proto_field_names():
                async for output in outputs:
                    yield convert.to_generate_response(output)

    @stream_errors
    async def GenerateMany(
        self, requests: AsyncIterator[pb.GenerateManyRequest], context: Context
    ) -> AsyncGenerator[pb.GenerateManyResponse, None]:
        # If the call is cancelled, closing responses() aborts the requests still running.
        # At once, before any request: the client waits for it before its first write.
        limit = (GENERATE_MANY_MAX_MESSAGE_BYTES, str(self.max_message_bytes))
        await context.send_initial_metadata((GENERATE_MANY_READY, limit))
        call = GenerateManyCall(self.client)
        self.shared_calls.add(call)
        if self.ending_shared_calls:
            call.close()
        try:
            async with contextlib.aclosing(call.responses(requests)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.shared_calls.discard(call)

    @unary_errors
    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        await self.client.abort_requests_async(convert.to_abort_ids(request))
        return pb.AbortResponse()

    @unary_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        self.client.check_accepting()
        return convert.to_model_info(self.model_name, self.client.ready_engine_infos)

    @unary_errors
    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        return convert.to_loads_response(await self.client.get_loads_async())

    @stream_errors
    async def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: Context
    ) -> AsyncGenerator[pb.GetTokenizerResponse, None]:
        self.client.check_accepting()
        for path in tokenizer_files(self.model_dir):
            size = path.stat().st_size
            for chunk in read_chunks(path):
                yield pb.GetTokenizerResponse(file_name=path.name, data=chunk, file_size=size)

    @unary_errors
    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: Context
    ) -> pb.PauseGenerationResponse:
        await self.client.pause_async()
        return pb.PauseGenerationResponse()

    @unary_errors
    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: Context
    ) -> pb.ResumeGenerationResponse:
        max_steps = convert.to_max_steps(request)
        if max_steps is None:
            await self.client.resume_async()
            return pb.ResumeGenerationResponse()
        steps = await self.client.resume_for_steps_async(max_steps)
        return pb.ResumeGenerationResponse(steps_run=steps)

    @unary_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: Context
    ) -> pb.ResetPrefixCacheResponse:
        return pb.ResetPrefixCacheResponse(success=await self.client.reset_prefix_cache_async())
