"""go-grpc-prometheus's server metrics for a grpc.aio server, as an interceptor:
grpc_server_started_total, grpc_server_handled_total (by status code, spelled as Go spells
it: OK, InvalidArgument, Unavailable, Canceled, ...) and grpc_server_handling_seconds, each
labelled with grpc_type, grpc_service and grpc_method."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from shared.metrics import catalog

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """Pass as `grpc.aio.server(interceptors=[GrpcServerMetrics(registry)])`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._started = catalog.GRPC_SERVER_STARTED.counter(registry)
        self._handled = catalog.GRPC_SERVER_HANDLED.counter(registry)
        self._handling = catalog.GRPC_SERVER_HANDLING_SECONDS.histogram(registry)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: gRPC answers UNIMPLEMENTED itself
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (rpc_type(handler), service, method)
        for field in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, field)
            if behavior is not None:
                wrapped = self._wrap(behavior, labels)
                return handler._replace(**{field: wrapped})
        return handler

    def _wrap(self, behavior: Behavior, labels: tuple[str, str, str]) -> Behavior:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                start = self._start(labels)
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as error:
                    self._finish(labels, start, code_of(error, context))
                    raise
                self._finish(labels, start, code_of(None, context))

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = self._start(labels)
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
            except BaseException as error:
                self._finish(labels, start, code_of(error, context))
                raise
            self._finish(labels, start, code_of(None, context))
            return result

        return call

    def _start(self, labels: tuple[str, str, str]) -> float:
        self._started.labels(*labels).inc()
        return time.perf_counter()

    def _finish(self, labels: tuple[str, str, str], start: float, code: grpc.StatusCode) -> None:
        self._handled.labels(*labels, go_code_name(code)).inc()
        self._handling.labels(*labels).observe(time.perf_counter() - start)


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """go-grpc-prometheus's grpc_type: unary, client_stream, server_stream or bidi_stream."""
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


# A call cancelled with less than this left before its deadline was cancelled by the
# deadline: the client's timer, started before the request left it, fires first, and its
# cancel reaches the handler a little before the server's own timer does (about 7 ms before,
# in two of four calls on 127.0.0.1 here). A client's own cancel that close to its deadline
# counts as the deadline too.
DEADLINE_SLACK_S = 0.05


def code_of(error: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status the call ends with: what the servicer set or aborted with, else OK for a
    return; at the client's deadline DEADLINE_EXCEEDED, what the client sees, whether gRPC
    cancelled the handler or the handler failed after it (a servicer that saw the deadline
    at the same moment cannot abort a call already over); CANCELLED for a call the client
    cancelled; UNKNOWN for any other exception (as gRPC does)."""
    if error is None or isinstance(error, grpc.aio.AbortError):
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code
        return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
    remaining = context.time_remaining()
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        if remaining is not None and remaining < DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNKNOWN


def go_code_name(code: grpc.StatusCode) -> str:
    """The code as Go's codes.Code.String() spells it, which go-grpc-prometheus exports."""
    if code == grpc.StatusCode.OK:
        return "OK"
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(part.capitalize() for part in code.name.split("_"))
