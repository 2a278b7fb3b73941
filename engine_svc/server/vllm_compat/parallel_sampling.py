"""A request for n output sequences, as vLLM serves it: n engine requests on the same
prompt, their outputs merged into one stream whose chunks and completes carry each
sequence's index.

As vLLM's parallel sampling names and seeds them: child i is request "{i}_{request_id}",
with n = 1, and a seeded request's child i samples with seed + i, so the n sequences differ
yet each is reproducible on its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

import msgspec

from engine_svc.messages import EngineCoreOutput, EngineCoreRequest
from engine_svc.sampling_params import SEED_BOUND
from shared.errors import InvalidRequestError

MAX_N = 128  # as the frontend's n

Generate = Callable[[EngineCoreRequest], AsyncGenerator[EngineCoreOutput, None]]


def child_requests(request: EngineCoreRequest, n: int) -> list[EngineCoreRequest]:
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError("sampling_params.n", f"must be in [1, {MAX_N}]")
    seed = request.sampling_params.seed
    if seed is not None and seed + n > SEED_BOUND:  # child i samples with seed + i
        raise InvalidRequestError("sampling_params.seed", "seed + n must be at most 2^63")
    if n == 1:
        return [request]
    children = []
    for index in range(n):
        params = request.sampling_params
        if seed is not None:
            params = msgspec.structs.replace(params, seed=seed + index)
        child_id = f"{index}_{request.request_id}"
        children.append(
            msgspec.structs.replace(request, request_id=child_id, sampling_params=params)
        )
    return children


async def merged_outputs(
    generate: Generate, children: list[EngineCoreRequest]
) -> AsyncGenerator[tuple[int, EngineCoreOutput], None]:
    """(index, output) of every child's outputs as they come. The first failure of any child
    is raised; closing the merge early (the call was cancelled) closes every child's
    generator, which aborts its request in the engine."""
    queue: asyncio.Queue[tuple[int, EngineCoreOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, child: EngineCoreRequest) -> None:
        try:
            async with contextlib.aclosing(generate(child)) as outputs:
                async for output in outputs:
                    queue.put_nowait((index, output))
        except Exception as error:
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, child)) for i, child in enumerate(children)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
