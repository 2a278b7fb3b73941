"""`make run`'s launcher with the tiny model: one ready line once both services serve, the
command-line client answers (one-shot, streamed, chat), Ctrl-C stops both services, a
launcher killed with -9 leaves no service behind, and the frontend it starts serves TLS and
requires tokens when told to."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from frontend_svc.client import build_parser, sampling_params, score
from frontend_svc.client import main as client_main
from shared.frontend_protos import frontend_pb2 as pb
from shared.protos import engine_pb2, engine_pb2_grpc
from tests.process_tree import child_pids, descendants, is_alive
from tests.service_processes import REPO_ROOT, free_port, service_env
from tests.shared.tls_certs import make_authority

READY_TIMEOUT_S = 120.0


def wait_ready_line(launcher: subprocess.Popen[str]) -> str:
    assert launcher.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = launcher.stdout.readline()
        if line.startswith("ready:"):
            return line
        if not line and launcher.poll() is not None:
            raise AssertionError(f"the launcher exited with {launcher.returncode}")
    raise AssertionError(f"no ready line within {READY_TIMEOUT_S} s")


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def client(address: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "frontend_svc.client", "--address", address, *args]
    return subprocess.run(
        command, cwd=REPO_ROOT, input=stdin, capture_output=True, text=True, timeout=120
    )


def start_launcher(
    model_dir: Path, port: int, engine_port: int, *extra_args: str
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "frontend_svc.launcher", "--model", str(model_dir),
               "--port", str(port), "--engine-port", str(engine_port),
               "--engine-arg=--num-kv-blocks=256", *extra_args]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=service_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def stop_all(launcher: subprocess.Popen[str], pids: list[int], *, groups: bool) -> None:
    """Teardown whatever a test left: the launcher, then its services (`groups`: each in a
    session of its own, killed with its engine processes) or the processes listed."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait(timeout=10)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if groups else os.kill)(pid, signal.SIGKILL)


def test_the_launcher_serves_the_client_and_stops_both_on_ctrl_c(tiny_model_dir: Path) -> None:
    port, engine_port = free_port(), free_port()
    launcher = start_launcher(tiny_model_dir, port, engine_port)
    children: list[int] = []
    try:
        ready = wait_ready_line(launcher)
        children = child_pids(launcher.pid)
        address = f"127.0.0.1:{port}"
        assert address in ready
        # The interpreter that runs the services (the .venv's under make run) runs the client.
        assert f"Try: {sys.executable} -m frontend_svc.client" in ready

        streamed = client(address, "Tell me a story", "--stream", "--max-tokens", "8",
                          "--temperature", "0")  # fmt: skip
        unary = client(address, "Tell me a story", "--max-tokens", "8", "--temperature", "0")
        assert streamed.returncode == unary.returncode == 0, streamed.stderr + unary.stderr
        assert streamed.stdout == unary.stdout and streamed.stdout.strip()
        assert "8 completion tokens" in streamed.stderr
        chat = client(address, "--chat", "--max-tokens", "4", stdin="Hi there\nAnd again\n\n")
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.count("you> ") == 3
        one_turn = client(address, "--chat", "Hi there", "--max-tokens", "4", "--temperature", "0")
        assert one_turn.returncode == 0, one_turn.stderr
        assert "you> " not in one_turn.stdout and one_turn.stdout.strip()
        assert "4 completion tokens" in one_turn.stderr
        misuse = client(address, "A prompt", "--system", "You are brief.")
        assert misuse.returncode == 2 and "--system needs --chat" in misuse.stderr
        scored = client(address, "--score", "The capital of France is Paris.")
        assert scored.returncode == 0, scored.stderr
        *tokens, summary = scored.stdout.strip().splitlines()
        logprobs = [float(line.split("logprob")[1].split()[0]) for line in tokens]
        count, total = re.search(r"(\d+) tokens scored: total logprob (\S+),", summary).groups()
        assert int(count) == len(logprobs) > 0 and all(lp <= 0 for lp in logprobs)
        assert abs(float(total) - sum(logprobs)) < 1e-3 * len(logprobs)

        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
        assert not is_listening(port) and not is_listening(engine_port)
    finally:
        stop_all(launcher, children, groups=True)  # the services run in sessions of their own


def test_the_clients_flags_fill_the_sampling_params() -> None:
    args = build_parser().parse_args(
        ["Hi", "--max-tokens", "5", "--temperature", "0", "--stop", ".", "--stop", "!",
         "--bad-word", "hello", "--bad-word", "world", "--n", "2"]
    )  # fmt: skip
    params = sampling_params(args)
    assert (params.max_tokens, params.temperature, params.n) == (5, 0.0, 2)
    assert list(params.stop) == [".", "!"] and list(params.bad_words) == ["hello", "world"]
    assert not params.HasField("seed") and not params.HasField("top_p")


