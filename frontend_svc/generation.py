"""One client request in flight: n engine requests (one per choice) whose outputs are merged
into a stream of updates, and aborted as soon as they are no longer wanted (a stop string
matched, the client went away, the deadline passed, another choice failed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator

from frontend_svc.choice import ChoiceState
from frontend_svc.detokenizer import Decoder
from frontend_svc.engines.router import EngineCallStop, EngineRouter
from frontend_svc.messages import (
    ChoiceDelta,
    EngineOutput,
    EngineRequest,
    GenerationUpdate,
    TokenLogprobs,
    Usage,
)
from shared.errors import EngineDeadError

# What a choice's pump puts on the queue: an engine output, the error that ended the engine
# call, or None once the call ended normally.
_QueueItem = tuple[int, EngineOutput | Exception | None]


def choice_request(request: EngineRequest, index: int, suffix: str) -> EngineRequest:
    """The engine call of choice `index`. Clients choose request ids and may reuse them: the
    suffix keeps engine ids unique."""
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-{index}-{suffix}",
        sampling=request.sampling.for_choice(index),
    )


class Generation:
    """`request`: the client's request, validated and tokenized (its own id, all n choices)."""

    def __init__(self, request: EngineRequest, router: EngineRouter, decoder: Decoder) -> None:
        self.request = request
        self.router = router
        self.choices = [
            ChoiceState(i, decoder, request.sampling) for i in range(request.sampling.n)
        ]
        self.queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self.pumps: list[asyncio.Task[None]] = []
        self.stops = [EngineCallStop() for _ in self.choices]
        self.unanswered: set[int] = set()  # choices admitted that have no engine output yet
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # until an update carries them

    @property
    def is_finished(self) -> bool:
        return all(choice.is_finished for choice in self.choices)

    @property
    def usage(self) -> Usage:
        # n choices share one prompt: it counts once, and the prefix cache serves the copies.
        return Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=sum(choice.num_tokens for choice in self.choices),
            cached_tokens=max(choice.num_cached_tokens for choice in self.choices),
        )

    async def updates(self, deadline: float | None) -> AsyncGenerator[GenerationUpdate, None]:
        """Each update carries what every choice produced since the previous one: outputs
        that queued up while the consumer was busy are merged into one update."""
        pool = self.router.pool
        pool.admit(len(self.choices))  # raises when overloaded, or when no engine serves
        self.unanswered = set(range(len(self.choices)))
        suffix = uuid.uuid4().hex[:8]
        self.pumps = [
            asyncio.create_task(self._pump(i, choice_request(self.request, i, suffix), deadline))
            for i in range(len(self.choices))
        ]
        try:
            while not self.is_finished:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                for index, item in items:
                    self._apply(index, item)
                deltas = [d for d in (c.take_delta() for c in self.choices) if d is not None]
                usage = self.usage if self.is_finished else None
                if deltas or usage is not None:
                    prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
                    yield GenerationUpdate(
                        request_id=self.request.request_id,
                        choices=deltas,
                        usage=usage,
                        prompt_logprobs=prompt_logprobs,
                    )
        finally:
            pool.answered(len(self.unanswered))
            self.unanswered.clear()
            # Cancelling an engine call aborts the engine request.
            for index in range(len(self.pumps)):
                self._stop(index)
            await asyncio.gather(*self.pumps, return_exceptions=True)

    async def _pump(self, index: int, request: EngineRequest, deadline: float | None) -> None:
        try:
            outputs = self.router.generate(request, deadline, self.stops[index])
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    self.queue.put_nowait((index, output))
        except Exception as error:
            self.queue.put_nowait((index, error))
        else:
            self.queue.put_nowait((index, None))

    def _apply(self, index: int, item: EngineOutput | Exception | None) -> None:
        if index in self.unanswered:
            self.unanswered.discard(index)
            self.router.pool.answered()
        choice = self.choices[index]
        if choice.is_finished:
            return  # outputs (or errors) that raced with a stop string
        if isinstance(item, Exception):
            raise item
        if item is None:
            raise EngineDeadError("the engine ended a request without a finish reason")
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = list(item.prompt_logprobs)
        if choice.add(item):
            self._stop(index)  # a stop string matched: abort the engine request now

    def _stop(self, index: int) -> None:
        """Ends choice `index`'s engine call: the call itself cancelled, so the pump ends on
        its own (EngineCallStop says why), or the pump cancelled where no call is in flight."""
        pump = self.pumps[index]
        if not pump.done() and not self.stops[index].request():
            pump.cancel()


async def collect(updates: AsyncGenerator[GenerationUpdate, None]) -> GenerationUpdate:
    """The whole result of a stream of updates, one delta per choice."""
    request_id = ""
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    merged: dict[int, ChoiceDelta] = {}
    async with contextlib.aclosing(updates):
        async for update in updates:
            request_id, usage = update.request_id, update.usage or usage
            prompt_logprobs = update.prompt_logprobs or prompt_logprobs
            for delta in update.choices:
                whole = merged.setdefault(delta.index, ChoiceDelta(index=delta.index))
                whole.text += delta.text
                whole.token_ids += delta.token_ids
                whole.logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
    choices = [merged[index] for index in sorted(merged)]
    return GenerationUpdate(
        request_id=request_id, choices=choices, usage=usage, prompt_logprobs=prompt_logprobs
    )
