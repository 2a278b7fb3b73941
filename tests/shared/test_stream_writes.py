"""stream_errors' bound on each write of a server stream, on a fake servicer context: a write
that waits past the bound drops the stream with RESOURCE_EXHAUSTED and runs the method's
clean-up; writes that complete are never dropped however long the stream lasts; a cancel from
elsewhere (the client went away) stays a cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc
import pytest

from shared.grpc_errors import stream_errors

BOUND_S = 0.05


class FakeContext:
    """The parts of grpc.aio.ServicerContext that stream_errors uses. Writes complete at
    once, or wait until the test releases them (a client that reads nothing)."""

    def __init__(self, *, writes_wait: bool = False) -> None:
        self.writes_wait = writes_wait
        self.written: list[Any] = []
        self.writing = asyncio.Event()  # set once a write is waiting
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def write(self, response: Any) -> None:
        if self.writes_wait:
            self.writing.set()
            await asyncio.Event().wait()  # never released
        self.written.append(response)

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
        raise grpc.aio.AbortError()

    def done(self) -> bool:
        return self.status is not None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


class Servicer:
    def __init__(self, timeout_s: float | None, pause_s: float = 0.0) -> None:
        self.stream_write_timeout_s = timeout_s
        self.pause_s = pause_s
        self.closed = False

    @stream_errors
    async def Stream(self, request: int, context: Any) -> AsyncGenerator[int, None]:
        try:
            for i in range(request):
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
                yield i
        finally:
            self.closed = True  # the method's clean-up (an engine request aborted)


def test_a_write_that_waits_past_the_bound_drops_the_stream() -> None:
    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(BOUND_S), FakeContext(writes_wait=True)
        await asyncio.wait_for(servicer.Stream(10, context), timeout=30)
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.status is not None
    code, message = context.status
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read nothing of its stream" in message
    assert servicer.closed
    assert context.written == []


def test_writes_that_complete_are_never_dropped_however_long_the_stream() -> None:
    # The stream lasts several bounds (a pause before each response), but no single write waits.
    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(BOUND_S, pause_s=BOUND_S / 2), FakeContext()
        await servicer.Stream(12, context)
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.status is None
    assert context.written == list(range(12))
    assert servicer.closed


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_cancel_from_elsewhere_stays_a_cancel(timeout_s: float | None) -> None:
    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(timeout_s), FakeContext(writes_wait=True)
        task = asyncio.create_task(servicer.Stream(10, context))
        await context.writing.wait()
        task.cancel()  # as gRPC cancels a handler whose client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.status is None
    assert servicer.closed


def test_no_bound_writes_every_response() -> None:
    async def main() -> FakeContext:
        context = FakeContext()
        await Servicer(None).Stream(5, context)
        return context

    assert asyncio.run(main()).written == list(range(5))
