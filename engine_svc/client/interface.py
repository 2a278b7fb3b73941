"""The engine-core client interface that the in-process and multi-process clients share.

The asyncio clients (AsyncMPClient, DPAsyncMPClient) offer the same operations as
coroutines named `*_async`, plus `generate()`, which gives each request its own stream.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine_svc.messages import EngineCoreOutputs, EngineCoreRequest


@runtime_checkable
class EngineCoreClient(Protocol):
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (running the step in place, or waiting for it)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None: ...
