"""`make run`'s launcher with the tiny model: one ready line once both services serve, the
command-line client answers (one-shot, streamed, chat), and Ctrl-C stops both services."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.service_processes import REPO_ROOT, free_port

READY_TIMEOUT_S = 120.0


def child_pids(pid: int) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


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


def test_the_launcher_serves_the_client_and_stops_both_on_ctrl_c(tiny_model_dir: Path) -> None:
    port, engine_port = free_port(), free_port()
    command = [sys.executable, "-m", "frontend_svc.launcher", "--model", str(tiny_model_dir),
               "--port", str(port), "--engine-port", str(engine_port),
               "--engine-arg=--num-kv-blocks=256"]  # fmt: skip
    launcher = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    children: list[int] = []
    try:
        ready = wait_ready_line(launcher)
        children = child_pids(launcher.pid)
        address = f"127.0.0.1:{port}"
        assert address in ready and "python -m frontend_svc.client" in ready

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

        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
        assert not is_listening(port) and not is_listening(engine_port)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        for pid in children:  # the services run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
