"""The services as subprocesses on free 127.0.0.1 ports, for every test that runs them: the
engine service (and how to talk to it) and the frontend, free ports, bounded waits.

Every wait is bounded; `stop()` kills a service's whole process group (engines included).
The services' temporary folders (their engines' IPC sockets) go under one folder of this
test session's, removed when it ends: a service killed with SIGKILL cannot remove its own.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


_handed_out: set[int] = set()

SERVICE_TMPDIR = Path(tempfile.mkdtemp(prefix="duoserve-tests-"))
atexit.register(shutil.rmtree, SERVICE_TMPDIR, ignore_errors=True)


def service_env(**extra: str) -> dict[str, str]:
    """The environment for a service a test starts: this one, with TMPDIR in the session's
    folder (removed at exit, whatever the test does to the service), and `extra`."""
    return {**os.environ, "TMPDIR": str(SERVICE_TMPDIR), **extra}


# Under pytest-xdist (make test) each worker hands out ports of its own blocks of PORT_BLOCK
# only, so that two workers never give the same port to services started at the same time.
PORT_BLOCK = 8


def _port_share() -> tuple[int, int]:
    """(this worker's index, the number of workers); (0, 1) outside pytest-xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return (int(worker[2:]) if worker.startswith("gw") else 0), max(count, 1)


def _is_ours(port: int) -> bool:
    index, count = _port_share()
    return (port // PORT_BLOCK) % count == index


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on that this process has not handed out before: the
    kernel may give the port a closed probe socket had to the very next probe, and a service
    once got the same port for its gRPC API and its metrics (bind failed: in use)."""
    for _ in range(10_000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out and _is_ours(port):
            _handed_out.add(port)
            return port
    raise AssertionError("no free port left that this process has not handed out")


def three_free_ports() -> int:
    """A free port whose next two are free too (a multi-node engine's node 0 takes them),
    all three in one of this worker's blocks."""
    for _ in range(100):
        base = free_port()
        in_block = (base + 2) // PORT_BLOCK == base // PORT_BLOCK
        if in_block and base + 2 < 65536 and all(_bindable(base + i) for i in (1, 2)):
            _handed_out.update((base + 1, base + 2))
            return base
    raise AssertionError("no three consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServiceProcess:
    # How the helpers below reach the service: plaintext unless a test serves TLS.
    credentials: grpc.ChannelCredentials | None = None

    def __init__(self, model_dir: Path, log_path: Path, *extra_args: str) -> None:
        self._start(log_path, "engine_svc", "--model", str(model_dir),
                    "--num-kv-blocks", "256", "--log-level", "INFO", *extra_args)  # fmt: skip

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, self.credentials)

    def _start(
        self, log_path: Path, module: str, *args: str, host: str | None = "127.0.0.1"
    ) -> None:
        """`python -m module` on free 127.0.0.1 ports (its API and its metrics), in a
        session of its own so that teardown can kill the engines with the server. With
        `host` None, no --host: the service binds its default."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        bind = [] if host is None else ["--host", host]
        command = [sys.executable, "-m", module, *bind, "--port", str(self.port),
                   "--metrics-port", str(self.metrics_port), *args]  # fmt: skip
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=service_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def health(self, timeout_s: float = 2.0) -> int:
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"service exited ({self.process.returncode}):\n{self.log()}")
            try:
                if self.health(timeout_s=1.0) == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"service not SERVING within {timeout_s} s:\n{self.log()}")

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            message = f"service still running after {timeout_s} s:\n{self.log()}"
            raise AssertionError(message) from error

    def num_requests(self) -> int:
        """Requests running or waiting in the engine, over every rank."""
        return sum(load.num_running + load.num_waiting for load in self._loads())

    def num_running(self) -> int:
        """Requests scheduled (holding KV blocks) in the engine, over every rank."""
        return sum(load.num_running for load in self._loads())

    def _loads(self) -> list[pb.RankLoad]:
        with self.channel() as channel:
            loads = engine_pb2_grpc.EngineCoreServiceStub(channel).GetLoads(
                pb.GetLoadsRequest(), timeout=5
            )
        return list(loads.loads)

    def generation_tokens_total(self) -> int:
        """The engine's own count of tokens it generated (vllm:generation_tokens_total)."""
        return int(self.metric_total("vllm:generation_tokens_total"))

    def wait_health(self, status: int, timeout_s: float = 15.0) -> int:
        """The service's health once it reports `status`, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while self.health() != status and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.health()

    def metric_total(self, name: str, **labels: str) -> float:
        """The sum of the service's samples named `name` with these label values."""
        text = scrape_metrics(self.metrics_url)
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def metric_total_reaching(
        self, name: str, expected: float, timeout_s: float = 10.0, **labels: str
    ) -> float:
        """metric_total once it reaches `expected`, or at the deadline. A server counts a call
        after its status has gone out, so the client can see the status before the count."""
        deadline = time.monotonic() + timeout_s
        total = self.metric_total(name, **labels)
        while total < expected and time.monotonic() < deadline:
            time.sleep(0.01)
            total = self.metric_total(name, **labels)
        return total

    def pause(self) -> bool:
        """Pause generation (PauseGeneration returns once no rank schedules any more).
        True if some request is in the engine then: it gains no token until resume()."""
        with self.channel() as channel:
            stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
            stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
        return self.num_requests() > 0

    def resume(self) -> None:
        with self.channel() as channel:
            stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
            stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)

    @contextlib.contextmanager
    def paused(self, timeout_s: float = 30.0) -> Iterator[bool]:
        """Generation paused for the block; yields pause()'s answer. On the way out, waits
        until the engine holds no request (whatever the block did to end one reached it),
        then resumes."""
        try:
            yield self.pause()
            self.wait_idle(timeout_s)
        finally:
            self.resume()

    def tokens_of_a_request_ended_while_paused(self, end: Callable[[], object]) -> int:
        """The tokens this engine generated (its own count) for a request that `end` ends
        (a cancel, an abort, a client gone) with the engine paused: `end()` pauses it, sends
        the request, lets it run step by step (step_until) until the client has what it
        waits for, ends the request, and resumes once the engine is idle. A paused engine
        adds no token, so the count cannot run on to the request's end before the abort
        arrives, however loaded the machine."""
        before = self.settled_generation_tokens()
        end()
        return self.settled_generation_tokens() - before

    def step_until(self, condition: Callable[[], bool], max_steps: int = 300) -> int:
        """With generation paused: lets the engine run a step at a time until `condition()`
        holds, checked before each step; returns the steps the engine ran (a step asked for
        while it holds no request runs none). A condition that waits a little for what a
        step produced to reach the client (an event's wait) spares extra steps."""
        steps_run = 0
        for _ in range(max_steps):
            if condition():
                return steps_run
            steps_run += self.step()
        raise AssertionError(f"not there after {max_steps} engine steps")

    def step_while(self, read: Callable[[], object]) -> int:
        """With generation paused and a request sent: runs `read` (a client call that
        blocks until it has the stream's first messages) in a thread, and lets the engine
        run a step at a time until it returns; returns the steps the engine ran."""
        done = threading.Event()
        failures: list[BaseException] = []

        def reader() -> None:
            try:
                read()
            except BaseException as error:
                failures.append(error)
            finally:
                done.set()

        thread = threading.Thread(target=reader, name="stream reader", daemon=True)
        thread.start()
        steps = self.step_until(lambda: done.wait(0.2))
        thread.join(timeout=30)
        if failures:
            raise failures[0]
        return steps

    def step(self, num_steps: int = 1) -> int:
        """With generation paused: exactly `num_steps` engine steps (ResumeGeneration with
        max_steps, which returns once the engine paused itself again and sent the steps'
        tokens), fewer if the requests end first (none if the engine holds none). Returns
        the steps run (the most any rank ran)."""
        with self.channel() as channel:
            stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
            request = pb.ResumeGenerationRequest(max_steps=num_steps)
            response = stub.ResumeGeneration(request, timeout=60)
        return max(response.steps_run, default=0)

    def generate_in_steps_until_idle(self, max_steps: int = 300, wait_s: float = 0.2) -> int:
        """With generation paused and a request inside that something outside the engine
        ends once it sees the tokens (a stop string the frontend finds, a gateway whose write
        fails on its client's closed connection): lets the engine run a step at a time and
        waits up to `wait_s` after each step for the end to arrive (an abort reaches a
        paused engine), until the engine holds no request. Returns the steps the engine ran:
        how far the request got depends on the steps its end took, not on the machine's
        speed. An end that arrives during the last step's forward drops that step's token."""
        return self.step_until(lambda: self._idle_within(wait_s), max_steps)

    def settled_generation_tokens(self, timeout_s: float = 30.0) -> int:
        """generation_tokens_total once the engine is idle and the count has stopped moving
        (the last steps' stats may still be on the way)."""
        self.wait_idle(timeout_s)
        deadline = time.monotonic() + timeout_s
        count = self.generation_tokens_total()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            settled, count = count, self.generation_tokens_total()
            if settled == count:
                return count
        raise AssertionError(f"the engine's token count still moved after {timeout_s} s")

    def wait_idle(self, timeout_s: float) -> None:
        assert self._idle_within(timeout_s), f"the engine still had requests after {timeout_s} s"

    def _idle_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.num_requests() != 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def engine_pids(self) -> list[int]:
        """The spawned engine-core processes (not multiprocessing's resource tracker)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children if b"spawn_main" in _cmdline(int(c))]

    def stop(self) -> None:
        if self.process.poll() is None or _group_alive(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


class FrontendProcess(ServiceProcess):
    """`python -m frontend_svc` in a session of its own, before `engines`; health, waits and
    stop() as for the engine service."""

    def __init__(self, engines: list[str], log_path: Path, *extra_args: str) -> None:
        self._start(log_path, "frontend_svc", "--engine", *engines,
                    "--engine-poll-interval", "0.2", *extra_args)  # fmt: skip


def wait_all_serving(processes: list[ServiceProcess]) -> None:
    """Started together, waited for together; on failure every process is stopped."""
    try:
        for process in processes:
            process.wait_serving()
    except BaseException:
        for process in processes:
            process.stop()
        raise


def start_service(model_dir: Path, log_path: Path, *extra_args: str) -> ServiceProcess:
    service = ServiceProcess(model_dir, log_path, *extra_args)
    try:
        service.wait_serving()
    except BaseException:
        service.stop()
        raise
    return service


def tree_rss_bytes(pid: int) -> int:
    """The resident memory of a process and all its descendants (a service and its engines)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            continue  # it ended meanwhile
        rss_kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
        total += int(rss_kib) * 1024
    return total


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- asyncio calls ---------------------------------------------------------------------------


def run_async(body: Callable[[], Awaitable[Any]], timeout_s: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(body(), timeout_s)

    return asyncio.run(bounded())


def engine_stub(channel: grpc.aio.Channel) -> engine_pb2_grpc.EngineCoreServiceStub:
    return engine_pb2_grpc.EngineCoreServiceStub(channel)


def generate_request(
    request_id: str, prompt: list[int], max_tokens: int, **sampling: Any
) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, **sampling),
    )


class StreamResult:
    """What one Generate stream gave: its tokens, finish reason, or the status it ended with."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
        self.num_messages = 0
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.first_message = asyncio.Event()
        self.ended_at: float | None = None  # when the stream ended (reported by some tests)


async def consume(stub: engine_pb2_grpc.EngineCoreServiceStub, request: pb.GenerateRequest,
                  result: StreamResult) -> StreamResult:  # fmt: skip
    try:
        async for response in stub.Generate(request):
            result.token_ids.extend(response.token_ids)
            result.num_messages += 1
            result.first_message.set()
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = response.finish_reason
    except grpc.aio.AioRpcError as error:
        result.code, result.details = error.code(), error.details() or ""
    finally:
        result.ended_at = time.monotonic()
    return result


def scrape_metrics(url: str) -> str:
    """A /metrics endpoint's exposition text."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def frozen_at_start(log_path: Path, what: str) -> int:
    """How many objects the process that logged `what` froze out of garbage collection when
    it started (shared/gc_heap.py's line in its log); 0 if it logged none."""
    pattern = re.compile(rf"{re.escape(what)} started: (\d+) objects frozen")
    found = pattern.findall(log_path.read_text(errors="replace"))
    return int(found[-1]) if found else 0
