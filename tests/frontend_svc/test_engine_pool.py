"""Routing without servers: the least-loaded available engine takes each call, idle engines
take turns, failed engines are skipped, a full queue refuses work, and addresses resolve."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest

from frontend_svc.engines import resolver as resolver_module
from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.engines.pool import EnginePool
from frontend_svc.engines.resolver import AddressResolver, parse_target
from shared.engine_load import EngineLoad, RankLoad
from shared.errors import EngineOverloadedError, EngineUnavailableError


class FakeEndpoint(EngineEndpoint):
    """The real endpoint's bookkeeping, without its channel and background tasks."""

    def __init__(self, address: str, on_change: Callable[[], None]) -> None:
        self.address, self.on_change = address, on_change
        self.is_serving, self.suspended_until, self.refused = True, 0.0, None
        self.model_info, self.reported_load = None, None
        self.num_in_flight = self.num_picked = 0
        self.closed = False

    def start(self) -> None:
        pass

    async def close(self, grace_s: float | None = None) -> None:
        self.closed = True


def make_pool(addresses: list[str], max_waiting: int = 100) -> EnginePool:
    pool = EnginePool(FakeEndpoint, max_waiting)
    pool.set_addresses(addresses)
    return pool


def take(pool: EnginePool, **kwargs: Any) -> str:
    """Pick an engine and leave a call on it, as a request in flight would."""
    endpoint = pool.pick(**kwargs)
    endpoint.num_in_flight += 1
    endpoint.num_picked += 1
    return endpoint.address


def test_calls_spread_over_idle_engines_then_follow_the_load() -> None:
    pool = make_pool(["a:1", "b:1", "c:1"])
    assert sorted(take(pool) for _ in range(6)) == ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1"]
    pool.endpoints["b:1"].num_in_flight = 0
    assert take(pool) == "b:1"


def test_the_engines_report_counts_other_frontends_load_per_rank() -> None:
    pool = make_pool(["a:1", "b:1"])
    pool.endpoints["a:1"].reported_load = EngineLoad((RankLoad(6, 2, 0.0, 0),))
    pool.endpoints["b:1"].reported_load = EngineLoad(
        (RankLoad(3, 2, 0.0, 0), RankLoad(3, 2, 0.0, 0))
    )
    assert pool.pick().address == "b:1"  # 5 per rank against 8


def test_unhealthy_suspended_and_excluded_engines_are_skipped() -> None:
    pool = make_pool(["a:1", "b:1", "c:1"])
    pool.endpoints["a:1"].is_serving = False
    pool.endpoints["b:1"].suspend(60.0)
    assert pool.pick().address == "c:1"
    with pytest.raises(EngineUnavailableError):
        pool.pick(exclude=["c:1"])
    pool.endpoints["a:1"].is_serving = True
    assert pool.pick(exclude=["c:1"]).address == "a:1"
    pool.endpoints["a:1"].refused = "UNAUTHENTICATED: a valid bearer token is required"
    with pytest.raises(EngineUnavailableError):  # serving, but not to this frontend
        pool.pick(exclude=["c:1"])


def test_admission_refuses_when_the_queue_is_full_or_no_engine_serves() -> None:
    pool = make_pool(["a:1"], max_waiting=4)
    pool.admit(3)
    pool.admit(1)
    with pytest.raises(EngineOverloadedError):
        pool.admit(1)  # a fifth waiting request
    pool.answered(2)
    pool.admit(2)  # room again once engines answered
    assert pool.num_waiting == 4
    pool.endpoints["a:1"].reported_load = EngineLoad((RankLoad(0, 9, 0.0, 0),))
    pool.answered(4)
    with pytest.raises(EngineOverloadedError):
        pool.admit(1)  # other frontends' requests fill the engine's queue
    pool.endpoints["a:1"].is_serving = False
    with pytest.raises(EngineUnavailableError):
        pool.admit(1)


def test_addresses_that_stop_resolving_are_closed() -> None:
    async def body() -> None:
        pool = make_pool(["a:1", "b:1"])
        removed = pool.endpoints["a:1"]
        pool.set_addresses(["b:1", "c:1"])
        assert sorted(pool.endpoints) == ["b:1", "c:1"]
        await pool.close()
        assert removed.closed  # type: ignore[attr-defined]

    asyncio.run(body())


def test_targets_parse_and_names_resolve_to_every_address() -> None:
    assert parse_target("engine:50061") == ("engine", 50061)
    assert parse_target("[::1]:7") == ("::1", 7)
    for bad in ("engine", "engine:", ":5", "engine:99999"):
        with pytest.raises(ValueError):
            parse_target(bad)
    published: list[set[str]] = []
    resolver = AddressResolver(["localhost:7", "10.0.0.1:8"], published.append, 1.0)
    addresses = asyncio.run(resolver.resolve_once())
    assert "10.0.0.1:8" in addresses and "127.0.0.1:7" in addresses
    assert published == [addresses]


def test_a_failed_lookup_keeps_the_last_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = AddressResolver(["localhost:7"], lambda _: None, 1.0)
    first = asyncio.run(resolver.resolve_once())

    async def fail(host: str, port: int) -> set[str]:
        raise socket.gaierror("temporary failure in name resolution")

    monkeypatch.setattr(resolver_module, "resolve_target", fail)
    assert asyncio.run(resolver.resolve_once()) == first
