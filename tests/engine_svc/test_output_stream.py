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
