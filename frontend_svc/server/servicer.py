"""frontend.v1.GenerationService: each method converts, delegates to the Frontend, and
converts back; shared.grpc_errors maps every exception to its status code."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TypeAlias

import grpc

from frontend_svc.server import convert
from frontend_svc.service import Frontend
from shared.errors import MessageTooLargeError
from shared.frontend_protos import frontend_pb2 as pb
from shared.frontend_protos import frontend_pb2_grpc
from shared.grpc_errors import DEFAULT_STREAM_WRITE_TIMEOUT_S, stream_errors, unary_errors
from shared.grpc_server import DEFAULT_MAX_MESSAGE_BYTES

Context: TypeAlias = grpc.aio.ServicerContext


class GenerationServicer(frontend_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        frontend: Frontend,
        stream_write_timeout_s: float | None = DEFAULT_STREAM_WRITE_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.frontend = frontend
        self.stream_write_timeout_s = stream_write_timeout_s  # a client reading nothing: dropped
        self.max_message_bytes = max_message_bytes  # the server's send limit

    @unary_errors
    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        result = await self.frontend.generate(
            convert.to_generation_request(request), deadline_of(context)
        )
        return self._within_limit(
            convert.to_generate_response(result),
            "stream it with GenerateStream, or ask for fewer tokens, logprobs or choices",
        )

    @stream_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        # If the client cancels, closing the updates cancels the engine calls (aborts).
        updates = self.frontend.stream(convert.to_generation_request(request), deadline_of(context))
        async with contextlib.aclosing(updates):
            async for update in updates:
                yield self._within_limit(
                    convert.to_generate_response(update), "ask for fewer logprobs or choices"
                )

    def _within_limit(self, response: pb.GenerateResponse, hint: str) -> pb.GenerateResponse:
        """gRPC would refuse to send it anyway, with a bare status and a traceback in the
        log: this names the sizes and what to do instead (RESOURCE_EXHAUSTED)."""
        size = response.ByteSize()
        if size > self.max_message_bytes:
            raise MessageTooLargeError(
                f"a response of {size} bytes is over this server's message limit of "
                f"{self.max_message_bytes} bytes: {hint}"
            )
        return response

    @unary_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        token_ids = self.frontend.tokenize(
            request.text if request.HasField("text") else None,
            convert.to_chat_messages(request.messages),
            _flag(request, "add_special_tokens"),
            _flag(request, "add_generation_prompt"),
        )
        max_model_len = self.frontend.model_info().max_model_len
        return pb.TokenizeResponse(token_ids=token_ids, max_model_len=max_model_len)

    @unary_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        return convert.to_model_info_response(self.frontend.describe())


def deadline_of(context: Context) -> float | None:
    """The client's deadline on time.monotonic()'s clock, passed on to the engine calls."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _flag(request: pb.TokenizeRequest, name: str) -> bool:
    """Optional booleans whose default is true."""
    return bool(getattr(request, name)) if request.HasField(name) else True  # type: ignore[arg-type]
