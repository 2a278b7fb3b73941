"""What the services expose, checked on running processes and on the code: with no --host,
every listening TCP socket of the engine and the frontend (gRPC and metrics, every process
of theirs) is on 127.0.0.1; the engine's ZMQ sockets are Unix sockets in a folder only this
user can enter, with no TCP socket besides; and no code sends pickle across a process
boundary (no pickle module, no multiprocessing queues, pipes or managers)."""

from __future__ import annotations

import ast
import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_processes import REPO_ROOT, ServiceProcess, wait_all_serving

PACKAGES = ("engine_svc", "frontend_svc", "shared")
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp
PICKLING = {"pickle", "cPickle", "cloudpickle", "dill", "shelve"}
PICKLING_MULTIPROCESSING = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Manager", "Pool"}


class DefaultHostProcess(ServiceProcess):
    """A service started without --host, so it binds what it binds by default."""

    def __init__(self, log_path: Path, module: str, *args: str) -> None:
        self._start(log_path, module, *args, host=None)


@pytest.fixture(scope="module")
def services(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServiceProcess]]:
    logs = tmp_path_factory.mktemp("exposure")
    engine = DefaultHostProcess(
        logs / "engine.log", "engine_svc", "--model", str(tiny_model_dir), "--num-kv-blocks", "64"
    )
    frontend = DefaultHostProcess(logs / "frontend.log", "frontend_svc", "--engine", engine.address)
    wait_all_serving([engine, frontend])
    yield [engine, frontend]
    for service in (frontend, engine):
        service.stop()


def test_every_listening_socket_is_on_loopback(services: list[ServiceProcess]) -> None:
    for service in services:
        inodes = _socket_inodes(_process_tree(service.process.pid))
        listening = [
            (address, port)
            for address, port, state, inode in _tcp_sockets()
            if inode in inodes and state == TCP_LISTEN
        ]
        ports = {port for _, port in listening}
        assert {service.port, service.metrics_port} <= ports, listening
        assert {address for address, _ in listening} == {"127.0.0.1"}, listening


def test_the_engines_zmq_sockets_are_private_unix_sockets(services: list[ServiceProcess]) -> None:
    engine = services[0]
    pids = _process_tree(engine.process.pid)
    assert len(pids) >= 2  # the gRPC server process and its engine core
    inodes = _socket_inodes(pids)
    paths = [path for path, inode in _unix_sockets() if inode in inodes and path]
    ipc = [Path(p) for p in paths if Path(p).name.startswith(("input-", "output"))]
    assert ipc, paths
    for path in ipc:
        folder = path.parent.stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    # Its only TCP listeners are gRPC and metrics: ZMQ over tcp:// would add some.
    tcp = [entry for entry in _tcp_sockets() if entry[3] in inodes]
    assert {port for _, port, state, _ in tcp if state == TCP_LISTEN} == {
        engine.port,
        engine.metrics_port,
    }


def test_no_code_pickles_across_processes() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                for name in _imported_names(node):
                    root, _, leaf = name.partition(".")
                    if root in PICKLING or (
                        root == "multiprocessing" and leaf in PICKLING_MULTIPROCESSING
                    ):
                        found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in PICKLING_MULTIPROCESSING
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("multiprocessing", "mp", "context", "ctx")
                ):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} .{node.attr}")
    assert found == []


def _imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def _process_tree(pid: int) -> list[int]:
    found = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        found += _process_tree(int(child))
    return found


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _tcp_sockets() -> list[tuple[str, int, str, int]]:
    """(local address, local port, state, inode) of every IPv4 and IPv6 TCP socket."""
    entries = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address_hex, port_hex = fields[1].split(":")
            entries.append(
                (_address(address_hex, family), int(port_hex, 16), fields[3], int(fields[9]))
            )
    return entries


def _address(address_hex: str, family: socket.AddressFamily) -> str:
    raw = bytes.fromhex(address_hex)
    # The kernel prints each 32-bit word in host byte order.
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    text = socket.inet_ntop(family, packed)
    return text.removeprefix("::ffff:") if family == socket.AF_INET6 else text


def _unix_sockets() -> list[tuple[str, int]]:
    """(path, inode) of every Unix socket; the path is "" for unnamed ones."""
    entries = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        entries.append((fields[7] if len(fields) > 7 else "", int(fields[6])))
    return entries
