"""The frontend's requests to an engine share one GenerateMany call (engines/multiplexer.py),
against scripted engines: every choice of every request goes over the one call; a call that
ends fails what is on it and the next request opens another; closing an endpoint ends its
idle call at once instead of holding the channel for its grace; messages stay within the
engine's size limit, a request too big for it failing alone; only an engine that never says
it serves GenerateMany gets its requests on calls of their own, and it is asked again after
an outage."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from frontend_svc.engines import multiplexer
from frontend_svc.engines.convert import to_generate_request
from frontend_svc.engines.router import EngineCallStop
from frontend_svc.messages import EngineOutput, EngineRequest, SamplingOptions
from frontend_svc.tokenizer import Tokenizer
from shared.errors import EngineUnavailableError, MessageTooLargeError
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


async def _engine_taking(max_message_bytes: int, tokenizer: Tokenizer) -> FakeEngine:
    """A started engine that takes messages of at most this many bytes, and says so."""
    engine = FakeEngine(tokenizer.encode(TEXT))
    engine.max_message_bytes = max_message_bytes
    return await engine.start()


def _prompt_request(request_id: str, num_tokens: int) -> EngineRequest:
    sampling = SamplingOptions(max_tokens=3, temperature=0.0)
    prompt = tuple(1000 + i for i in range(num_tokens))
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def test_messages_stay_within_the_engines_limit_and_a_request_over_it_fails_alone(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine takes messages of 3,000 bytes at most and says so; the frontend batches up
    to 2,000 (MAX_MESSAGE_BYTES, lowered here). Six requests of ~830 bytes go out two to a
    message, one of ~2,400 alone, and one of ~4,000 fails on its own with RESOURCE_EXHAUSTED,
    as its own Generate call would, without taking the engine out. Sent as one message,
    they would end the call for all eight."""
    monkeypatch.setattr(multiplexer, "MAX_MESSAGE_BYTES", 2000)

    async def body() -> None:
        engine = await _engine_taking(3000, tokenizer)
        async with router_for([engine]) as router:
            [endpoint] = router.pool.available
            requests = [_prompt_request(f"fits-{i}", 400) for i in range(6)]
            requests += [_prompt_request("alone", 1200), _prompt_request("too-big", 2000)]
            outputs: list[list[EngineOutput]] = [[] for _ in requests]
            results = await asyncio.gather(
                *(
                    read_all(router, r, EngineCallStop(), into)
                    for r, into in zip(requests, outputs, strict=True)
                ),
                return_exceptions=True,
            )
            assert endpoint.is_available  # the request's fault, not the engine's
        assert results[:7] == [None] * 7
        assert [sum(len(o.new_token_ids) for o in out) for out in outputs[:7]] == [3] * 7
        assert isinstance(results[7], MessageTooLargeError)  # no other engine tried
        assert "over the engine's limit of 3000 a message" in str(results[7])
        sizes = engine.message_sizes
        assert max(sizes) <= 3000 and len(sizes) >= 4 and any(s > 2000 for s in sizes)
        assert engine.many_calls == 1
        await engine.stop()

    run(body)


def test_an_engine_that_never_says_it_serves_generate_many_gets_calls_of_their_own(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GenerateMany call that brings no marker and stays open (a server, or a proxy, that
    took the call but does not serve it): after the wait, the request goes on a Generate
    call of its own instead of waiting for ever."""
    monkeypatch.setattr(multiplexer, "MARKERLESS_STATUS_WAIT_S", 0.1)

    async def body() -> None:
        engine = FakeEngine(tokenizer.encode(TEXT))
        engine.marker = False
        await engine.start()
        async with router_for([engine]) as router:
            outputs: list[EngineOutput] = []
            await read_all(router, engine_request("alone"), EngineCallStop(), outputs)
            [endpoint] = router.pool.available
            assert not endpoint.mux.is_supported
        assert sum(len(o.new_token_ids) for o in outputs) == len(tokenizer.encode(TEXT))
        assert [r.request_id for r in engine.calls] == ["alone"]
        await engine.stop()

    run(body)


def test_unimplemented_after_the_marker_is_an_engine_fault_not_a_missing_method(
    tokenizer: Tokenizer,
) -> None:
    """A call that said it serves GenerateMany and then ends UNIMPLEMENTED (a proxy's answer
    mid-call): its requests were sent, so they fail as on any broken call (retriable before
    their first token) and are not replayed on Generate calls of their own."""

    async def body() -> None:
        engine = await FakeEngine(tokenizer.encode(TEXT), "unimplemented_later").start()
        async with router_for([engine]) as router:
            [endpoint] = router.pool.available
            with pytest.raises(EngineUnavailableError, match="the call ended UNIMPLEMENTED"):
                await read_all(router, engine_request("sent"), EngineCallStop(), [])
            assert endpoint.mux.is_supported
        assert engine.calls == [] and engine.many_calls == 1
        await engine.stop()

    run(body)


def test_an_engine_without_generate_many_is_asked_again_after_an_outage(
    tokenizer: Tokenizer,
) -> None:
    """Back after an outage, an engine may be a newer version (a rolling upgrade)."""

    async def body() -> None:
        engine = FakeEngine(tokenizer.encode(TEXT))
        engine.multiplexed = False
        await engine.start()
        async with router_for([engine]) as router:
            await read_all(router, engine_request("before"), EngineCallStop(), [])
            [endpoint] = router.pool.available
            assert not endpoint.mux.is_supported
            await engine.set_serving(False)
            await wait_for(lambda: not endpoint.is_serving)
            await engine.set_serving(True)
            await wait_for(lambda: endpoint.is_serving)
            assert endpoint.mux.is_supported
        assert [r.request_id for r in engine.calls] == ["before"]
        await engine.stop()

    run(body)


def test_a_call_ended_by_its_own_writer_leaves_the_next_call_its_requests(
    tokenizer: Tokenizer,
) -> None:
    """A draining multiplexer whose only request is too big for the engine: refusing it
    drains the call, which its writer then ends itself. A request started after that opens
    the next call and is served there."""

    async def body() -> None:
        engine = await _engine_taking(3000, tokenizer)
        async with router_for([engine]) as router:
            [endpoint] = router.pool.available
            mux = endpoint.mux
            mux.drain()
            too_big = mux.start(to_generate_request(_prompt_request("too-big", 2000)), None)
            with pytest.raises(MessageTooLargeError):
                async for _ in too_big.responses():
                    pass
            await wait_for(lambda: not mux.is_open)
            small = mux.start(to_generate_request(_prompt_request("small", 10)), None)
            tokens = [t async for r in small.responses() for t in r.token_ids]
        assert len(tokens) == 3
        assert engine.many_calls == 2 and [r.request_id for r in engine.calls] == ["small"]
        await engine.stop()

    run(body)
