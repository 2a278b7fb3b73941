"""The rendezvous store a one-machine engine's executor serves for its worker ranks
(collectives.host_rendezvous): its port is bound from the moment it is chosen until the
store is gone, it listens on the rendezvous address alone, and ranks reach it as clients."""

from __future__ import annotations

import errno
import gc
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from engine_svc.distributed.collectives import RENDEZVOUS_TIMEOUT, host_rendezvous

LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == LISTEN:
                found.append(address)
    return found


def _bind_fails(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            assert error.errno == errno.EADDRINUSE
            return True
        return False


def test_the_port_stays_bound_while_the_store_lives_and_is_released_with_it() -> None:
    store = host_rendezvous("127.0.0.1", 2)
    port = store.port
    assert port > 0
    assert _bind_fails(port)  # nobody can take it before the ranks arrive
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
    del client, store
    gc.collect()
    assert not _bind_fails(port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_store_listens_on_loopback_only() -> None:
    store = host_rendezvous("127.0.0.1", 1)
    # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex), not 00000000 (every interface).
    assert _listening_addresses(store.port) == ["0100007F"]


def test_a_host_name_is_served_where_it_resolves() -> None:
    store = host_rendezvous("localhost", 2)
    client = dist.TCPStore("localhost", store.port, 2, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
