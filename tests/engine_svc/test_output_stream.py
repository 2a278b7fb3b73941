"""RequestOutputStream: a lagging consumer gets the pending outputs merged into one message;
OutputGroup: the streams of many requests read together, each wait handing over all that have
something."""

from __future__ import annotations

import asyncio

import pytest

from engine_svc.client.output_stream import OutputGroup, RequestOutputStream
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


def test_a_merged_message_keeps_the_field_a_failed_request_names() -> None:
    """A constraint that runs out ends its request naming the field (INVALID_ARGUMENT for gRPC
    callers); merged behind tokens a lagging reader had not taken, it must still name it."""

    async def body() -> None:
        stream = RequestOutputStream("r")
        stream.put(_output(1))
        prompt = [TokenLogprobs(7, -1.0, 3, [], [])]
        stream.put(EngineCoreOutput(request_id="r", new_token_ids=[2], prompt_logprobs=prompt))
        dead_end = EngineCoreOutput(
            request_id="r",
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            error="no token can follow",
            invalid_field="json_schema",
        )
        stream.put(dead_end)
        merged = await stream.get()
        assert merged.new_token_ids == [1, 2] and merged.prompt_logprobs == prompt
        assert merged.finish_reason == FinishReason.ERROR and merged.error == "no token can follow"
        assert merged.invalid_field == "json_schema"

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


def _in(request_id: str, token: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[token], finish_reason=finish)


def test_a_group_hands_over_every_stream_with_something_in_one_wait() -> None:
    async def body() -> None:
        group = OutputGroup()
        a, b, c = (RequestOutputStream(name, 1, group) for name in "abc")
        a.put(_in("a", 1))
        b.put(_in("b", 2))
        a.put(_in("a", 3))  # merged with a's first: a stream is handed over once a wait
        group.refuse("d", EngineDeadError("never added"))
        ready, refused = await group.wait()
        assert sorted(s.request_id for s in ready) == ["a", "b"]
        assert [s.take().new_token_ids for s in sorted(ready, key=lambda s: s.request_id)] == [
            [1, 3],
            [2],
        ]
        assert [(request_id, str(error)) for request_id, error in refused] == [("d", "never added")]
        assert group.is_empty
        waiter = asyncio.create_task(group.wait())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing new: c has had nothing yet
        c.put(_in("c", 4, FinishReason.STOP))
        ready, refused = await asyncio.wait_for(waiter, 1)
        assert [s.request_id for s in ready] == ["c"] and refused == []
        assert ready[0].take().finish_reason == FinishReason.STOP and ready[0].is_done

    asyncio.run(body())


def test_a_grouped_stream_hands_over_its_error_after_its_outputs() -> None:
    async def body() -> None:
        group = OutputGroup()
        stream = RequestOutputStream("r", 1, group)
        stream.put(_in("r", 7))
        stream.fail(EngineDeadError("gone"))
        [ready], _ = await group.wait()
        assert ready.take().new_token_ids == [7] and not ready.is_done
        [again], _ = await asyncio.wait_for(group.wait(), 1)  # the error is still to come
        with pytest.raises(EngineDeadError):
            again.take()
        assert again.is_done

    asyncio.run(body())


def test_a_grouped_stream_keeps_its_interval() -> None:
    async def body() -> None:
        group = OutputGroup()
        stream = RequestOutputStream("r", 3, group)
        stream.put(_in("r", 1))  # the first token goes at once
        [ready], _ = await group.wait()
        assert ready.take().new_token_ids == [1]
        stream.put(_in("r", 2))
        stream.put(_in("r", 3))
        assert group.is_empty  # two pending: under the interval
        stream.put(_in("r", 4))
        [ready], _ = await asyncio.wait_for(group.wait(), 1)
        assert ready.take().new_token_ids == [2, 3, 4]

    asyncio.run(body())
