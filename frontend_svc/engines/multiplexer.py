"""All of this frontend's requests to one engine over one GenerateMany call: requests and
aborts go out batched in the call's messages, and each message back carries an engine step's
outputs for every request, which are handed to the requests' own queues. A request costs
one gRPC message a step for the whole batch instead of one apiece, on both sides.

The call opens with the first request and again after it ends. When it ends (the engine
went away, the channel closed), every request on it fails with the call's status, as each
one's own Generate call would have. An engine without GenerateMany (an older version
during a rolling upgrade) answers UNIMPLEMENTED: the router then uses Generate there."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from shared.errors import DeadlinePassedError, MessageTooLargeError
from shared.protos import (
    GENERATE_MANY_MAX_MESSAGE_BYTES,
    GENERATE_MANY_READY,
    engine_pb2_grpc,
    field_entry_bytes,
)
from shared.protos import engine_pb2 as pb

logger = logging.getLogger(__name__)

# As the engine bounds them (engine_svc/server/generate_many.py).
MAX_REQUESTS_PER_MESSAGE = 1024
# A burst of long prompts goes out over several messages of at most this many bytes, or of
# the engine's own limit where it says a lower one: a message over it would end the call. A
# bigger request goes alone, up to the engine's limit (the channel's, where it says none).
MAX_MESSAGE_BYTES = 4 << 20
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# How long a call may take to bring the engine's GenerateMany marker (in its initial metadata),
# and then, without it, to end with its status. A server that does neither is taken for one
# without GenerateMany: the requests go on calls of their own.
MARKERLESS_STATUS_WAIT_S = 5.0
# Statuses that describe one request, not a whole call: a call ending with one of them
# (an engine's bound on its messages) is an engine fault to the requests on it.
_REQUEST_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
}


class EngineStatusError(Exception):
    """A request ended with a gRPC status: its own (the engine refused it) or the call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def copy(self) -> EngineStatusError:
        return EngineStatusError(self.code, self.details)


class MultiplexingUnsupported(Exception):
    """The engine has no GenerateMany; nothing was sent for the request."""


_Item = pb.GenerateResponse | Exception | None  # None: cancelled here


class MultiplexedRequest:
    """One request's responses from the shared call, until its finish reason, its error,
    the deadline, or `cancel`."""

    def __init__(self, request_id: str, mux: Multiplexer, deadline: float | None) -> None:
        self.request_id = request_id
        self.mux = mux
        self.ended = False
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(deadline - time.monotonic(), self._expire)

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        while True:
            item = await self._items.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return

    def cancel(self) -> None:
        """End the responses now; the engine is told to abort the request."""
        if not self.ended:
            self.mux.abort(self)
            self._items.put_nowait(None)

    def put(self, response: pb.GenerateResponse) -> None:
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._end()
        self._items.put_nowait(response)

    def fail(self, error: Exception) -> None:
        self._end()
        self._items.put_nowait(error)

    def _end(self) -> None:
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        if not self.ended:
            self.mux.abort(self)
            self._items.put_nowait(DeadlinePassedError())


