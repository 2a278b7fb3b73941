"""One benchmarked system in a process of its own, driven a command at a time (bench.py).

The parent starts one worker per system and alternates them, round after round: on a shared
machine whose speed drifts by tens of percent within minutes, ratios of adjacent rounds
compare the systems under the same conditions, where one long run of each did not. Commands
go in on stdin, one per line; each answer comes back on stdout as one JSON line behind
`ANSWER_PREFIX` (anything else the libraries print there passes through).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ANSWER_PREFIX = "@@bench-answer "
COMMANDS = ("batch", "single", "ttft", "quit")


def write_workload(
    path: Path, prompts: list[list[int]], single_prompt: list[int], output_len: int
) -> None:
    """The token ids a worker runs, as JSON: for one started apart from the parent's
    arguments (vllm_worker.py, offline.py's `--workload-file`)."""
    payload = {"prompts": prompts, "single_prompt": single_prompt, "output_len": output_len}
    path.write_text(json.dumps(payload))


def serve_workload(
    system: Callable[[], contextlib.AbstractContextManager[Any]],
    path: Path,
    settle: Callable[[], None] | None = None,
) -> None:
    """`serve` on the workload write_workload put in `path`."""
    workload = json.loads(path.read_text())
    serve(system, workload["prompts"], workload["single_prompt"], workload["output_len"], settle)


def serve(
    system: Callable[[], contextlib.AbstractContextManager[Any]],
    prompts: list[list[int]],
    single_prompt: list[int],
    output_len: int,
    settle: Callable[[], None] | None = None,
) -> None:
    """Start the system, warm it up (and `settle` it: what it still does in the background
    after start-up, finished before any timed command), then answer commands until `quit`
    or end of input: `batch` (all prompts to `output_len` new tokens), `single` (one prompt
    alone), `ttft` (the same prompt to one token)."""
    began = time.perf_counter()
    with system() as generate:
        _answer({"start_s": time.perf_counter() - began})
        generate([single_prompt[:8]], 4)
        if settle is not None:
            settle()
        for line in sys.stdin:
            command = line.strip()
            if command == "batch":
                seconds, outputs = _timed(lambda: generate(prompts, output_len))
                _answer({"seconds": seconds, "outputs": outputs})
            elif command == "single":
                _answer({"seconds": _timed(lambda: generate([single_prompt], output_len))[0]})
            elif command == "ttft":
                _answer({"seconds": _timed(lambda: generate([single_prompt], 1))[0]})
            elif command == "quit":
                break
            else:
                _answer({"error": f"unknown command {command!r}; one of {COMMANDS}"})


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def _answer(payload: dict[str, Any]) -> None:
    print(ANSWER_PREFIX + json.dumps(payload), flush=True)


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.start_s: float = self._read()["start_s"]

    def ask(self, command: str) -> dict[str, Any]:
        assert command in COMMANDS and self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(ANSWER_PREFIX):
                answer: dict[str, Any] = json.loads(line[len(ANSWER_PREFIX) :])
                if "error" in answer:
                    raise RuntimeError(answer["error"])
                return answer
            sys.stdout.write(line)  # the libraries' own output passes through
        raise RuntimeError(f"bench worker exited with {self.process.wait()} before answering")
