"""A request-streaming handler whose incoming messages pass through a check first. The server
interceptors that judge each message of a call (a bearer token re-checked, an undecodable
message refused) wrap its handler with this; the check raises (or aborts) to end the call."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

RequestCheck = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]


def checking_requests(handler: grpc.RpcMethodHandler, check: RequestCheck) -> grpc.RpcMethodHandler:
    """`handler` (request-streaming), reading its requests through `check`. An async
    generator stays one; any other behavior becomes a coroutine function that awaits what it
    returns (a coroutine, or the generated UNIMPLEMENTED stubs' plain functions)."""
    field = "stream_stream" if handler.response_streaming else "stream_unary"
    behavior = getattr(handler, field)
    if inspect.isasyncgenfunction(behavior):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behavior(check(requests, context), context):
                yield response

        return handler._replace(**{field: stream})

    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(check(requests, context), context)
        return await result if inspect.isawaitable(result) else result

    return handler._replace(**{field: call})
