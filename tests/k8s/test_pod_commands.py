"""The pods' command lines, as the cpu overlay renders them (flags from the ConfigMaps, the
ConfigMaps' environment), run here on 127.0.0.1: the engine becomes SERVING on the default
model, the frontend becomes SERVING with the tokenizer it fetched from that engine (no model
of its own), and each exits 0 on SIGTERM well within its drain allowance. The cpu-secure
overlay's too, with TLS files and tokens where its Secrets would put them, through its exec
probes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from tests.k8s.manifests import REPO_ROOT, Manifest, find, pod_spec
from tests.k8s.pod_runs import (
    EXIT_SLACK_S,
    START_TIMEOUT_S,
    command_of,
    running,
    stop,
    wait_serving,
)
from tests.service_processes import free_port
from tests.shared.tls_certs import make_authority


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
    with running("engine_svc", engine_args, engine_env, engine_log) as engine:
        wait_serving(f"127.0.0.1:{engine_port}", "engine.v1.EngineCoreService", engine, engine_log)
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
            with running("frontend_svc", frontend_args, frontend_env, frontend_log) as frontend:
                address = f"127.0.0.1:{frontend_port}"
                wait_serving(address, "frontend.v1.GenerationService", frontend, frontend_log)
                stop(frontend, float(frontend_env["SHUTDOWN_GRACE_S"]) + EXIT_SLACK_S, frontend_log)
        stop(engine, float(engine_env["SHUTDOWN_TIMEOUT_S"]) + EXIT_SLACK_S, engine_log)


def _command(
    manifests: list[Manifest], deployment_name: str, overrides: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    container = pod_spec(find(manifests, "Deployment", deployment_name))["containers"][0]
    return command_of(manifests, container, overrides)


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
    with running("engine_svc", engine_args, engine_env, logs["engine"]) as engine:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = engine_container[probe]["exec"]["command"]
            _probe(_remapped(command, files["engine"], engine_port), logs["engine"])
        frontend_args, frontend_env, frontend_container = _secure_command(
            manifests, "duoserve-frontend", files["frontend"],
            {"--engine": f"127.0.0.1:{engine_port}"},
        )  # fmt: skip
        frontend_env["HOME"] = str(tmp_path)
        frontend_port = _port_of(frontend_args)
        with running("frontend_svc", frontend_args, frontend_env, logs["frontend"]) as frontend:
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
            stop(frontend, grace_s, logs["frontend"])
        stop(engine, float(engine_env["SHUTDOWN_TIMEOUT_S"]) + EXIT_SLACK_S, logs["engine"])


def _port_of(args: list[str]) -> int:
    return int(next(a for a in args if a.startswith("--port=")).partition("=")[2])
