"""RequestOutputStream: a lagging consumer gets the pending outputs merged into one message."""

from __future__ import annotations

import asyncio

import pytest

from engine_svc.client.output_stream import RequestOutputStream
from engine_svc.messages import EngineCoreOutput, FinishReason, TokenLogprobs
from shared.errors import EngineDeadError


def _output(token: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    logprobs = [TokenLogprobs(token, -0.5, 1, [token], [-0.5])]
    return EngineCoreOutput(
        request_id="r", new_token_ids=[token], new_logprobs=logprobs, finish_reason=finish
    )


def test_a_lagging_consumer_gets_one_merged_message() -> None:
    async def body() -> None:
        stream = RequestOutputStream("r")
        for token in (1, 2, 3):
            stream.put(_output(token))
        stream.put(_output(4, FinishReason.LENGTH))
        merged = await stream.get()
        assert merged.new_token_ids == [1, 2, 3, 4]
        assert [lp.token_id for lp in merged.new_logprobs or []] == [1, 2, 3, 4]
        assert merged.finish_reason == FinishReason.LENGTH
        assert stream.is_done

    asyncio.run(body())


def test_outputs_already_produced_come_before_the_error() -> None:
    async def body() -> None:
        stream = RequestOutputStream("r")
        stream.put(_output(7))
        stream.fail(EngineDeadError("gone"))
        assert (await stream.get()).new_token_ids == [7]
        assert not stream.is_done
        with pytest.raises(EngineDeadError):
            await stream.get()
        assert stream.is_done

    asyncio.run(body())


def test_get_waits_for_the_next_output() -> None:
    async def body() -> None:
        stream = RequestOutputStream("r")
        waiter = asyncio.create_task(stream.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        stream.put(_output(5))
        assert (await asyncio.wait_for(waiter, 1)).new_token_ids == [5]

    asyncio.run(body())


def test_an_interval_wakes_the_reader_for_the_first_token_every_n_and_the_last() -> None:
    async def body() -> None:
        stream = RequestOutputStream("r", stream_interval=3)
        stream.put(_output(1))
        assert (await asyncio.wait_for(stream.get(), 1)).new_token_ids == [1]
        waiter = asyncio.create_task(stream.get())
        for token in (2, 3):
            stream.put(_output(token))
            await asyncio.sleep(0)  # the reader runs, and finds nothing ready
            assert not waiter.done()
        stream.put(_output(4))
        assert (await asyncio.wait_for(waiter, 1)).new_token_ids == [2, 3, 4]
        stream.put(_output(5, FinishReason.LENGTH))  # the last goes out at once
        last = await asyncio.wait_for(stream.get(), 1)
        assert last.new_token_ids == [5] and stream.is_done

    asyncio.run(body())


def test_an_error_is_not_held_back_by_the_interval() -> None:
    async def body() -> None:
        stream = RequestOutputStream("r", stream_interval=8)
        stream.put(_output(1))
        await stream.get()
        stream.put(_output(2))
        stream.fail(EngineDeadError("gone"))
        assert (await asyncio.wait_for(stream.get(), 1)).new_token_ids == [2]
        with pytest.raises(EngineDeadError):
            await stream.get()

    asyncio.run(body())
