"""What the asyncio client tells an observer about its requests (the engine service's metrics
listen): each request as it goes to a rank, each batch of outputs with the rank that sent it,
and each request it stops tracking (finished, rejected or failed). An observer's error is
logged and never disturbs the requests."""

from __future__ import annotations

import logging
from typing import Protocol

from engine_svc.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class RequestObserver(Protocol):
    def on_request_added(self, request: EngineCoreRequest, rank: int) -> None: ...

    def on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None: ...

    def on_request_gone(self, request_id: str) -> None: ...


class NullObserver:
    def on_request_added(self, request: EngineCoreRequest, rank: int) -> None:
        pass

    def on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        pass

    def on_request_gone(self, request_id: str) -> None:
        pass


class GuardedObserver:
    """Delegates to `observer`, logging (once per kind of call) instead of raising."""

    def __init__(self, observer: RequestObserver) -> None:
        self._observer = observer
        self._logged: set[str] = set()

    def on_request_added(self, request: EngineCoreRequest, rank: int) -> None:
        try:
            self._observer.on_request_added(request, rank)
        except Exception:
            self._log("on_request_added")

    def on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        try:
            self._observer.on_outputs(rank, outputs)
        except Exception:
            self._log("on_outputs")

    def on_request_gone(self, request_id: str) -> None:
        try:
            self._observer.on_request_gone(request_id)
        except Exception:
            self._log("on_request_gone")

    def _log(self, call: str) -> None:
        if call not in self._logged:
            self._logged.add(call)
            logger.exception("the request observer failed in %s (logged once)", call)
