"""How a choice ends its engine call early (router.EngineCallStop), against scripted engines:
the call itself is cancelled, so the pending read ends and the router's outputs end on their
own, with no task cancelled (cancelling the task awaiting a read leaks grpcio's read buffers,
grpc/grpc#43360); a stop before any call starts none; and a stopped choice is not tried on
another engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.engines.pool import EnginePool
from frontend_svc.engines.router import EngineCallStop, EngineRouter
from frontend_svc.messages import EngineOutput, EngineRequest, SamplingOptions
from frontend_svc.tokenizer import Tokenizer
from tests.frontend_svc.fake_engine import FakeEngine
from tests.frontend_svc.test_frontend_faults import TEXT, run, wait_for

pytestmark = pytest.mark.usefixtures("engine_call_kind")


@asynccontextmanager
async def router_for(engines: list[FakeEngine]) -> AsyncIterator[EngineRouter]:
    pool = EnginePool(lambda a, on_change: EngineEndpoint(a, 0.1, on_change), 100)
    pool.set_addresses([e.address for e in engines])
    await wait_for(lambda: len(pool.available) == len(engines))
    try:
        yield EngineRouter(pool)
    finally:
        await pool.close()


def engine_request(request_id: str) -> EngineRequest:
    sampling = SamplingOptions(max_tokens=200, temperature=0.0)
    return EngineRequest(request_id=request_id, prompt_token_ids=(1, 2, 3), sampling=sampling)


async def read_all(
    router: EngineRouter, request: EngineRequest, stop: EngineCallStop, into: list[EngineOutput]
) -> None:
    async for output in router.generate(request, None, stop):
        into.append(output)


def test_a_stop_cancels_the_call_and_the_outputs_end_on_their_own(
    tokenizer: Tokenizer,
) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT), hold_after=3).start()
        async with router_for([engine]) as router:
            stop, outputs = EngineCallStop(), []
            reader = asyncio.create_task(read_all(router, engine_request("held"), stop, outputs))
            await wait_for(lambda: len(outputs) == 3)  # the engine holds the stream there
            assert stop.call is not None and stop.request() is True
            await asyncio.wait_for(reader, 10)  # ends without being cancelled
            assert not reader.cancelled() and reader.exception() is None
            assert stop.call is None and len(outputs) == 3
            await wait_for(lambda: len(engine.cancelled) == 1)  # the engine saw the cancel
        await engine.stop()

    run(body)


def test_a_stop_before_the_call_starts_none(tokenizer: Tokenizer) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT)).start()
        async with router_for([engine]) as router:
            stop, outputs = EngineCallStop(), []
            assert stop.request() is False  # nothing in flight: the caller cancels the task
            await read_all(router, engine_request("early"), stop, outputs)
            assert outputs == [] and engine.calls == []
        await engine.stop()

    run(body)


def test_a_stopped_choice_is_not_tried_on_another_engine(tokenizer: Tokenizer) -> None:
    """The first engine never answers; the stop comes while its call is in flight: the
    outputs end, and the second engine never gets the request."""

    async def body() -> None:
        hanging = await FakeEngine(tokenizer.encode(TEXT), "hang").start()
        good = await FakeEngine(tokenizer.encode(TEXT)).start()
        async with router_for([hanging, good]) as router:
            # The hanging engine first, then the good one (pick's own order follows loads).
            endpoints = {e.address: e for e in router.pool.available}
            order = [hanging.address, good.address]
            router.pool.pick = lambda exclude=(): endpoints[  # type: ignore[method-assign]
                next(address for address in order if address not in exclude)
            ]
            stop, outputs = EngineCallStop(), []
            reader = asyncio.create_task(read_all(router, engine_request("hung"), stop, outputs))
            await wait_for(lambda: len(hanging.calls) == 1 and stop.call is not None)
            assert stop.request() is True
            await asyncio.wait_for(reader, 10)
            assert not reader.cancelled() and reader.exception() is None
            assert outputs == [] and good.calls == []
            await wait_for(lambda: len(hanging.cancelled) == 1)
        await hanging.stop()
        await good.stop()

    run(body)
