"""The frontend's start-up: waiting for a tokenizer ends, on time, however the engines'
health events fall. A unit test of frontend_svc/serve.py's waits with a pool in small, whose
health-change event the test sets itself, and the process as users run it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from frontend_svc import serve
from tests.service_processes import REPO_ROOT, free_port, service_env


class SilentPool:
    """No engine ever available; `changed` is the event a health report sets."""

    def __init__(self) -> None:
        self.available: list[object] = []
        self.changed = asyncio.Event()

    def subscribe(self) -> asyncio.Event:
        return self.changed


def test_a_tokenizer_wait_cancelled_as_a_health_event_lands_still_ends() -> None:
    # Python 3.11's asyncio.wait_for returns the inner result when the cancel and the
    # inner wait's completion land in one loop iteration, dropping the cancel: the wait
    # went on forever, and with it the frontend past --startup-timeout and SIGTERM.
    async def body() -> tuple[bool, bool]:
        pool = SilentPool()
        options = serve.FrontendOptions(engines=("127.0.0.1:1",))
        waiting = asyncio.create_task(serve._load_tokenizer(pool, options))  # type: ignore[arg-type]
        for _ in range(3):
            await asyncio.sleep(0)  # into its wait for a health change
        pool.changed.set()
        waiting.cancel()
        done, _ = await asyncio.wait({waiting}, timeout=3.0)
        return waiting in done, waiting.cancelled()

    assert asyncio.run(body()) == (True, True)


def test_with_no_engine_the_frontend_gives_up_at_its_startup_timeout_then_stops(
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "frontend.log"
    command = [sys.executable, "-m", "frontend_svc", "--engine", f"127.0.0.1:{free_port()}",
               "--port", str(free_port()), "--metrics-port", "0", "--startup-timeout", "2",
               "--engine-poll-interval", "0.1"]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=service_env(), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        returncode = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        raise AssertionError(f"still running 60 s on:\n{log_path.read_text()}") from None
    log = log_path.read_text()
    assert returncode == 1, log
    assert "no tokenizer within 2 s (no engine serving?)" in log
