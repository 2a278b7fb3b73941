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
from shared.errors import EngineUnavailableError, InvalidRequestError
from shared.grpc_errors import status_for
from shared.protos import engine_pb2 as pb

logger = logging.getLogger(__name__)

# A bound on one message's lists, as Generate's and Abort's fields have theirs.
MAX_REQUESTS_PER_MESSAGE = 1024
# A response grows by every request's pending tokens (more when the client lags): past this
# many bytes, the rest goes in another, well below the transport's 16 MiB message limit.
MAX_RESPONSE_BYTES = 4 << 20


class GenerateManyCall:
    def __init__(self, client: AsyncMPClient) -> None:
        self.client = client
        self.group = OutputGroup()
        self.live: dict[str, RequestOutputStream] = {}  # added, not yet ended
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
                response, size = pb.GenerateManyResponse(), 0
                for request_id, error in refused:
                    _add_error(response, request_id, error)
                for stream in ready:
                    size += self._take(stream, response)
                    if size > MAX_RESPONSE_BYTES:  # the rest in another message
                        yield response
                        response, size = pb.GenerateManyResponse(), 0
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

    def _take(self, stream: RequestOutputStream, response: pb.GenerateManyResponse) -> int:
        """Adds the stream's output (or error) to `response`; returns the bytes it added."""
        if stream.is_done:
            return 0  # its end was handed over already
        size = 0
        try:
            converted = convert.to_generate_response(stream.take())
        except Exception as error:  # the request's own failure, not the call's
            _add_error(response, stream.request_id, error)
        else:
            size = converted.ByteSize()
            response.outputs.append(converted)
        if stream.is_done:
            self.live.pop(stream.request_id, None)
        return size

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


def _add_error(response: pb.GenerateManyResponse, request_id: str, error: Exception) -> None:
    code, message = status_for(convert.proto_named(error))
    if code == grpc.StatusCode.INTERNAL:
        logger.error("request %s failed", request_id, exc_info=error)
    response.errors.append(
        pb.RequestError(request_id=request_id, code=code.value[0], message=message)
    )
