"""The one mapping from our exceptions to gRPC status codes, as decorators for servicer
methods, so servicers only convert and delegate."""

from __future__ import annotations

import asyncio
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
    MessageTooLargeError,
    RequestFailedError,
    StreamStalledError,
    TokenRevokedError,
)

logger = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

# How long a server-streaming call may wait for its client to take the next response before
# it is dropped. A write waits only once the HTTP/2 flow-control window is full (64 KB to a few
# MB unread), so a client that reads, however slowly, never meets this bound; what queues up
# behind a stalled write is merged into the next response, bounded by the request's tokens.
DEFAULT_STREAM_WRITE_TIMEOUT_S = 60.0

ResponseT = TypeVar("ResponseT")
UnaryMethod = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[ResponseT]]
StreamMethod = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncGenerator[ResponseT, None]]
# gRPC also takes a coroutine that writes with context.write() as a server-streaming handler;
# typed loosely so that it still overrides the generated servicer's streaming method.
WriterMethod = Callable[[Any, Any, grpc.aio.ServicerContext], Any]


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `error`."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)  # "field: what is wrong"
    if isinstance(error, EngineDeadError | EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error}; retry in {error.retry_after_s:g} s"
    if isinstance(error, StreamStalledError | MessageTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, TokenRevokedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(error)
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "timed out"
    if isinstance(error, RequestFailedError):
        return grpc.StatusCode.INTERNAL, str(error)  # the engine logged its own traceback
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    code, message = status_for(error)
    if isinstance(error, RequestFailedError):
        logger.warning("%s", error)
    elif code == grpc.StatusCode.INTERNAL:
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


def stream_errors(method: StreamMethod[ResponseT]) -> WriterMethod:
    """A server-streaming method whose responses are written one at a time, each within the
    servicer's `stream_write_timeout_s` (None: no bound): a client that reads nothing for that
    long is dropped with RESOURCE_EXHAUSTED, and the method's clean-up runs."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
        timeout_s: float | None = self.stream_write_timeout_s
        watch = None if timeout_s is None else _WriteWatch(timeout_s)
        write = context.write if watch is None else functools.partial(watch.write, context)
        try:
            # aclosing: if gRPC drops this stream (the client cancelled), the method's own
            # clean-up (aborting the engine request) runs now, not whenever GC gets to it.
            async with contextlib.aclosing(method(self, request, context)) as responses:
                async for response in responses:
                    await write(response)
        except StreamStalledError as error:
            await _abort_behind_unread_responses(context, error)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await abort_with(context, error)
        finally:
            if watch is not None:
                watch.close()

    return wrapper


# Aborts still waiting for their status to pass the responses a client has not read.
_pending_aborts: set[asyncio.Task[None]] = set()


async def _abort_behind_unread_responses(
    context: grpc.aio.ServicerContext, error: Exception
) -> None:
    """End a stalled call without waiting on its client: the status queues up behind the
    unread responses (the client sees it if it ever reads on) while the method returns and
    its resources go now. gRPC has no server-side cancel; abort() records the status on its
    first step, before it waits for the send."""
    code, message = status_for(error)
    task = asyncio.get_running_loop().create_task(context.abort(code, message))
    _pending_aborts.add(task)
    task.add_done_callback(_forget_abort)
    while not (context.done() or task.done()):  # one turn: the abort's first step runs first
        await asyncio.sleep(0)


def _forget_abort(task: asyncio.Task[None]) -> None:
    _pending_aborts.discard(task)
    if not task.cancelled():
        task.exception()  # AbortError, or the failed send of a call the client closed


class _WriteWatch:
    """Bounds each write of one stream to `timeout_s` with one timer for the whole stream,
    re-armed only when it fires, where `asyncio.timeout` around each write would schedule and
    cancel a timer per response (at 64 streams of one token a response, that was about a tenth
    of each server's Python time under py-spy). The timer cancels the stream's task when a
    write has waited `timeout_s`, as `asyncio.timeout` would, and the write turns that
    cancellation into StreamStalledError."""

    def __init__(self, timeout_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None, "a servicer method runs in a task"
        self.timeout_s = timeout_s
        self.task = task
        self.loop = asyncio.get_running_loop()
        self.write_started: float | None = None  # loop time the pending write began
        self.stalled = False
        self.timer = self.loop.call_at(self.loop.time() + timeout_s, self._check)

    async def write(self, context: grpc.aio.ServicerContext, response: Any) -> None:
        self.write_started = self.loop.time()
        try:
            # Nothing awaits between here and the write: while write_started is set, the task
            # is suspended in the write (gRPC's write raises a cancel; it does not absorb it).
            await context.write(response)
        except asyncio.CancelledError:
            if self.stalled and self.task.uncancel() == 0:  # our cancel, and no one else's
                logger.warning(
                    "dropped a stream whose client read nothing for %g s", self.timeout_s
                )
                raise StreamStalledError(
                    f"the client read nothing of its stream for {self.timeout_s:g} s: dropped"
                ) from None
            raise
        finally:
            self.write_started = None

    def close(self) -> None:
        self.timer.cancel()

    def _check(self) -> None:
        started, now = self.write_started, self.loop.time()
        if started is not None and now >= started + self.timeout_s:
            self.stalled = True
            self.task.cancel()
            return
        # Each write is measured from its own start: one that began after the timer was armed
        # gets its whole bound.
        due = (now if started is None else started) + self.timeout_s
        self.timer = self.loop.call_at(due, self._check)
