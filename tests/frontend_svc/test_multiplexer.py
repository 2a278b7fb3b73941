"""The frontend's requests to an engine share one GenerateMany call (engines/multiplexer.py),
against scripted engines: every choice of every request goes over the one call; a call that
ends fails what is on it and the next request opens another; closing an endpoint ends its
idle call at once instead of holding the channel for its grace."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from frontend_svc.engines.router import EngineCallStop
from frontend_svc.tokenizer import Tokenizer
from shared.frontend_protos import frontend_pb2 as pb
from tests.frontend_svc.fake_engine import FakeEngine
from tests.frontend_svc.test_engine_call_stop import engine_request, read_all, router_for
from tests.frontend_svc.test_frontend_faults import TEXT, frontend_for, request, run, wait_for


def test_every_choice_of_every_request_goes_over_one_call(tokenizer: Tokenizer) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT)).start()
        async with frontend_for([engine], tokenizer) as stub:
            replies = await asyncio.gather(
                *(stub.Generate(request(5, n=3), timeout=10) for _ in range(4))
            )
        assert [len(reply.choices) for reply in replies] == [3] * 4
        assert {choice.text for reply in replies for choice in reply.choices} == {
            tokenizer.decode(tokenizer.encode(TEXT)[:5], True)
        }
        assert (engine.many_calls, len(engine.calls)) == (1, 12)
        await engine.stop()

    run(body)


def test_a_call_that_ends_fails_its_requests_and_the_next_opens_another(
    tokenizer: Tokenizer,
) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT), "fail_after").start()
        async with frontend_for([engine], tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            engine.mode = "ok"  # a failure mid-request does not take the engine out
            reply = await stub.Generate(request(), timeout=10)
        assert reply.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert engine.many_calls == 2
        await engine.stop()

    run(body)


def test_a_request_failing_alone_after_its_first_token_is_not_retried(
    tokenizer: Tokenizer,
) -> None:
    """The engine's own error entry for a request that had tokens (its core died under it):
    UNAVAILABLE to the client, as for a Generate call, and no other engine tried."""

    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT), "fail_after_alone").start()
        other = await FakeEngine(tokenizer.encode(TEXT), "fail_after_alone").start()
        async with frontend_for([engine, other], tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "mid-request" in (caught.value.details() or "")
        assert len(engine.calls) + len(other.calls) == 1
        await engine.stop()
        await other.stop()

    run(body)


def test_closing_an_endpoint_ends_its_idle_call_without_waiting_out_the_grace(
    tokenizer: Tokenizer,
) -> None:
    """A request held by the engine keeps the call (and the channel) open through close();
    once it ends, close() returns, long before its grace of 10 minutes."""

    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT), hold_after=2).start()
        async with router_for([engine]) as router:
            [endpoint] = router.pool.available
            stop, outputs = EngineCallStop(), []
            reader = asyncio.create_task(read_all(router, engine_request("held"), stop, outputs))
            await wait_for(lambda: len(outputs) == 2)
            closing = asyncio.create_task(endpoint.close(grace_s=600.0))
            await wait_for(lambda: endpoint.mux.is_draining)
            assert not closing.done() and not reader.done() and engine.cancelled == []
            assert stop.request()
            await asyncio.wait_for(reader, 10)
            await asyncio.wait_for(closing, 10)
            # The engine aborts the request (the call's end would abort it, if the abort
            # itself had not gone out before).
            await wait_for(lambda: engine.cancelled == ["held"])
        assert engine.many_calls == 1
        await engine.stop()

    run(body)
