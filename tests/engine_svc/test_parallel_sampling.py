"""vLLM's n > 1 on its gRPC contract: the children a request fans out to, and their outputs
merged into one stream, driven by a scripted generate() in the test's own event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine_svc.sampling_params import SamplingParams
from engine_svc.server.vllm_compat.parallel_sampling import MAX_N, child_requests, merged_outputs
from shared.errors import InvalidRequestError


def request(seed: int | None = None) -> EngineCoreRequest:
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=seed)
    return EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=params)


def test_children_are_named_and_seeded_as_vllm_does() -> None:
    children = child_requests(request(seed=10), 3)
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.prompt_token_ids == [1, 2] for c in children)
    assert [c.sampling_params.seed for c in child_requests(request(), 2)] == [None, None]
    assert child_requests(request(seed=10), 1) == [request(seed=10)]  # n = 1: itself


@pytest.mark.parametrize(
    ("seed", "n", "field"),
    [(None, 0, "sampling_params.n"), (None, MAX_N + 1, "sampling_params.n"),
     (2**63 - 2, 3, "sampling_params.seed")],
)  # fmt: skip
def test_bad_n_and_seeds_past_the_bound_are_refused(seed: int | None, n: int, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        child_requests(request(seed), n)
    assert caught.value.field == field


class ScriptedEngine:
    """generate(): each child emits its tokens when the test releases them."""

    def __init__(self, fail: str | None = None) -> None:
        self.released: dict[str, asyncio.Queue[int | None]] = {}
        self.closed: list[str] = []
        self.fail = fail

    def queue(self, request_id: str) -> asyncio.Queue[int | None]:
        return self.released.setdefault(request_id, asyncio.Queue())

    async def generate(self, child: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        if child.request_id == self.fail:
            raise InvalidRequestError("prompt_token_ids", "refused")
        try:
            while (token := await self.queue(child.request_id).get()) is not None:
                yield EngineCoreOutput(request_id=child.request_id, new_token_ids=[token])
            yield EngineCoreOutput(
                request_id=child.request_id, new_token_ids=[], finish_reason=FinishReason.LENGTH
            )
        finally:
            self.closed.append(child.request_id)


def test_outputs_interleave_with_their_index_and_the_merge_ends_with_the_last_child() -> None:
    async def body() -> list[tuple[int, list[int], bool]]:
        engine = ScriptedEngine()
        children = child_requests(request(), 2)
        for request_id, tokens in (("1_r", [7]), ("0_r", [5, 6]), ("1_r", [8, None])):
            for token in tokens:
                engine.queue(request_id).put_nowait(token)
        seen = []
        merged = merged_outputs(engine.generate, children)
        async for index, output in merged:
            seen.append((index, output.new_token_ids, output.finished))
            if len(seen) == 5:
                engine.queue("0_r").put_nowait(None)  # the last child finishes only now
        assert sorted(engine.closed) == ["0_r", "1_r"]
        return seen

    seen = asyncio.run(asyncio.wait_for(body(), 10))
    assert [s for s in seen if s[0] == 0] == [(0, [5], False), (0, [6], False), (0, [], True)]
    assert [s for s in seen if s[0] == 1] == [(1, [7], False), (1, [8], False), (1, [], True)]


def test_closing_the_merge_closes_every_child_and_a_failure_ends_it() -> None:
    async def body() -> None:
        engine = ScriptedEngine()
        engine.queue("0_r").put_nowait(5)
        merged = merged_outputs(engine.generate, child_requests(request(), 3))
        index, output = await anext(merged)
        assert (index, output.new_token_ids) == (0, [5])
        await merged.aclose()  # the call was cancelled
        assert sorted(engine.closed) == ["0_r", "1_r", "2_r"]  # each aborts its request

        failing = ScriptedEngine(fail="1_r")
        with pytest.raises(InvalidRequestError):
            async for _ in merged_outputs(failing.generate, child_requests(request(), 3)):
                pass
        assert sorted(failing.closed) == ["0_r", "2_r"]

    asyncio.run(asyncio.wait_for(body(), 10))
