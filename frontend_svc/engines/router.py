"""Engine calls for one choice: on the least-loaded healthy engine, retried on another when an
engine fails before its first response (not when the engine ends the request with
FINISH_REASON_ERROR: that concerns the request alone), and cancelled (so the engine aborts
the request) whenever the caller stops listening. A request goes over the engine's shared
GenerateMany call (multiplexer.py), or its own Generate call where the engine has none."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Protocol

import grpc

from frontend_svc.engines.convert import to_engine_output, to_generate_request
from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.engines.errors import (
    EngineCallError,
    classify,
    classify_status,
    engine_failed_mid_request,
)
from frontend_svc.engines.multiplexer import (
    EngineStatusError,
    Multiplexer,
    MultiplexingUnsupported,
)
from frontend_svc.engines.pool import EnginePool
from frontend_svc.messages import EngineOutput, EngineRequest, FinishReason
from shared.errors import DeadlinePassedError, EngineUnavailableError, RequestFailedError

logger = logging.getLogger(__name__)

# How long an engine whose call failed stays out, unless its health watch reports sooner.
SUSPEND_AFTER_FAILURE_S = 2.0


class EngineRequestFailed(Exception):
    """The engine call failed under the request (its channel closed): the engine's trouble."""


class _FailedInEngine(Exception):
    """The engine ended the request with FINISH_REASON_ERROR: a fault this one request met
    while the engine goes on serving others, so it is neither retried nor held against the
    engine (INTERNAL to the client)."""


class Cancellable(Protocol):
    def cancel(self) -> bool | None: ...


class EngineCallStop:
    """Ends a choice's engine call early (a stop string matched, the client went away) by
    cancelling the call itself, so that its pending read ends on its own and the generator
    returns. Cancelling the task awaiting that read instead leaks grpcio's read batch and
    the buffers it holds, several KB a call (grpc/grpc#43360): the frontend's memory grew
    with every stop string and every cancelled stream."""

    def __init__(self) -> None:
        self.requested = False
        # The call in flight: a Generate call, or a request on the shared GenerateMany call.
        self.call: Cancellable | None = None

    def request(self) -> bool:
        """True when a call was in flight and is now cancelled; False when there is none to
        cancel (not started yet, or between tries): the caller cancels the task then."""
        self.requested = True
        if self.call is None:
            return False
        self.call.cancel()
        return True


class EngineRouter:
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    async def generate(
        self, request: EngineRequest, deadline: float | None, stop: EngineCallStop | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """The engine's outputs for `request`. `deadline` is on time.monotonic()'s clock.
        Once `stop` is requested, the outputs end (and no other engine is tried)."""
        stop = stop or EngineCallStop()
        tried: list[str] = []
        last_failure: Exception | None = None
        while not stop.requested:
            try:
                endpoint = self.pool.pick(exclude=tried)
            except EngineUnavailableError:
                raise last_failure or EngineUnavailableError("no healthy engine") from None
            tried.append(endpoint.address)
            has_output = False
            try:
                calls = self._call(endpoint, request, deadline, stop)
                async with contextlib.aclosing(calls) as outputs:
                    async for output in outputs:
                        has_output = True
                        yield output
                return
            except grpc.aio.AioRpcError as error:
                failure = classify(error, endpoint.address, has_output)
            except EngineStatusError as error:
                failure = classify_status(error.code, error.details, endpoint.address, has_output)
            except EngineRequestFailed as error:
                failure = _request_failed(endpoint.address, str(error), has_output)
            except _FailedInEngine as error:
                message = f"engine {endpoint.address} failed the request: {error}"
                raise RequestFailedError(message) from None
            if not failure.is_retriable:
                raise failure.error
            logger.warning("retrying %s elsewhere: %s", request.request_id, failure.error)
            endpoint.suspend(SUSPEND_AFTER_FAILURE_S)
            last_failure = failure.error

    async def _call(
        self,
        endpoint: EngineEndpoint,
        request: EngineRequest,
        deadline: float | None,
        stop: EngineCallStop,
    ) -> AsyncGenerator[EngineOutput, None]:
        with endpoint.track_call():
            mux = endpoint.multiplexer()
            if mux.is_supported:
                try:
                    outputs = self._multiplexed(mux, request, deadline, stop)
                    async with contextlib.aclosing(outputs):
                        async for output in outputs:
                            yield output
                    return
                except MultiplexingUnsupported:
                    if stop.requested:  # stopped meanwhile: no call of its own either
                        return
                    # Nothing was sent: the request goes on a call of its own.
            outputs = self._own_call(endpoint, request, deadline, stop)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    yield output

    async def _multiplexed(
        self, mux: Multiplexer, request: EngineRequest, deadline: float | None, stop: EngineCallStop
    ) -> AsyncGenerator[EngineOutput, None]:
        _time_left(deadline)  # raises once it has passed
        handle = mux.start(to_generate_request(request), deadline)
        stop.call = handle
        try:
            async for response in handle.responses():
                yield _checked(to_engine_output(response))
        finally:
            stop.call = None
            handle.cancel()  # a no-op after the last response; otherwise the engine aborts

    async def _own_call(
        self,
        endpoint: EngineEndpoint,
        request: EngineRequest,
        deadline: float | None,
        stop: EngineCallStop,
    ) -> AsyncGenerator[EngineOutput, None]:
        timeout = _time_left(deadline)
        call = endpoint.stub.Generate(to_generate_request(request), timeout=timeout)
        stop.call = call
        try:
            async for response in call:
                yield _checked(to_engine_output(response))
        except asyncio.CancelledError:
            # grpc.aio raises this from a read of a call cancelled locally: when the stop
            # did it (and this task is not being cancelled), the call ended as asked;
            # when the channel did (closed under it after its grace: an address gone
            # from DNS, rotated TLS files), the engine call failed, like a dropped one.
            if _task_cancelling() or not call.cancelled():
                raise
            if stop.requested:
                return
            closed = "the channel to the engine closed under the call"
            raise EngineRequestFailed(closed) from None
        finally:
            stop.call = None
            # A no-op after the last message; otherwise the engine aborts the request.
            call.cancel()


def _checked(output: EngineOutput) -> EngineOutput:
    if output.finish_reason == FinishReason.ERROR:
        raise _FailedInEngine(output.error or "no reason given")
    return output


def _task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _time_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlinePassedError()
    return left


def _request_failed(address: str, message: str, has_output: bool) -> EngineCallError:
    if has_output:
        return EngineCallError(engine_failed_mid_request(address, message), False)
    return EngineCallError(EngineUnavailableError(f"engine {address}: {message}"), True)
