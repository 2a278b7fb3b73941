"""A real Prometheus for tests (Debian's `prometheus` binary): 127.0.0.1 on a free port, a
temporary config and storage folder, a one-second scrape interval; queried through its HTTP
API. Every wait is bounded; `stop()` ends the process by its PID."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.service_processes import free_port

STOP_TIMEOUT_S = 10.0


class PrometheusServer:
    def __init__(self, work_dir: Path, targets: dict[str, str]) -> None:
        """`targets`: job name -> host:port serving /metrics."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: `make test` installs it (Debian package)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = work_dir / "prometheus.yml"
        config.write_text(_config(targets))
        self.log_path = work_dir / "prometheus.log"
        command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"prometheus exited ({self.process.returncode}):\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {timeout_s} s:\n{self.log()}")

    def query(self, expr: str) -> list[float]:
        """The values of an instant query's vector result (NaN and infinities dropped)."""
        query = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=5) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        values = [float(sample["value"][1]) for sample in body["data"]["result"]]
        return [value for value in values if math.isfinite(value)]

    def wait_for(self, expr: str, timeout_s: float) -> list[float]:
        """Poll `expr` until it returns a positive value; its values then."""
        deadline = time.monotonic() + timeout_s
        values: list[float] = []
        while time.monotonic() < deadline:
            values = self.query(expr)
            if any(value > 0 for value in values):
                return values
            time.sleep(0.5)
        raise AssertionError(f"{expr!r} gave {values} for {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)


def _config(targets: dict[str, str]) -> str:
    lines = [
        "global:",
        "  scrape_interval: 1s",
        "  scrape_timeout: 1s",
        "  evaluation_interval: 1s",
        "scrape_configs:",
    ]
    for job, target in targets.items():
        lines += [
            f"  - job_name: {job}",
            "    static_configs:",
            f'      - targets: ["{target}"]',
        ]
    return "\n".join(lines) + "\n"
