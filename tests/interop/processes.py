"""The Shepherd Model Gateway (smg) as a subprocess on free 127.0.0.1 ports, in front of an
engine. Every wait is bounded; stop() kills each
by its process id (its own session, so its whole group)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.service_processes import REPO_ROOT, START_TIMEOUT_S, ServiceProcess, free_port

BIN_DIR = Path(sys.executable).parent  # grpcurl and smg come with the dev dependencies


class SmgProcess(ServiceProcess):
    """`smg launch` with one gRPC worker: our engine, driven over vllm.grpc.engine. smg binds
    0.0.0.0 unless told, so both of its listeners are given 127.0.0.1."""

    def __init__(
        self, engine_address: str, tokenizer_dir: Path, model_name: str, log_path: Path
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_name = model_name
        self.log_path = log_path
        command = [
            str(BIN_DIR / "smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", f"grpc://{engine_address}", "--tokenizer-path", str(tokenizer_dir),
            "--log-level", "info",
        ]  # fmt: skip
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Ready once its worker is healthy and a one-token completion goes through (the
        tokenizer loads in the background after the worker registers)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"smg exited ({self.process.returncode}):\n{self.log()}")
            if self._healthy_workers() >= 1 and self._can_complete():
                return
            time.sleep(0.2)
        raise AssertionError(f"smg not ready within {timeout_s} s:\n{self.log()}")

    def _healthy_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.base_url}/readiness", timeout=2) as response:
                return int(json.load(response).get("healthy_workers", 0))
        except (OSError, ValueError):
            return 0

    def _can_complete(self) -> bool:
        body = json.dumps({"model": self.model_name, "prompt": "Hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{self.base_url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False