def test_services_stop_when_the_launcher_is_killed(tiny_model_dir: Path) -> None:
    port, engine_port = free_port(), free_port()
    launcher = start_launcher(tiny_model_dir, port, engine_port)
    processes: list[int] = []
    try:
        wait_ready_line(launcher)
        processes = descendants(launcher.pid)  # both services and the engine core process
        assert len(processes) >= 3
        launcher.kill()
        launcher.wait(timeout=10)
        # Each service sees its launcher gone and stops as on SIGTERM (nothing to drain).
        deadline = time.monotonic() + 60
        while any(is_alive(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in processes if is_alive(pid)] == []
        assert not is_listening(port) and not is_listening(engine_port)
    finally:
        stop_all(launcher, processes, groups=False)


def test_the_launcher_serves_tls_and_requires_a_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--tls-cert-file/--tls-key-file` and `--auth-token-file` go to the frontend, the public
    API; the launcher checks it over TLS, trusting the CA given; the engine stays on
    127.0.0.1 and requires a token of this launch. The client gets through with the CA and
    a token, and not without either."""
    ca = make_authority(tmp_path, "launcher-ca")
    frontend = ca.issue(tmp_path, "frontend", server=True)
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    port, engine_port = free_port(), free_port()
    launcher = start_launcher(
        tiny_model_dir, port, engine_port,
        "--tls-cert-file", str(frontend.cert), "--tls-key-file", str(frontend.key),
        "--probe-tls-ca-file", str(ca.pem.cert), "--auth-token-file", str(tokens),
    )  # fmt: skip
    children: list[int] = []
    try:
        ready = wait_ready_line(launcher)
        children = child_pids(launcher.pid)
        assert f"--tls-ca-file {ca.pem.cert}" in ready and "--auth-token-file" in ready
        address = f"127.0.0.1:{port}"
        trusting = ["--tls-ca-file", str(ca.pem.cert)]
        done = client(address, "Hello", "--max-tokens", "4", *trusting, "--auth-token-file",
                      str(tokens))  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        plaintext = client(address, "Hello", "--max-tokens", "4", "--auth-token-file", str(tokens))
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
        no_token = client(address, "Hello", "--max-tokens", "4", *trusting)
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
        # The engine, on 127.0.0.1, takes only the token made for this launch: no way
        # around the frontend's tokens.
        with grpc.insecure_channel(f"127.0.0.1:{engine_port}") as channel:
            stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
    finally:
        stop_all(launcher, children, groups=True)


def test_the_launcher_refuses_mutual_tls_it_cannot_probe(tmp_path: Path) -> None:
    ca = make_authority(tmp_path, "launcher-ca")
    frontend = ca.issue(tmp_path, "frontend", server=True)
    command = [sys.executable, "-m", "frontend_svc.launcher", "--tls-cert-file",
               str(frontend.cert), "--tls-key-file", str(frontend.key),
               "--tls-client-ca-file", str(ca.pem.cert)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--probe-tls-cert-file" in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "-1"], "argument --max-tokens: -1 is not in [1, 4294967295]"),
        (["--max-tokens", "many"], "argument --max-tokens: 'many' is not a whole number"),
        (["--n", str(2**32)], "argument --n: 4294967296 is not in [1, 4294967295]"),
        (["--seed", str(2**63)], f"argument --seed: {2**63} is not in"),
        (["--score", "--n", "2"], "--score scores the prompt once: no --n"),
        (["--timeout", "0"], "--timeout must be a number of seconds above 0"),
        (["--timeout", "nan"], "--timeout must be a number of seconds above 0"),
    ],
)
def test_the_client_refuses_what_a_request_cannot_carry_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        client_main(["Hi", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_scoring_a_one_token_prompt_says_there_is_nothing_to_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class OneTokenStub:  # the frontend's answer for a prompt of one token: no logprobs
        def Generate(self, request: pb.GenerateRequest, **_: object) -> pb.GenerateResponse:
            assert request.sampling_params.prompt_logprobs == 0
            return pb.GenerateResponse()

    args = build_parser().parse_args(["Hi", "--score"])
    args.auth_token = None  # main() reads it from --auth-token-file or the environment
    assert score(OneTokenStub(), args) == 1  # type: ignore[arg-type]
    out = capsys.readouterr()
    assert out.out == "" and "nothing to score" in out.err
