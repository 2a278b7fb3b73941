"""The frontend against scripted engines, in one event loop: retries before the first token,
UNAVAILABLE after it, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, and every way a request ends
early (stop string, client cancel, deadline) cancels the engine call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from frontend_svc.engines import router
from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.engines.pool import EnginePool
from frontend_svc.server.app import DEFAULT_MAX_MESSAGE_BYTES, build_server
from frontend_svc.server.servicer import GenerationServicer
from frontend_svc.service import Frontend
from frontend_svc.tokenizer import Tokenizer
from shared.frontend_protos import frontend_pb2 as pb
from shared.frontend_protos import frontend_pb2_grpc
from tests.frontend_svc.fake_engine import FakeEngine, free_port

pytestmark = pytest.mark.usefixtures("engine_call_kind")

TEXT = " one two three four five six seven eight nine ten" * 20


def run(body: Callable[[], Awaitable[Any]], timeout_s: float = 30.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(body(), timeout_s)

    return asyncio.run(bounded())


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def wait_num_healthy(
    stub: frontend_pb2_grpc.GenerationServiceStub, expected: int, timeout_s: float = 10.0
) -> None:
    """Waits until the frontend itself (GetModelInfo) counts `expected` healthy engines: an
    engine's health change reaches it through a watch, some time after the engine's."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)
        if info.num_healthy_engines == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {timeout_s} s the frontend counts {info.num_healthy_engines} healthy "
                f"engines, not {expected}"
            )
        await asyncio.sleep(0.02)


