"""Utility calls in flight to the engines (load, reset the prefix cache): a future per call
id, settled when the engine's UTILITY_RESULT arrives or failed all together."""

from __future__ import annotations

import asyncio
import itertools

from engine_svc.control_messages import UtilityCall, UtilityMethod, UtilityResult, UtilityValue
from shared.errors import EngineUnavailableError


class PendingUtilityCalls:
    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count()

    def new_call(
        self, method: UtilityMethod, max_steps: int | None = None
    ) -> tuple[UtilityCall, asyncio.Future[UtilityResult]]:
        call = UtilityCall(next(self._call_ids), method, max_steps)
        future: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = future
        return call, future

    def settle(self, result: UtilityResult) -> None:
        future = self._futures.pop(result.call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def fail_all(self, error: Exception) -> None:
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)


def unwrap(result: UtilityResult, method: UtilityMethod, rank: int) -> UtilityValue:
    """The value of a call, or the error the engine reported, raised."""
    if result.unavailable:
        raise EngineUnavailableError("the engine is shutting down")
    if result.error is not None:
        raise RuntimeError(f"{method.name} failed in engine core {rank}: {result.error}")
    return result.value


def as_steps(value: UtilityValue) -> int:
    """A bounded RESUME's answer: the steps the rank ran."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a bounded RESUME answered {value!r}")
    return value
