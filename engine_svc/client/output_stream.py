"""One request's outputs on their way to the consumer (the gRPC stream). When the consumer
lags, pending outputs merge into one, so a slow stream costs one message, not one per step.
With a stream interval N (vLLM's `--stream-interval`), the consumer is woken for the first
token, then once N tokens are pending, and for the last output: fewer, larger messages
through the engine service, the frontend and the client, at the price of tokens arriving
in bursts of N."""

from __future__ import annotations

import asyncio

from engine_svc.messages import EngineCoreOutput


class RequestOutputStream:
    def __init__(self, request_id: str, stream_interval: int = 1) -> None:
        self.request_id = request_id
        self.stream_interval = stream_interval
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
            self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._ready.set()

    async def get(self) -> EngineCoreOutput:
        """The outputs since the last call, merged; raises the error once they are out."""
        await self._ready.wait()
        if self._pending is not None:
            output, self._pending = self._pending, None
            if self._error is None:
                self._ready.clear()
            self.is_done = output.finished
            return output
        self.is_done = True
        raise self._error or RuntimeError("the event is only ever set with an output or error")


def merge_into(earlier: EngineCoreOutput, later: EngineCoreOutput) -> None:
    """Fold `later` into `earlier`: tokens and logprobs append; the rest is the latest."""
    earlier.new_token_ids.extend(later.new_token_ids)
    if later.new_logprobs:
        earlier.new_logprobs = (earlier.new_logprobs or []) + later.new_logprobs
    earlier.finish_reason = later.finish_reason
    earlier.stop_reason = later.stop_reason
    earlier.num_cached_tokens = later.num_cached_tokens
    earlier.error = later.error
    earlier.times = earlier.times or later.times
