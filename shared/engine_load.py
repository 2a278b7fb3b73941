"""An engine's load, as both services see it: each data-parallel rank's queue and KV cache
(what an engine core reports, over ZMQ and in GetLoads), and the sum over an engine's ranks
that the frontend balances on."""

from __future__ import annotations

import dataclasses

import msgspec


class RankLoad(msgspec.Struct, array_like=True):
    """One rank's load, read when asked (scheduler stats ride on outputs only while busy)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_free_kv_blocks: int
    num_batches_in_flight: int = 0  # in the executor now (pipeline parallelism: up to PP)
    max_batches_in_flight: int = 0  # the most at once since the engine started


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """An engine service's ranks, in rank order."""

    ranks: tuple[RankLoad, ...]

    @property
    def num_ranks(self) -> int:
        return max(1, len(self.ranks))

    @property
    def num_running(self) -> int:
        return sum(rank.num_running for rank in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(rank.num_waiting for rank in self.ranks)
