"""The one mapping from our exceptions to gRPC status codes, as decorators for servicer
methods, so servicers only convert and delegate."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from shared.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
)

logger = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

ResponseT = TypeVar("ResponseT")
UnaryMethod = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[ResponseT]]
StreamMethod = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncGenerator[ResponseT, None]]


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `error`."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)  # "field: what is wrong"
    if isinstance(error, EngineDeadError | EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error}; retry in {error.retry_after_s:g} s"
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "timed out"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("internal error in a gRPC method", exc_info=error)
    if isinstance(error, EngineOverloadedError):
        # gRPC's own retry hint (gRFC A6): clients with a retry policy wait this long.
        pushback_ms = str(round(error.retry_after_s * 1000))
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, pushback_ms),))
    await context.abort(code, message)


def unary_errors(method: UnaryMethod[ResponseT]) -> UnaryMethod[ResponseT]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> ResponseT:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await abort_with(context, error)
            raise  # not reached: abort raises

    return wrapper


def stream_errors(method: StreamMethod[ResponseT]) -> StreamMethod[ResponseT]:
    @functools.wraps(method)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[ResponseT, None]:
        try:
            # aclosing: if gRPC drops this stream (the client cancelled), the method's own
            # clean-up (aborting the engine request) runs now, not whenever GC gets to it.
            async with contextlib.aclosing(method(self, request, context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await abort_with(context, error)

    return wrapper
