"""Running a pod's container as the kubelet would, here on 127.0.0.1: its args with the
$(VARIABLES) expanded from its ConfigMaps and environment (some flags replaced, such as the
ports), in a session of its own; waiting for it to serve; stopping it as a pod stops."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.kernels import loader
from tests.k8s.manifests import REPO_ROOT, Manifest, of_kind
from tests.service_processes import service_env

START_TIMEOUT_S = 300.0
EXIT_SLACK_S = 15.0
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def environment_of(manifests: list[Manifest], container: Manifest) -> dict[str, str]:
    """What a container's environment holds: its ConfigMaps' data, then its own `env`."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        values.update(
            next(
                m["data"] for m in of_kind(manifests, "ConfigMap") if m["metadata"]["name"] == name
            )
        )
    values.update({variable["name"]: variable["value"] for variable in container.get("env", [])})
    return values


def command_of(
    manifests: list[Manifest],
    container: Manifest,
    overrides: dict[str, str],
    injected: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The container's args with $(VAR)s expanded, some flags replaced; and its environment,
    with what a controller would add to it (`injected`)."""
    environment = {**environment_of(manifests, container), **(injected or {})}
    args = []
    for arg in container["args"]:
        flag, equals, value = arg.partition("=")
        if not equals:
            args.append(flag)  # a switch such as --no-request-metrics
            continue
        value = overrides.get(flag, _VARIABLE.sub(lambda m: environment[m.group(1)], value))
        args.append(f"{flag}={value}")
    return args, environment


@contextlib.contextmanager
def running(
    module: str, args: list[str], environment: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    # The engine image's own environment: its kernels built in at /opt/duoserve-kernels. Here,
    # the ones `make kernels` built; else every pod start would compile them again.
    image = {loader.CACHE_ENV: str(loader.cache_root())}
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO_ROOT,
            env=service_env(**image, **environment),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so teardown reaches the engine's own processes too
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def wait_serving(address: str, service: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, (
                f"exited {process.returncode}:\n{log.read_text()[-3000:]}"
            )
            with contextlib.suppress(grpc.RpcError):
                request = health_pb2.HealthCheckRequest(service=service)
                if stub.Check(request, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.5)
    pytest.fail(f"{service} not SERVING within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen[bytes], allowance_s: float, log: Path) -> None:
    """SIGTERM, as the kubelet sends after preStop: exit 0 within the drain allowance."""
    process.send_signal(signal.SIGTERM)
    try:
        returncode = process.wait(timeout=allowance_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {allowance_s} s after SIGTERM:\n{log.read_text()[-3000:]}")
    assert returncode == 0, log.read_text()[-3000:]
