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
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc

logger = logging.getLogger(__name__)

# As the engine bounds them (engine_svc/server/generate_many.py).
MAX_REQUESTS_PER_MESSAGE = 1024
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class EngineStatusError(Exception):
    """A request ended with a gRPC status: its own (the engine refused it) or the call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


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
            self._items.put_nowait(TimeoutError("the deadline passed"))


class Multiplexer:
    def __init__(self, stub: engine_pb2_grpc.EngineCoreServiceStub, address: str) -> None:
        self.stub = stub
        self.address = address
        self.is_supported = True  # until the engine answers UNIMPLEMENTED
        self.is_draining = False
        self._call: grpc.aio.StreamStreamCall[Any, Any] | None = None
        self._requests: dict[str, MultiplexedRequest] = {}
        self._adds: list[pb.GenerateRequest] = []
        self._aborts: list[str] = []
        self._outbox = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, request: pb.GenerateRequest, deadline: float | None) -> MultiplexedRequest:
        """Send `request` with the call's next message. `deadline` on time.monotonic()."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already on the call")
        if self._call is None:
            self._open()
        handle = MultiplexedRequest(request.request_id, self, deadline)
        self._requests[request.request_id] = handle
        self._adds.append(request)
        self._outbox.set()
        return handle

    def abort(self, handle: MultiplexedRequest) -> None:
        """Forget the request here at once; the engine aborts it with the next message."""
        handle._end()
        if self._requests.get(handle.request_id) is handle:
            del self._requests[handle.request_id]
            self._aborts.append(handle.request_id)
            self._outbox.set()
            self._end_if_drained()

    def drain(self) -> None:
        """No new requests will come (the channel is closing): end the call once the last
        request on it has ended, so that the channel's close need not wait out its grace."""
        self.is_draining = True
        self._end_if_drained()

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _open(self) -> None:
        call = self.stub.GenerateMany()
        self._call = call
        self._tasks = [
            asyncio.create_task(self._write(call), name=f"generate-many out {self.address}"),
            asyncio.create_task(self._read(call), name=f"generate-many in {self.address}"),
        ]

    async def _write(self, call: grpc.aio.StreamStreamCall[Any, Any]) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The engine answers with its initial metadata at once. Writing before it came
            # would race an engine without the method: a write into a call it has already
            # ended turns the call's UNIMPLEMENTED into INTERNAL on this side.
            await call.initial_metadata()
            if call.done():
                return
            while True:
                await self._outbox.wait()
                self._outbox.clear()
                while self._adds or self._aborts:
                    adds = self._adds[:MAX_REQUESTS_PER_MESSAGE]
                    del self._adds[:MAX_REQUESTS_PER_MESSAGE]
                    aborts = self._aborts[: MAX_REQUESTS_PER_MESSAGE - len(adds)]
                    del self._aborts[: len(aborts)]
                    message = pb.GenerateManyRequest(requests=adds, abort_request_ids=aborts)
                    await call.write(message)
        # A failed write means the call ended: the reader hears why and fails the requests.

    async def _read(self, call: grpc.aio.StreamStreamCall[Any, Any]) -> None:
        try:
            async for response in call:
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
                self._end_if_drained()
            ended: Exception = EngineStatusError(
                grpc.StatusCode.UNAVAILABLE, "the engine ended the GenerateMany call"
            )
        except grpc.aio.AioRpcError as error:
            ended = EngineStatusError(error.code(), error.details() or "")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling() > 0:  # close(): the frontend stops
                self._end(call, EngineStatusError(grpc.StatusCode.CANCELLED, "closing"))
                raise
            # grpc.aio raises this from a read of a call cancelled locally: the channel
            # closed under it (an address gone from DNS, rotated TLS files).
            closed = "the channel to the engine closed under the call"
            ended = EngineStatusError(grpc.StatusCode.CANCELLED, closed)
        self._end(call, ended)

    def _end_if_drained(self) -> None:
        if self.is_draining and not self._requests and self._call is not None:
            self._end(self._call, EngineStatusError(grpc.StatusCode.CANCELLED, "drained"))

    def _end(self, call: grpc.aio.StreamStreamCall[Any, Any], error: Exception) -> None:
        """The call is over: every request still on it fails with `error`."""
        if self._call is not call or call is None:
            return
        if isinstance(error, EngineStatusError) and error.code == grpc.StatusCode.UNIMPLEMENTED:
            logger.info("engine %s has no GenerateMany: one Generate call a request", self.address)
            self.is_supported = False
            error = MultiplexingUnsupported()
        else:
            logger.debug("GenerateMany on %s ended: %s", self.address, error)
        call.cancel()
        self._call = None
        writer = self._tasks[0] if self._tasks else None
        if writer is not None and writer is not asyncio.current_task():
            writer.cancel()
        self._tasks = []
        requests, self._requests = self._requests, {}
        self._adds, self._aborts = [], []
        for handle in requests.values():
            handle.fail(error)
