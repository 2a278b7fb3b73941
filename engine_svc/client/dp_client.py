"""The data-parallel client: one engine process per rank, each request to the least-loaded."""

from __future__ import annotations

from engine_svc.client.async_client import AsyncMPClient
from engine_svc.config import EngineConfig
from engine_svc.messages import EngineCoreRequest


class DPAsyncMPClient(AsyncMPClient):
    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        shutdown_timeout_s: float = 0.0,
        log_level: str = "INFO",
    ) -> None:
        super().__init__(config, shutdown_timeout_s, log_level, num_ranks=data_parallel_size)

    def _select_rank(self, request: EngineCoreRequest) -> int:
        # This client is the only one feeding these ranks, so its own count of unfinished
        # requests is exact and current, where the engines' stats are a step old.
        return min(range(self.num_ranks), key=lambda rank: (self.num_unfinished[rank], rank))


def make_async_client(
    config: EngineConfig,
    data_parallel_size: int = 1,
    shutdown_timeout_s: float = 0.0,
    log_level: str = "INFO",
) -> AsyncMPClient:
    if data_parallel_size == 1:
        return AsyncMPClient(config, shutdown_timeout_s, log_level)
    return DPAsyncMPClient(config, data_parallel_size, shutdown_timeout_s, log_level)
