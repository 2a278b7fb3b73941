"""`make run`: the engine service and the frontend as subprocesses on one machine. Waits until
both report SERVING, prints one ready line with how to call the API, and stops both (frontend
first) on Ctrl-C or SIGTERM, or when either exits; if the launcher itself is killed, both
services notice and stop themselves."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.parent_watch import parent_environment

SERVING = health_pb2.HealthCheckResponse.SERVING
STOP_TIMEOUT_S = 40.0  # the engine drains in-flight requests for up to 30 s by default


class Child:
    def __init__(self, name: str, command: list[str], address: str) -> None:
        self.name = name
        self.address = address
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children in
        # order, and the engine's worker processes are killed with it if need be. The child
        # watches the launcher and stops itself when the launcher is gone (kill -9 included).
        self.process = subprocess.Popen(command, start_new_session=True, env=parent_environment())

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None

    def is_serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING
        except grpc.RpcError:
            return False

    def stop(self, timeout_s: float) -> None:
        if not self.exited:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers, engines included
        self.process.wait(timeout=10)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend_svc.launcher", description=__doc__)
    add = parser.add_argument
    add("--model", help="model directory (default: the default model)")
    add("--host", default="127.0.0.1", help="address both bind (default: %(default)s)")
    add("--port", type=int, default=50051, help="the frontend's port (default: %(default)s)")
    add("--engine-port", type=int, default=50061, help="default: %(default)s")
    add("--startup-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    add("--engine-arg", action="append", default=[], help="passed on to python -m engine_svc")
    return parser


def wait_serving(children: list[Child], stop: threading.Event, timeout_s: float) -> str | None:
    """None once every child is SERVING; otherwise why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        for child in children:
            if child.exited:
                return f"the {child.name} exited with {child.process.returncode}"
        if all(child.is_serving() for child in children):
            return None
        stop.wait(0.5)
    return "stopped" if stop.is_set() else f"not SERVING within {timeout_s:g} s"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.model_store import ensure_default_model, resolve_model

    if args.model is None:
        args.model = str(ensure_default_model())
    model = str(resolve_model(args.model))  # a GGUF file: converted once, here
    engine_address = f"{args.host}:{args.engine_port}"
    address = f"{args.host}:{args.port}"
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    python = sys.executable
    engine_command = [python, "-m", "engine_svc", "--model", model, "--host", args.host,
                      "--port", str(args.engine_port), *args.engine_arg]  # fmt: skip
    frontend_command = [python, "-m", "frontend_svc", "--engine", engine_address, "--host",
                        args.host, "--port", str(args.port), "--tokenizer", model]  # fmt: skip
    engine = Child("engine", engine_command, engine_address)
    frontend = Child("frontend", frontend_command, address)
    children = [frontend, engine]  # stopped in this order
    try:
        problem = wait_serving(children, stop, args.startup_timeout)
        if problem is not None:
            print(f"launcher: {problem}; stopping", file=sys.stderr)
            return 0 if problem == "stopped" else 1
        print(
            f"\nready: frontend.v1.GenerationService on {address} (engine {engine_address}). "
            f'Try: python -m frontend_svc.client --address {address} "Tell me a story" '
            "--stream --max-tokens 64   (Ctrl-C stops both)\n",
            flush=True,
        )
        while not stop.wait(0.5):
            if any(child.exited for child in children):
                print("launcher: a service exited; stopping the other", file=sys.stderr)
                return 1
        return 0
    finally:
        for child in children:
            child.stop(STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
