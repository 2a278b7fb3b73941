"""One request's outputs on their way to the consumer (the gRPC stream). When the consumer
lags, pending outputs merge into one, so a slow stream costs one message, not one per step.
With a stream interval N (vLLM's `--stream-interval`), the consumer is woken for the first
token, then once N tokens are pending, and for the last output: fewer, larger messages
through the engine service, the frontend and the client, at the price of tokens arriving
in bursts of N. Streams in an OutputGroup are read together (GenerateMany): one wait hands
over every stream that has something, so one message can carry a step for all of them."""

from __future__ import annotations

import asyncio

from engine_svc.messages import EngineCoreOutput


class OutputGroup:
    """Many requests' streams read as one: `wait` returns each stream with an output or an
    error to hand over (its `take` then returns or raises it), and the errors of requests
    that never got a stream."""

    def __init__(self) -> None:
        self._ready: dict[str, RequestOutputStream] = {}
        self._refused: list[tuple[str, Exception]] = []
        self._event = asyncio.Event()

    @property
    def is_empty(self) -> bool:
        return not (self._ready or self._refused)

    def notify(self, stream: RequestOutputStream) -> None:
        self._ready[stream.request_id] = stream
        self._event.set()

    def refuse(self, request_id: str, error: Exception) -> None:
        self._refused.append((request_id, error))
        self._event.set()

    def wake(self) -> None:
        """End the pending wait with nothing (the caller has other news to check)."""
        self._event.set()

    async def wait(self) -> tuple[list[RequestOutputStream], list[tuple[str, Exception]]]:
        await self._event.wait()
        self._event.clear()
        ready, self._ready = list(self._ready.values()), {}
        refused, self._refused = self._refused, []
        return ready, refused


class RequestOutputStream:
    def __init__(
        self, request_id: str, stream_interval: int = 1, group: OutputGroup | None = None
    ) -> None:
        self.request_id = request_id
        self.stream_interval = stream_interval
        self.group = group
        self._released_first = False
        self._pending: EngineCoreOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.is_done = False  # the consumer got the last output, or the error

    def put(self, output: EngineCoreOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            merge_into(self._pending, output)
        pending = self._pending
        if (
            not self._released_first
            or len(pending.new_token_ids) >= self.stream_interval
            or pending.finished
            or pending.error is not None
        ):
            self._released_first = True
            self._set_ready()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._set_ready()

    async def get(self) -> EngineCoreOutput:
        """The outputs since the last call, merged; raises the error once they are out."""
        await self._ready.wait()
        return self.take()

    def take(self) -> EngineCoreOutput:
        """What `get` returns, once the stream is ready (its group handed it over)."""
        if self._pending is not None:
            output, self._pending = self._pending, None
            if self._error is None:
                self._ready.clear()
            elif self.group is not None:
                self.group.notify(self)  # the error is still to hand over
            self.is_done = output.finished
            return output
        self.is_done = True
        raise self._error or RuntimeError("the event is only ever set with an output or error")

    def _set_ready(self) -> None:
        self._ready.set()
        if self.group is not None:
            self.group.notify(self)


def merge_into(earlier: EngineCoreOutput, later: EngineCoreOutput) -> None:
    """Fold `later` into `earlier`: tokens and logprobs append; the rest is the latest."""
    earlier.new_token_ids.extend(later.new_token_ids)
    if later.new_logprobs:
        earlier.new_logprobs = (earlier.new_logprobs or []) + later.new_logprobs
    if later.prompt_logprobs is not None:
        earlier.prompt_logprobs = later.prompt_logprobs
    earlier.finish_reason = later.finish_reason
    earlier.stop_reason = later.stop_reason
    earlier.num_cached_tokens = later.num_cached_tokens
    earlier.error = later.error
    earlier.invalid_field = later.invalid_field
    earlier.times = earlier.times or later.times
