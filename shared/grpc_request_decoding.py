"""Undecodable requests answered with INVALID_ARGUMENT instead of UNKNOWN.

A client in any language can put bytes that are not UTF-8 (a lone surrogate, 0xFF) into a
proto3 `string` field, or send bytes that are no protobuf at all. Python's protobuf refuses to
parse such a message, and grpc.aio's server, whose deserializer raises before any servicer
runs, answers UNKNOWN ("Unexpected DecodeError") and logs a traceback: the client's mistake
reads as the server's. This interceptor gives each unary-request handler a deserializer that
returns a marker instead of raising, and a behavior that answers the marker with
INVALID_ARGUMENT naming the request type. It goes innermost (last), so the interceptors
outside it (metrics, bearer tokens) see and count an ordinary refused call.

A request-streaming handler (GenerateMany, reflection) reads its messages through a check
that ends the call the same way at the first undecodable one, instead of with INTERNAL.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shared.grpc_request_streams import checking_requests

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
Deserializer = Callable[[bytes], Any]


class UndecodableRequest:
    """What the deserializer hands on in place of a request it cannot parse."""

    def __init__(self, message: str) -> None:
        self.message = message


class RequestDecodeInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse with INVALID_ARGUMENT and a message such as
    "request is not a valid frontend.v1.GenerateRequest: a string field is not valid UTF-8"."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer, handler_call_details.method)
        if handler.request_streaming:
            checked = checking_requests(handler, _refusing_undecodable_messages)
            return checked._replace(request_deserializer=deserializer)
        field = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, field)
        wrapped = _refusing_undecodable(behavior)
        if wrapped is None:
            return handler  # a sync generator: not ours to wrap (no servicer here has one)
        return handler._replace(request_deserializer=deserializer, **{field: wrapped})


def undecodable_message(type_name: str, error: DecodeError) -> str:
    """The client's message: the request type, and what is wrong when protobuf says (its
    wording differs between its implementations; UTF-8 is the one a client can act on)."""
    if "UTF-8" in str(error):
        reason = "a string field is not valid UTF-8"
    else:
        reason = "the bytes do not parse as this message"
    return f"request is not a valid {type_name}: {reason}"


def _tolerant(deserializer: Deserializer, method: str) -> Deserializer:
    message_class = getattr(deserializer, "__self__", None)  # generated code: Message.FromString
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    type_name = str(getattr(descriptor, "full_name", f"request of {method}"))

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as error:
            return UndecodableRequest(undecodable_message(type_name, error))

    return deserialize


async def _refusing_undecodable_messages(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _refusing_undecodable(behavior: Any) -> Any:
    """`behavior`, made to refuse an undecodable request first: an async generator stays
    one; any other function becomes a coroutine function that awaits what it returns, as
    the metrics interceptor does (a coroutine, or the generated UNIMPLEMENTED stubs' plain
    functions). None for a sync generator, which gRPC would run in a thread."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, UndecodableRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response

        return stream
    if inspect.isgeneratorfunction(behavior):
        return None

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call
