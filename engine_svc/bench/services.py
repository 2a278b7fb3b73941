"""The engine and frontend services for a serving benchmark, started as their users start
them (`python -m engine_svc`, `python -m frontend_svc`) on free 127.0.0.1 ports, their logs
in a folder, stopped with SIGTERM (a drain) when the benchmark is done."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.parent_watch import parent_environment

STOP_TIMEOUT_S = 60.0
# The engine's log lines around its KV cache's background faulting-in (host_memory.py).
KV_FAULTING_IN = "KV cache faulting in:"
KV_FAULTED_IN = "KV cache faulted in:"


@dataclasses.dataclass(frozen=True)
class Addresses:
    frontend: str  # HOST:PORT of frontend.v1.GenerationService
    engine: str | None  # HOST:PORT of engine.v1.EngineCoreService, when known
    # Known when the benchmark started the services: their processes and the engine's metrics.
    engine_pid: int | None = None
    frontend_pid: int | None = None
    engine_metrics_url: str | None = None


@contextlib.contextmanager
def started(
    model: str, engine_args: list[str], log_dir: Path, timeout_s: float
) -> Iterator[Addresses]:
    """Both services; yields once the frontend is SERVING (it waits for the engine)."""
    engine_port, frontend_port, metrics_port = _free_port(), _free_port(), _free_port()
    engine = _start(
        "engine_svc", log_dir / "engine.log", "--model", model, "--port", str(engine_port),
        "--metrics-port", str(metrics_port), *engine_args,
    )  # fmt: skip
    processes = [engine]
    try:
        frontend = _start(
            "frontend_svc", log_dir / "frontend.log", "--engine", f"127.0.0.1:{engine_port}",
            "--port", str(frontend_port), "--metrics-port", str(_free_port()),
        )  # fmt: skip
        processes.append(frontend)
        address = f"127.0.0.1:{frontend_port}"
        wait_serving(address, "frontend.v1.GenerationService", processes, timeout_s, log_dir)
        yield Addresses(
            frontend=address,
            engine=f"127.0.0.1:{engine_port}",
            engine_pid=engine.pid,
            frontend_pid=frontend.pid,
            engine_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        )
    finally:
        for process in reversed(processes):
            _stop(process)


def wait_serving(
    address: str,
    service: str,
    processes: list[subprocess.Popen[bytes]],
    timeout_s: float,
    log_dir: Path | None = None,
) -> None:
    """Until the health service says SERVING; a process that exits, or the timeout, fails."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for process in processes:
                if process.poll() is not None:
                    where = f"; logs in {log_dir}" if log_dir else ""
                    raise RuntimeError(f"{process.args!r} exited {process.returncode}{where}")
            with contextlib.suppress(grpc.RpcError):
                request = health_pb2.HealthCheckRequest(service=service)
                if stub.Check(request, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"{service} at {address} not SERVING within {timeout_s} s")


def wait_kv_cache_faulted_in(engine_log: Path, timeout_s: float) -> None:
    """Until a CPU engine's KV cache is mapped in (engine_svc/worker/host_memory.py): it
    serves while a background thread faults the pages in, and on a fresh VM that took
    seconds in which the host backing the guest's memory slowed the first run by ~30%.
    Returns at once where the log announces no such thread (CUDA)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        text = engine_log.read_text(errors="replace")
        if KV_FAULTING_IN not in text or KV_FAULTED_IN in text:
            break
        time.sleep(0.2)
    else:
        print(f"the KV cache was still faulting in after {timeout_s} s: measuring anyway")
        return
    if KV_FAULTING_IN in text:
        print(f"KV cache faulted in {time.monotonic() - began:.1f} s after SERVING")


def _start(module: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the engine's processes go with it
            # A benchmark killed before its `finally` (SIGKILL) still stops them: they
            # watch it and drain once it is gone (shared/parent_watch.py).
            env=parent_environment(),
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def engine_core_pid(service_pid: int) -> int:
    """The engine-core process the engine service spawned (its busy loop)."""
    for child in Path(f"/proc/{service_pid}/task/{service_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise RuntimeError(f"no engine-core process under {service_pid}")