class Multiplexer:
    def __init__(
        self, stub: engine_pb2_grpc.EngineCoreServiceStub, address: str, channel_max_bytes: int
    ) -> None:
        self.stub = stub
        self.address = address
        self.channel_max_bytes = channel_max_bytes  # the channel's own send limit
        self.is_supported = True  # until the engine answers UNIMPLEMENTED
        self.is_draining = False
        self._call: grpc.aio.StreamStreamCall[Any, Any] | None = None
        self._is_ready = False  # the call's engine said it serves GenerateMany
        self._engine_message_bytes = channel_max_bytes  # what the engine takes
        self._requests: dict[str, MultiplexedRequest] = {}
        self._unsent: dict[str, pb.GenerateRequest] = {}  # in the order they came
        self._aborts: list[str] = []
        self._outbox = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def is_open(self) -> bool:
        return self._call is not None

    def start(self, request: pb.GenerateRequest, deadline: float | None) -> MultiplexedRequest:
        """Send `request` with the call's next message. `deadline` on time.monotonic()."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already on the call")
        if self._call is None:
            self._open()
        handle = MultiplexedRequest(request.request_id, self, deadline)
        self._requests[request.request_id] = handle
        self._unsent[request.request_id] = request
        self._outbox.set()
        return handle

    def abort(self, handle: MultiplexedRequest) -> None:
        """Forget the request here at once; the engine aborts it with the next message (or
        never hears of it, if it was not sent yet)."""
        handle._end()
        if self._requests.get(handle.request_id) is handle:
            del self._requests[handle.request_id]
            if self._unsent.pop(handle.request_id, None) is None:
                self._aborts.append(handle.request_id)
                self._outbox.set()
            if self._call is not None:
                self._end_if_drained(self._call)

    def drain(self) -> None:
        """No new requests will come (the channel is closing): end the call once the last
        request on it has ended, so that the channel's close need not wait out its grace."""
        self.is_draining = True
        if self._call is not None:
            self._end_if_drained(self._call)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _open(self) -> None:
        call = self.stub.GenerateMany()
        self._call = call
        self._is_ready = False
        self._tasks = [
            asyncio.create_task(self._write(call), name=f"generate-many out {self.address}"),
            asyncio.create_task(self._read(call), name=f"generate-many in {self.address}"),
        ]

    async def _write(self, call: grpc.aio.StreamStreamCall[Any, Any]) -> None:
        try:
            # The engine's initial metadata says it serves GenerateMany. Without it the
            # call has ended (an engine without the method, or one refusing the call): its
            # status says why. Nothing is written then: a write into a call the server has
            # ended turns its status into INTERNAL on this side.
            metadata = await _initial_metadata(call)
            if metadata is None:
                self._end(call, EngineStatusError(grpc.StatusCode.UNIMPLEMENTED, "no marker"))
                return
            if GENERATE_MANY_READY not in metadata:
                self._end(call, await _status_without_marker(call))
                return
            if self._call is call:
                self._is_ready = True
                self._engine_message_bytes = _engine_message_bytes(metadata, self.channel_max_bytes)
            # Only while its call is the current one: once it has ended (even from this task:
            # a refused request draining it), the outbox belongs to the next call's writer.
            while self._call is call:
                await self._outbox.wait()
                if self._call is not call:
                    break  # the set was the next call's: its writer clears it
                self._outbox.clear()
                while self._call is call and (self._unsent or self._aborts):
                    message = self._next_message()
                    if self._call is call:
                        await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader hears why and fails its requests
        except Exception as error:  # not expected: the call cannot go on without a writer
            logger.exception("GenerateMany to %s: writing failed", self.address)
            self._end(call, EngineStatusError(grpc.StatusCode.UNKNOWN, f"writing: {error!r}"))

    def _next_message(self) -> pb.GenerateManyRequest:
        """Aborts first (a few bytes each), then as many requests as the bounds leave room
        for; one over MAX_MESSAGE_BYTES alone. A request too big for the engine fails."""
        message = pb.GenerateManyRequest()
        message.abort_request_ids.extend(self._aborts[:MAX_REQUESTS_PER_MESSAGE])
        del self._aborts[:MAX_REQUESTS_PER_MESSAGE]
        size = message.ByteSize()
        count = len(message.abort_request_ids)
        bound = min(MAX_MESSAGE_BYTES, self._engine_message_bytes)
        while self._unsent and count < MAX_REQUESTS_PER_MESSAGE:
            request = next(iter(self._unsent.values()))
            entry_size = field_entry_bytes(request.ByteSize())
            if size + entry_size > bound and size:
                break  # in the next message
            if size + entry_size > self._engine_message_bytes:
                self._refuse_too_large(request, entry_size)
                continue
            message.requests.append(self._unsent.pop(request.request_id))
            size += entry_size
            count += 1
        return message

    def _refuse_too_large(self, request: pb.GenerateRequest, size: int) -> None:
        """The request's own error (the client's to fix, so no other engine is tried and
        this one is not taken out), where a Generate call would have been refused with
        RESOURCE_EXHAUSTED by the engine's transport."""
        del self._unsent[request.request_id]
        handle = self._requests.pop(request.request_id)
        handle.fail(
            MessageTooLargeError(
                f"the request is {size} bytes, over the engine's limit of "
                f"{self._engine_message_bytes} a message"
            )
        )
        if self._call is not None:
            self._end_if_drained(self._call)

    async def _read(self, call: grpc.aio.StreamStreamCall[Any, Any]) -> None:
        ended: Exception
        try:
            async for response in call:
                self._dispatch(response)
                self._end_if_drained(call)
            ended = EngineStatusError(grpc.StatusCode.UNAVAILABLE, "the engine ended the call")
        except grpc.aio.AioRpcError as error:
            ended = _call_status(error.code(), error.details() or "")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling() > 0:  # close(): the frontend stops
                self._end(call, EngineStatusError(grpc.StatusCode.CANCELLED, "closing"))
                raise
            # grpc.aio raises this from a read of a call cancelled locally: the channel
            # closed under it (an address gone from DNS, rotated TLS files).
            closed = "the channel to the engine closed under the call"
            ended = EngineStatusError(grpc.StatusCode.CANCELLED, closed)
        except Exception as error:  # not expected: no request on the call may be left waiting
            logger.exception("GenerateMany from %s: reading failed", self.address)
            ended = EngineStatusError(grpc.StatusCode.UNKNOWN, f"reading: {error!r}")
        self._end(call, ended)

    def _dispatch(self, response: pb.GenerateManyResponse) -> None:
        for output in response.outputs:
            handle = self._requests.get(output.request_id)
            if handle is not None:
                if output.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    del self._requests[output.request_id]
                handle.put(output)
        for error in response.errors:
            handle = self._requests.pop(error.request_id, None)
            if handle is not None:
                code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                handle.fail(EngineStatusError(code, error.message))

    def _end_if_drained(self, call: grpc.aio.StreamStreamCall[Any, Any]) -> None:
        if self.is_draining and not self._requests:
            self._end(call, EngineStatusError(grpc.StatusCode.CANCELLED, "drained"))

    def _end(self, call: grpc.aio.StreamStreamCall[Any, Any], error: EngineStatusError) -> None:
        """The call is over: every request still on it fails with `error`."""
        if self._call is not call or call is None:
            return  # an earlier call's news
        # Only a call that never said it serves GenerateMany, and so was sent nothing, tells
        # its requests to go on calls of their own.
        unimplemented = error.code == grpc.StatusCode.UNIMPLEMENTED
        unsupported = unimplemented and not self._is_ready
        if unimplemented and self._is_ready:  # mid-call, from a proxy: an engine fault
            error = EngineStatusError(grpc.StatusCode.UNKNOWN, f"the call ended {error}")
        if unsupported:
            logger.info("engine %s has no GenerateMany: one Generate call a request", self.address)
            self.is_supported = False
        else:
            logger.debug("GenerateMany on %s ended: %s", self.address, error)
        call.cancel()
        self._call = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()  # the writer waits on the outbox; the reader ends on its own
        requests, self._requests = self._requests, {}
        self._unsent, self._aborts = {}, []
        for handle in requests.values():
            # An exception object apiece: each is raised in its request's own task.
            failure = MultiplexingUnsupported() if unsupported else error.copy()
            handle.fail(failure)


