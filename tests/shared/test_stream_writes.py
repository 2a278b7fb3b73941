"""stream_errors' bound on each write of a server stream, on a fake servicer context: a write
that waits past the bound drops the stream with RESOURCE_EXHAUSTED and runs the method's
clean-up; each write gets its whole bound, however long the stream has lasted; a cancel from
elsewhere (the client went away) stays a cancel; the stream's timer ends with the stream.
The watch's own clock is the test's where timing matters (its timer called by the test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import grpc
import pytest

from shared import grpc_errors
from shared.grpc_errors import stream_errors

BOUND_S = 0.05


class FakeContext:
    """The parts of grpc.aio.ServicerContext that stream_errors uses. Writes complete at
    once, or (writes_wait) each waits until the test calls release()."""

    def __init__(self, *, writes_wait: bool = False) -> None:
        self.writes_wait = writes_wait
        self.written: list[Any] = []
        self.waiting: list[asyncio.Event] = []  # one a write that waits, in order
        self.writing = asyncio.Event()  # set once a write waits
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def write(self, response: Any) -> None:
        if self.writes_wait:
            released = asyncio.Event()
            self.waiting.append(released)
            self.writing.set()
            await released.wait()
        self.written.append(response)

    def release(self) -> None:
        self.waiting[-1].set()

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
        raise grpc.aio.AbortError()

    def done(self) -> bool:
        return self.status is not None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


class Servicer:
    def __init__(self, timeout_s: float | None, pause_s: float = 0.0, fail_at: int = -1) -> None:
        self.stream_write_timeout_s = timeout_s
        self.pause_s = pause_s
        self.fail_at = fail_at
        self.closed = False
        self.cancels_pending_at_close = -1

    @stream_errors
    async def Stream(self, request: int, context: Any) -> AsyncGenerator[int, None]:
        try:
            for i in range(request):
                if i == self.fail_at:
                    raise ValueError("the method failed")
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
                yield i
        finally:
            self.closed = True  # the method's clean-up (an engine request aborted)
            task = asyncio.current_task()
            assert task is not None
            self.cancels_pending_at_close = task.cancelling()


@pytest.fixture
def watches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every _WriteWatch the streams make, to look at their timers."""
    made: list[Any] = []

    class Recorded(grpc_errors._WriteWatch):
        def __init__(self, timeout_s: float) -> None:
            super().__init__(timeout_s)
            made.append(self)

    monkeypatch.setattr(grpc_errors, "_WriteWatch", Recorded)
    yield made


def test_a_write_that_waits_past_the_bound_drops_the_stream(watches: list[Any]) -> None:
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
    assert servicer.cancels_pending_at_close == 0  # the watch's cancel taken back
    assert context.written == []
    assert watches[0].timer.cancelled()


def test_each_write_gets_its_whole_bound(watches: list[Any]) -> None:
    """On a clock the test sets: a write 0.6 bounds long, then another that starts there and
    is 1.2 bounds past the first's start when the timer looks, is not dropped; at 1 bound
    into the second, it is."""
    clock = [100.0]

    async def main() -> tuple[Servicer, FakeContext]:
        asyncio.get_running_loop().time = lambda: clock[0]  # type: ignore[method-assign]
        servicer, context = Servicer(BOUND_S), FakeContext(writes_wait=True)
        task = asyncio.create_task(servicer.Stream(3, context))
        await context.writing.wait()  # the first write began at 100
        watch = watches[0]
        clock[0] = 100 + 0.6 * BOUND_S
        watch._check()
        assert not watch.stalled and watch.timer.when() == pytest.approx(100 + BOUND_S)
        context.writing.clear()
        context.release()
        await context.writing.wait()  # the second write began at 100 + 0.6 bounds
        clock[0] = 100 + 1.2 * BOUND_S
        watch._check()
        assert not watch.stalled and watch.timer.when() == pytest.approx(100 + 1.6 * BOUND_S)
        clock[0] = watch.write_started + BOUND_S  # one bound into the second write
        watch._check()
        assert watch.stalled
        await task
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.written == [0]
    assert context.status is not None and context.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.closed and servicer.cancels_pending_at_close == 0


def test_writes_that_complete_are_never_dropped_however_long_the_stream(
    watches: list[Any],
) -> None:
    # The stream lasts several bounds (a pause before each response), but no single write waits.
    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(BOUND_S, pause_s=BOUND_S / 2), FakeContext()
        await servicer.Stream(12, context)
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.status is None
    assert context.written == list(range(12))
    assert servicer.closed
    assert watches[0].timer.cancelled()  # no timer left behind the stream


@pytest.mark.parametrize(("timeout_s", "stalled_too"), [(None, False), (30.0, False), (30.0, True)])
def test_a_cancel_from_elsewhere_stays_a_cancel(
    watches: list[Any], timeout_s: float | None, stalled_too: bool
) -> None:
    """gRPC cancels a handler whose client went away; with `stalled_too`, the watch has
    cancelled it too (its write waited past the bound) before the task runs again."""

    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(timeout_s), FakeContext(writes_wait=True)
        task = asyncio.create_task(servicer.Stream(10, context))
        await context.writing.wait()
        if stalled_too:
            watches[0].write_started = -1e9
            watches[0]._check()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.status is None
    assert servicer.closed


def test_a_method_that_fails_mid_stream_ends_with_its_status(watches: list[Any]) -> None:
    async def main() -> tuple[Servicer, FakeContext]:
        servicer, context = Servicer(30.0, fail_at=2), FakeContext()
        with pytest.raises(grpc.aio.AbortError):
            await servicer.Stream(10, context)
        return servicer, context

    servicer, context = asyncio.run(main())
    assert context.written == [0, 1]
    assert context.status is not None and context.status[0] == grpc.StatusCode.INTERNAL
    assert "the method failed" in context.status[1]
    assert servicer.closed
    assert watches[0].timer.cancelled()


def test_no_bound_writes_every_response() -> None:
    async def main() -> FakeContext:
        context = FakeContext()
        await Servicer(None).Stream(5, context)
        return context

    assert asyncio.run(main()).written == list(range(5))