@asynccontextmanager
async def frontend_for(
    engines: list[FakeEngine],
    tokenizer: Tokenizer,
    max_waiting: int = 100,
    num_serving: int = -1,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[frontend_pb2_grpc.GenerationServiceStub]:
    """A frontend (pool, servicer, gRPC server) on the engines; yields a client stub once
    `num_serving` engines (default: all) are seen healthy."""
    pool = EnginePool(lambda a, on_change: EngineEndpoint(a, 0.1, on_change), max_waiting)
    pool.set_addresses([e.address for e in engines])
    port = free_port()
    servicer = GenerationServicer(Frontend(pool, tokenizer), max_message_bytes=max_message_bytes)
    server, _ = build_server(servicer, "127.0.0.1", port, max_message_bytes)
    await server.start()
    expected = len(engines) if num_serving < 0 else num_serving
    await wait_for(lambda: len(pool.available) == expected)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield frontend_pb2_grpc.GenerationServiceStub(channel)
        # However requests ended, none is still counted as waiting (admission would leak).
        await wait_for(lambda: pool.num_unanswered == 0)
    finally:
        await server.stop(grace=None)
        await pool.close()


def request(max_tokens: int = 5, **sampling: Any) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return pb.GenerateRequest(prompt="Hello", sampling_params=params)


@pytest.fixture(scope="module")
def tokens(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


def test_an_engine_failing_before_the_first_token_is_retried_on_another(
    tokenizer: Tokenizer, tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failed engine stays out for the whole test, however long its requests take (by
    # default it comes back after a couple of seconds, and a slow run would try it again).
    monkeypatch.setattr(router, "SUSPEND_AFTER_FAILURE_S", 3600.0)

    async def body() -> None:
        bad = await FakeEngine(tokens, "fail_before").start()
        good = await FakeEngine(tokens).start()
        async with frontend_for([bad, good], tokenizer) as stub:
            for _ in range(3):
                response = await stub.Generate(request(), timeout=10)
                assert response.choices[0].text == " one two three four five"
        # The failed engine was tried once, then left out while suspended.
        assert (len(bad.calls), len(good.calls)) == (1, 3)
        await bad.stop()
        await good.stop()

    run(body)


def test_an_engine_failing_after_the_first_token_ends_the_request_unavailable(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        # Two engines that both fail after their first token: a retry would reach the other.
        engine = await FakeEngine(tokens, "fail_after").start()
        other = await FakeEngine(tokens, "fail_after").start()
        async with frontend_for([engine, other], tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "mid-request" in (caught.value.details() or "")
            texts = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for response in stub.GenerateStream(request(), timeout=10):
                    texts.append(response.choices[0].text)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert texts == [" one"]
        assert len(engine.calls) + len(other.calls) == 2  # one call a request: no retry
        await engine.stop()
        await other.stop()

    run(body)


def test_a_request_the_engine_fails_alone_is_internal_and_the_engine_stays_in(
    tokenizer: Tokenizer, tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were the engine suspended for it, it would stay out for the whole test.
    monkeypatch.setattr(router, "SUSPEND_AFTER_FAILURE_S", 3600.0)

    async def body() -> None:
        failing = await FakeEngine(tokens, "error").start()
        healthy = await FakeEngine(tokens).start()
        async with frontend_for([failing, healthy], tokenizer) as stub:
            codes = []
            for _ in range(4):  # equal loads: the two engines take turns
                try:
                    async for _response in stub.GenerateStream(request(), timeout=10):
                        pass
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
                    assert error.details() == (
                        f"engine {failing.address} failed the request: "
                        "RuntimeError: a fault this request met"
                    )
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert sorted(codes, key=str) == [grpc.StatusCode.INTERNAL] * 2 + [grpc.StatusCode.OK] * 2
        # Each request went to one engine only (not retried on the other), and the failing
        # engine kept its turns (not suspended).
        assert (len(failing.calls), len(healthy.calls)) == (2, 2)
        assert info.num_healthy_engines == 2
        await failing.stop()
        await healthy.stop()

    run(body)


def test_no_healthy_engine_is_unavailable(tokenizer: Tokenizer, tokens: list[int]) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokens).start()
        async with frontend_for([engine], tokenizer) as stub:
            await engine.set_serving(False)
            await wait_num_healthy(stub, 0)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            await engine.set_serving(True)
            await wait_num_healthy(stub, 1)
            assert (await stub.Generate(request(), timeout=10)).choices[0].text
        await engine.stop()

    run(body)


def test_too_many_waiting_requests_is_resource_exhausted(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokens, "hang").start()
        async with frontend_for([engine], tokenizer, max_waiting=2) as stub:
            calls = [stub.GenerateStream(request()) for _ in range(2)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            await wait_for(lambda: len(engine.calls) == 2)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            await wait_for(lambda: len(engine.cancelled) == 2)
        await engine.stop()

    run(body)


def test_the_deadline_reaches_the_engine(tokenizer: Tokenizer, tokens: list[int]) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokens, "hang").start()
        async with frontend_for([engine], tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=1.0)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: len(engine.cancelled) == 1)
        await engine.stop()

    run(body)


def test_a_stop_string_cancels_the_engine_call_at_once(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        # Each stream stops short of max_tokens and holds: only the frontend's cancel ends it.
        engine = await FakeEngine(tokens, hold_after=10).start()
        async with frontend_for([engine], tokenizer) as stub:
            stop_request = request(max_tokens=200, stop=["ee fo"], n=2)
            response = await stub.Generate(stop_request, timeout=10)
            assert [c.text for c in response.choices] == [" one two thr"] * 2
            assert [c.stop_string for c in response.choices] == ["ee fo"] * 2
            assert [len(c.token_ids) for c in response.choices] == [4, 4]
            await wait_for(lambda: len(engine.cancelled) == 2)
        await engine.stop()

    run(body)


def test_a_client_cancelling_mid_stream_cancels_the_engine_call(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        # The stream holds after a few tokens: it is mid-stream whenever the client cancels.
        engine = await FakeEngine(tokens, hold_after=3).start()
        async with frontend_for([engine], tokenizer) as stub:
            call = stub.GenerateStream(request(max_tokens=200))
            first = await call.read()
            assert isinstance(first, pb.GenerateResponse) and first.choices[0].token_ids
            call.cancel()
            await wait_for(lambda: len(engine.cancelled) == 1)
        await engine.stop()

    run(body)


def test_engine_input_errors_pass_through_naming_the_field(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokens, "invalid").start()
        async with frontend_for([engine], tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == "sampling_params.top_p: bad"
            # Bad input says nothing about the engine's health: it is not taken out.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await engine.stop()

    run(body)


def test_a_response_over_the_message_limit_names_the_sizes_and_streaming_still_serves(
    tokenizer: Tokenizer, tokens: list[int]
) -> None:
    async def body() -> None:
        engine = await FakeEngine(tokens).start()
        async with frontend_for([engine], tokenizer, max_message_bytes=512) as stub:
            whole = request(max_tokens=len(tokens))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(whole, timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "message limit of 512 bytes" in (caught.value.details() or "")
            assert "GenerateStream" in (caught.value.details() or "")
            texts = [r.choices[0].text async for r in stub.GenerateStream(whole, timeout=10)]
            assert "".join(texts) == TEXT
        await engine.stop()

    run(body)
