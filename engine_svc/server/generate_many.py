"""One GenerateMany call: the requests its client sends, added to the engine as they come,
and their outputs read as one group, so that each response carries what every request of the
call produced since the last (one engine step at one token a step), not a message apiece."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from engine_svc.client.async_client import AsyncMPClient
from engine_svc.client.output_stream import OutputGroup, RequestOutputStream
from engine_svc.server import convert
from shared.errors import EngineUnavailableError, InvalidRequestError, MessageTooLargeError
from shared.grpc_errors import status_for
from shared.protos import engine_pb2 as pb
from shared.protos import field_entry_bytes

logger = logging.getLogger(__name__)

# A bound on one message's lists, as Generate's and Abort's fields have theirs.
MAX_REQUESTS_PER_MESSAGE = 1024
# A response grows by every request's pending tokens (more when the client lags): the rest
# goes in another message before it passes this many bytes, gRPC's default receive limit.
# One request's output over it fails that request alone (RESOURCE_EXHAUSTED), where on the
# client's side it would end the call for all.
MAX_RESPONSE_BYTES = 4 << 20
# What a response takes from one request: its output, its error, or nothing.
_Entry = pb.GenerateResponse | pb.RequestError | None
METHOD = f"/{pb.DESCRIPTOR.services_by_name['EngineCoreService'].full_name}/GenerateMany"


def withdraws_only(message: object) -> bool:
    """A message that adds no request, only aborts: let in after the call's bearer token is
    revoked, so that a frontend whose token rotated aborts what it sent before on the call
    that carries the old token (it sends new requests on a call with the new one)."""
    return isinstance(message, pb.GenerateManyRequest) and not message.requests


class GenerateManyCall:
    def __init__(self, client: AsyncMPClient) -> None:
        self.client = client
        self.group = OutputGroup()
        self.live: dict[str, RequestOutputStream] = {}  # added, not yet ended
        self.dropped: set[RequestOutputStream] = set()  # failed here, being aborted
        self.closing = False

    def close(self) -> None:
        """End the call with UNAVAILABLE once its requests have ended (the engine is going
        away: an open call would otherwise hold the server's stop for its whole grace)."""
        self.closing = True
        self.group.wake()

    async def responses(
        self, requests: AsyncIterator[pb.GenerateManyRequest]
    ) -> AsyncGenerator[pb.GenerateManyResponse, None]:
        """Until the client half-closes and its last request ends. Closing this generator
        (the call was cancelled or failed) aborts the requests still running."""
        reader = asyncio.create_task(self._read(requests), name="generate-many requests")
        reader.add_done_callback(lambda _: self.group.wake())
        try:
            while not (reader.done() and not self.live and self.group.is_empty):
                ready, refused = await self.group.wait()
                response = pb.GenerateManyResponse()
                for request_id, error in refused:
                    _add_error(response, request_id, error)
                size = response.ByteSize()
                for stream in ready:
                    entry, entry_size = self._take(stream)
                    if size + entry_size > MAX_RESPONSE_BYTES and size:  # the rest in another
                        yield response
                        response, size = pb.GenerateManyResponse(), 0
                    _add_entry(response, entry)
                    size += entry_size
                if response.outputs or response.errors:
                    yield response
                if reader.done():
                    reader.result()  # the client's stream failed: so does the call
                if self.closing and not self.live and self.group.is_empty:
                    raise EngineUnavailableError("the engine is shutting down")
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            if self.live:
                self.client.abort_soon(list(self.live))

    def _take(self, stream: RequestOutputStream) -> tuple[_Entry, int]:
        """The stream's pending output, or its error (None when its end went out already),
        and the bytes it adds to a response."""
        if stream in self.dropped:  # its error went out: what the abort brings goes nowhere
            with contextlib.suppress(Exception):
                stream.take()
            if stream.is_done:
                self.dropped.discard(stream)
            return None, 0
        if stream.is_done:
            return None, 0
        try:
            output = convert.to_generate_response(stream.take())
            size = output.ByteSize()
            if size > MAX_RESPONSE_BYTES:
                raise MessageTooLargeError(
                    f"one output of {size} bytes is over the "
                    f"{MAX_RESPONSE_BYTES}-byte bound on a response"
                )
        except Exception as error:  # the request's own failure, not the call's
            if not stream.is_done:
                self.client.abort_soon([stream.request_id])
                self.dropped.add(stream)
            self.live.pop(stream.request_id, None)
            refusal = _request_error(stream.request_id, error)
            return refusal, field_entry_bytes(refusal.ByteSize())
        if stream.is_done:
            self.live.pop(stream.request_id, None)
        return output, field_entry_bytes(size)

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        async for message in requests:
            count = len(message.requests) + len(message.abort_request_ids)
            if count > MAX_REQUESTS_PER_MESSAGE:
                raise InvalidRequestError(
                    "requests",
                    f"{count} requests and aborts in one message is over the "
                    f"limit of {MAX_REQUESTS_PER_MESSAGE}",
                )
            for request in message.requests:
                await self._add(request)
            aborts = [i for i in message.abort_request_ids if i in self.live]
            if aborts:
                await self.client.abort_requests_async(aborts)

    async def _add(self, request: pb.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            if not request_id:
                raise InvalidRequestError("request_id", "each request of GenerateMany needs one")
            if request_id in self.live:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            with convert.proto_field_names():
                engine_request = convert.to_engine_request(request)
                stream = await self.client.add_request_async(engine_request, self.group)
        except Exception as error:
            self.group.refuse(request_id, error)
            return
        if not stream.is_done:  # its outputs may all have been handed over already
            self.live[request_id] = stream


def _request_error(request_id: str, error: Exception) -> pb.RequestError:
    code, message = status_for(convert.proto_named(error))
    if code == grpc.StatusCode.INTERNAL:
        logger.error("request %s failed", request_id, exc_info=error)
    return pb.RequestError(request_id=request_id, code=code.value[0], message=message)


def _add_error(response: pb.GenerateManyResponse, request_id: str, error: Exception) -> None:
    response.errors.append(_request_error(request_id, error))


def _add_entry(response: pb.GenerateManyResponse, entry: _Entry) -> None:
    if isinstance(entry, pb.GenerateResponse):
        response.outputs.append(entry)
    elif entry is not None:
        response.errors.append(entry)
