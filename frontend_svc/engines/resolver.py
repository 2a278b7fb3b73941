"""Engine targets (`host:port`, where host may be a DNS name for several pods, as a headless
Kubernetes service gives) to engine addresses, re-resolved periodically so pods that come
and go are added and removed."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


def parse_target(target: str) -> tuple[str, int]:
    """`host:port` or `[ipv6]:port` to (host, port); raises ValueError if malformed."""
    host, sep, port = target.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"engine address {target!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_target(host: str, port: int) -> set[str]:
    if is_ip_literal(host):
        return {format_address(host, port)}
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {format_address(str(info[4][0]), port) for info in infos}


class AddressResolver:
    """Resolves every target each `interval_s` and hands the union to `publish`. A target
    that fails to resolve keeps its last addresses: a DNS hiccup must not empty the pool."""

    def __init__(
        self, targets: Iterable[str], publish: Callable[[set[str]], None], interval_s: float
    ) -> None:
        self.targets = [parse_target(t) for t in targets]
        self.publish = publish
        self.interval_s = interval_s
        self.last_good: dict[tuple[str, int], set[str]] = {}

    async def resolve_once(self) -> set[str]:
        addresses: set[str] = set()
        for target in self.targets:
            try:
                self.last_good[target] = await resolve_target(*target)
            except OSError as error:
                logger.warning("cannot resolve %s: %s", format_address(*target), error)
            addresses |= self.last_good.get(target, set())
        self.publish(addresses)
        return addresses

    async def run(self) -> None:
        while True:
            await self.resolve_once()
            await asyncio.sleep(self.interval_s)
