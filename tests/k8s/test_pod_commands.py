"""The pods' command lines, as the cpu overlay renders them (flags from the ConfigMaps, the
ConfigMaps' environment), run here on 127.0.0.1: the engine becomes SERVING on the default
model, the frontend becomes SERVING with the tokenizer it fetched from that engine (no model
of its own), and each exits 0 on SIGTERM well within its drain allowance. The cpu-secure
overlay's too, with TLS files and tokens where its Secrets would put them, through its exec
probes."""

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

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from tests.k8s.manifests import REPO_ROOT, Manifest, find, of_kind, pod_spec
from tests.service_processes import free_port
from tests.shared.tls_certs import make_authority

START_TIMEOUT_S = 300.0
EXIT_SLACK_S = 15.0
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _environment(manifests: list[Manifest], container: Manifest) -> dict[str, str]:
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


def _command(
    manifests: list[Manifest], deployment_name: str, overrides: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The container's args with $(VAR)s expanded, some flags replaced; and its environment."""
    container = pod_spec(find(manifests, "Deployment", deployment_name))["containers"][0]
    environment = _environment(manifests, container)
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
def _running(
    module: str, args: list[str], environment: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO_ROOT,
            env={**os.environ, **environment},
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


def _wait_serving(address: str, service: str, process: subprocess.Popen[bytes], log: Path) -> None:
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


def _stop(process: subprocess.Popen[bytes], allowance_s: float, log: Path) -> None:
    """SIGTERM, as the kubelet sends after preStop: exit 0 within the drain allowance."""
    process.send_signal(signal.SIGTERM)
    try:
        returncode = process.wait(timeout=allowance_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {allowance_s} s after SIGTERM:\n{log.read_text()[-3000:]}")
    assert returncode == 0, log.read_text()[-3000:]


@pytest.mark.default_model
def test_pod_command_lines_serve_and_drain(
    rendered: dict[str, list[Manifest]], default_model_dir: Path, tmp_path: Path
) -> None:
    manifests = rendered["cpu"]
    engine_port = free_port()
    engine_args, engine_env = _command(
        manifests,
        "duoserve-engine",
        {
            "--host": "127.0.0.1",
            "--port": str(engine_port),
            "--metrics-port": str(free_port()),
            "--model": str(default_model_dir),  # where the init container would put it
        },
    )
    engine_env["HOME"] = str(tmp_path)
    # The pod's thread count matches its CPU limit; this machine may have fewer cores.
    cores = len(os.sched_getaffinity(0))
    engine_env["OMP_NUM_THREADS"] = str(min(int(engine_env["OMP_NUM_THREADS"]), cores))
    engine_log = tmp_path / "engine.log"
    with _running("engine_svc", engine_args, engine_env, engine_log) as engine:
        _wait_serving(f"127.0.0.1:{engine_port}", "engine.v1.EngineCoreService", engine, engine_log)
        if (REPO_ROOT / "frontend_svc" / "__main__.py").is_file():
            frontend_port = free_port()
            frontend_args, frontend_env = _command(
                manifests,
                "duoserve-frontend",
                {
                    "--engine": f"127.0.0.1:{engine_port}",
                    "--host": "127.0.0.1",
                    "--port": str(frontend_port),
                    "--metrics-port": str(free_port()),
                },
            )
            frontend_env["HOME"] = str(tmp_path)
            frontend_log = tmp_path / "frontend.log"
            with _running("frontend_svc", frontend_args, frontend_env, frontend_log) as frontend:
                address = f"127.0.0.1:{frontend_port}"
                _wait_serving(address, "frontend.v1.GenerationService", frontend, frontend_log)
                _stop(
                    frontend, float(frontend_env["SHUTDOWN_GRACE_S"]) + EXIT_SLACK_S, frontend_log
                )
        _stop(engine, float(engine_env["SHUTDOWN_TIMEOUT_S"]) + EXIT_SLACK_S, engine_log)


def _remapped(args: list[str], folders: dict[str, Path], port: int) -> list[str]:
    """A probe's or a container's arguments with the Secrets' mount paths replaced by
    `folders` and the gRPC port of --address by `port`."""
    out = []
    for arg in args:
        for mount, folder in folders.items():
            arg = arg.replace(mount, str(folder))
        if arg.startswith("--address="):
            arg = f"--address=localhost:{port}"
        out.append(arg)
    return out


def _probe(command: list[str], log: Path) -> None:
    """Run an exec probe as the kubelet would, until it succeeds (the server starting)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    assert command[:2] == ["python", "-m"], command
    while True:
        done = subprocess.run(
            [sys.executable, *command[1:]], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        if done.returncode == 0:
            return
        assert time.monotonic() < deadline, f"{done.stdout}{done.stderr}\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _secure_command(
    manifests: list[Manifest], name: str, files: dict[str, Path], overrides: dict[str, str]
) -> tuple[list[str], dict[str, str], Manifest]:
    """A cpu-secure container's arguments (Secrets' files at `files`, on free ports), its
    environment, and the container itself (its probes)."""
    port = free_port()
    overrides = {"--host": "127.0.0.1", "--port": str(port),
                 "--metrics-port": str(free_port()), **overrides}  # fmt: skip
    args, environment = _command(manifests, name, overrides)
    container = pod_spec(find(manifests, "Deployment", name))["containers"][0]
    return _remapped(args, files, port), environment, container


def test_secure_pod_command_lines_serve_and_probe(
    rendered: dict[str, list[Manifest]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """cpu-secure's command lines with the files its Secrets would hold (a CA, a certificate
    per service as cert-manager issues it, the tokens): its exec probes pass, a call with a
    token goes through both services over TLS, one without is refused."""
    manifests = rendered["cpu-secure"]
    ca = make_authority(tmp_path, "duoserve-ca")
    auth = tmp_path / "auth"
    auth.mkdir()
    (auth / "client-tokens").write_text("client-token\n")
    (auth / "engine-token").write_text("engine-token\n")
    logs = {name: tmp_path / f"{name}.log" for name in ("engine", "frontend")}
    files = {
        name: {
            "/etc/duoserve/tls": ca.issue_secret(tmp_path / f"{name}-tls", [f"duoserve-{name}"]),
            "/etc/duoserve/auth": auth,
        }
        for name in logs
    }
    engine_args, engine_env, engine_container = _secure_command(
        manifests, "duoserve-engine", files["engine"], {"--model": str(tiny_model_dir)}
    )
    engine_env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1")
    engine_port = _port_of(engine_args)
    with _running("engine_svc", engine_args, engine_env, logs["engine"]) as engine:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = engine_container[probe]["exec"]["command"]
            _probe(_remapped(command, files["engine"], engine_port), logs["engine"])
        frontend_args, frontend_env, frontend_container = _secure_command(
            manifests, "duoserve-frontend", files["frontend"],
            {"--engine": f"127.0.0.1:{engine_port}"},
        )  # fmt: skip
        frontend_env["HOME"] = str(tmp_path)
        frontend_port = _port_of(frontend_args)
        with _running("frontend_svc", frontend_args, frontend_env, logs["frontend"]) as frontend:
            for probe in ("startupProbe", "readinessProbe"):
                command = frontend_container[probe]["exec"]["command"]
                _probe(_remapped(command, files["frontend"], frontend_port), logs["frontend"])
            trust = grpc.ssl_channel_credentials(ca.pem.cert.read_bytes())
            with grpc.secure_channel(f"localhost:{frontend_port}", trust) as channel:
                stub = frontend_pb2_grpc.GenerationServiceStub(channel)
                request = fpb.GenerateRequest(
                    prompt="Hello", sampling_params=fpb.SamplingParams(max_tokens=4)
                )
                token = (("authorization", "Bearer client-token"),)
                reply = stub.Generate(request, metadata=token, timeout=60)
                assert len(reply.choices[0].token_ids) == 4
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Generate(request, timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            grace_s = float(frontend_env["SHUTDOWN_GRACE_S"]) + EXIT_SLACK_S
            _stop(frontend, grace_s, logs["frontend"])
        _stop(engine, float(engine_env["SHUTDOWN_TIMEOUT_S"]) + EXIT_SLACK_S, logs["engine"])


def _port_of(args: list[str]) -> int:
    return int(next(a for a in args if a.startswith("--port=")).partition("=")[2])
