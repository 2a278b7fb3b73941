"""The engines this frontend routes to: endpoints come and go as addresses resolve, and the
least-loaded available one takes each new engine call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable

from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.messages import ModelInfo
from shared.errors import EngineOverloadedError, EngineUnavailableError

logger = logging.getLogger(__name__)

EndpointFactory = Callable[[str, Callable[[], None]], EngineEndpoint]
CLOSE_GRACE_S = 30.0  # an address that stops resolving keeps its channel for in-flight calls


class EnginePool:
    def __init__(self, make_endpoint: EndpointFactory, max_waiting_requests: int) -> None:
        self.make_endpoint = make_endpoint
        self.max_waiting_requests = max_waiting_requests
        self.endpoints: dict[str, EngineEndpoint] = {}
        self.num_unanswered = 0  # admitted choices whose engine has not answered yet
        self._listeners: list[asyncio.Event] = []
        self._closing: set[asyncio.Task[None]] = set()

    def subscribe(self) -> asyncio.Event:
        """An event of the caller's own, set whenever an engine comes, goes or changes
        health (the caller clears it)."""
        event = asyncio.Event()
        self._listeners.append(event)
        return event

    def notify(self) -> None:
        for event in self._listeners:
            event.set()

    def set_addresses(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for address in sorted(wanted - self.endpoints.keys()):
            logger.info("engine %s added", address)
            endpoint = self.make_endpoint(address, self.notify)
            self.endpoints[address] = endpoint
            endpoint.start()
        for address in sorted(self.endpoints.keys() - wanted):
            logger.info("engine %s removed", address)
            self._close_later(self.endpoints.pop(address), CLOSE_GRACE_S)
        self.notify()

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            self._close_later(endpoint, None)
        self.endpoints.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)

    @property
    def available(self) -> list[EngineEndpoint]:
        return [e for e in self.endpoints.values() if e.is_available]

    @property
    def model_info(self) -> ModelInfo | None:
        """What the engines serve (they serve one model): any available engine's answer."""
        infos = [e.model_info for e in self.available if e.model_info is not None]
        if infos:
            return infos[0]
        known = [e.model_info for e in self.endpoints.values() if e.model_info is not None]
        return known[0] if known else None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their first token: this frontend's, or what the engines
        report waiting (every frontend's, a poll late), whichever is more."""
        reported = sum(e.num_reported_waiting for e in self.available)
        return max(self.num_unanswered, reported)

    def admit(self, num_new: int) -> None:
        """Count `num_new` engine requests as waiting (`answered` uncounts them), or refuse
        them when the queue is full or no engine could take them. Check and count happen
        together, so a burst cannot slip past the limit."""
        if not self.available:
            raise EngineUnavailableError(self._no_engine_message())
        waiting = self.num_waiting
        if waiting + num_new > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"{waiting} requests are waiting for an engine; the limit is "
                f"{self.max_waiting_requests}"
            )
        self.num_unanswered += num_new

    def answered(self, num: int = 1) -> None:
        self.num_unanswered -= num

    def pick(self, exclude: Collection[str] = ()) -> EngineEndpoint:
        """The available engine with the lowest load per rank; among equals, the one picked
        least often, so idle engines take turns."""
        candidates = [e for e in self.available if e.address not in exclude]
        if not candidates:
            raise EngineUnavailableError(self._no_engine_message(exclude))
        return min(candidates, key=lambda e: (e.load_score, e.num_picked))

    def _no_engine_message(self, exclude: Collection[str] = ()) -> str:
        if not self.endpoints:
            return "no engine address resolved"
        if exclude:
            return f"no healthy engine left to try ({len(exclude)} failed)"
        return f"none of the {len(self.endpoints)} engines is healthy"

    def _close_later(self, endpoint: EngineEndpoint, grace_s: float | None) -> None:
        task = asyncio.create_task(endpoint.close(grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