async def _initial_metadata(call: grpc.aio.StreamStreamCall[Any, Any]) -> tuple[Any, ...] | None:
    """The call's initial metadata; None when the server sends none in time (nor ends it)."""
    try:
        async with asyncio.timeout(MARKERLESS_STATUS_WAIT_S):  # not wait_for: it can drop a cancel
            metadata = await call.initial_metadata()
    except TimeoutError:
        return None
    return tuple(metadata or ())


async def _status_without_marker(call: grpc.aio.StreamStreamCall[Any, Any]) -> EngineStatusError:
    """Why a call whose initial metadata lacks GENERATE_MANY_READY ended. A server that keeps
    it open without saying it serves GenerateMany is taken for one without the method."""
    try:
        async with asyncio.timeout(MARKERLESS_STATUS_WAIT_S):
            code = await call.code()
    except TimeoutError:
        return EngineStatusError(grpc.StatusCode.UNIMPLEMENTED, "no GenerateMany marker")
    return _call_status(code, await call.details() or "")


def _engine_message_bytes(metadata: tuple[Any, ...], channel_max_bytes: int) -> int:
    """The largest message the engine says it takes, within the channel's own limit."""
    for key, value in metadata:
        if key == GENERATE_MANY_MAX_MESSAGE_BYTES:
            try:
                return min(channel_max_bytes, int(value))
            except ValueError:
                logger.warning("ignoring %s: %r", key, value)
    return channel_max_bytes


def _call_status(code: grpc.StatusCode, details: str) -> EngineStatusError:
    """What the end of the whole call means to each request on it."""
    # INTERNAL too: grpc.aio reports it for a write that raced the call's end, whatever
    # the engine's status was.
    if code in _REQUEST_STATUSES or code == grpc.StatusCode.INTERNAL:
        return EngineStatusError(grpc.StatusCode.UNKNOWN, f"the call ended {code.name}: {details}")
    return EngineStatusError(code, details)
