"""`make run`: the engine service and the frontend as subprocesses on one machine. Waits until
both report SERVING, prints one ready line with how to call the API, and stops both (frontend
first) on Ctrl-C or SIGTERM, or when either exits; if the launcher itself is killed, both
services notice and stop themselves.

The frontend is the public API: it binds --host, and serves TLS and requires bearer tokens
when told to (the same options as `python -m frontend_svc`). The engine is the frontend's
private backend: it binds 127.0.0.1 in plaintext, whatever --host says (an --engine-arg
may override that); when the frontend requires tokens, the engine requires one made for
this launch, which only the frontend is given."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shared.grpc_tls import (
    ClientTLS,
    TLSConfigError,
    add_client_arguments,
    add_server_arguments,
    client_tls,
    server_tls,
)
from shared.health_check import check
from shared.parent_watch import parent_environment

AUTH_TOKENS_ENV = "DUOSERVE_AUTH_TOKENS"  # the frontend's tokens, as python -m frontend_svc reads
STOP_TIMEOUT_S = 40.0  # the engine drains in-flight requests for up to 30 s by default
ENGINE_HOST = "127.0.0.1"  # only the frontend, on this machine, calls the engine


class Child:
    def __init__(
        self, name: str, command: list[str], address: str, tls: ClientTLS | None = None
    ) -> None:
        self.name = name
        self.address = address
        self.tls = tls  # how the launcher reaches it to ask whether it serves
        self.status = "not asked yet"  # its last answer, or why there was none
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children in
        # order, and the engine's worker processes are killed with it if need be. The child
        # watches the launcher and stops itself when the launcher is gone (kill -9 included).
        self.process = subprocess.Popen(command, start_new_session=True, env=parent_environment())

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None

    def is_serving(self) -> bool:
        self.status = check(self.address, "", 1.0, self.tls)
        return self.status == "SERVING"

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
    add("--host", default="127.0.0.1", help="address the frontend binds (default: %(default)s)")
    add("--port", type=int, default=50051, help="the frontend's port (default: %(default)s)")
    add(
        "--engine-port",
        type=int,
        default=50061,
        help=f"the engine's port, on {ENGINE_HOST} (default: %(default)s)",
    )
    add("--startup-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    add("--engine-arg", action="append", default=[], help="passed on to python -m engine_svc")
    add(
        "--auth-token-file",
        type=Path,
        help="the frontend requires `authorization: Bearer TOKEN`, TOKEN one of this file's "
        "lines (or set DUOSERVE_AUTH_TOKENS; see python -m frontend_svc --help)",
    )
    add_server_arguments(parser)  # the frontend's TLS
    # How the launcher itself asks the frontend whether it serves, under TLS.
    add_client_arguments(parser, "--probe-tls", "the frontend", ca_default="--tls-cert-file")
    return parser


def probe_tls(args: argparse.Namespace) -> ClientTLS | None:
    """How to reach the frontend for the readiness check: plaintext, or TLS trusting
    --probe-tls-ca-file (default: the frontend's own certificate, right for a self-signed
    one), with a certificate of the launcher's own under mutual TLS."""
    server = server_tls(args)  # the frontend would refuse these options too: fail here
    if server is None:
        if client_tls(args, "--probe-tls") is not None:
            raise TLSConfigError("--probe-tls-* options need --tls-cert-file and --tls-key-file")
        return None
    if args.probe_tls_ca_file is None:
        args.probe_tls_ca_file = args.tls_cert_file
    if server.client_ca_file is not None and args.probe_tls_cert_file is None:
        raise TLSConfigError(
            "mutual TLS: give --probe-tls-cert-file and --probe-tls-key-file, a client "
            "certificate the launcher can show the frontend to see whether it serves"
        )
    return client_tls(args, "--probe-tls")


def frontend_flags(args: argparse.Namespace) -> list[str]:
    """The frontend's TLS and token options, as given to the launcher."""
    flags = []
    for name in ("auth_token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def requires_tokens(args: argparse.Namespace) -> bool:
    return args.auth_token_file is not None or bool(os.environ.get(AUTH_TOKENS_ENV))


def engine_token_flags(args: argparse.Namespace, folder: Path) -> tuple[list[str], list[str]]:
    """The engine's and the frontend's flags for an engine token of this launch, where the
    frontend requires tokens: else any local user could call the engine directly, around
    the frontend's tokens. The file is private (0600, in a 0700 folder)."""
    if not requires_tokens(args):
        return [], []
    path = folder / "engine-token"
    path.touch(mode=0o600)
    path.write_text(secrets.token_hex(32) + "\n")
    return ["--auth-token-file", str(path)], ["--engine-auth-token-file", str(path)]


def client_hint(address: str, args: argparse.Namespace) -> str:
    """How to call the frontend with the command-line client, with this interpreter (the
    project's .venv under `make run`: a system Python lacks grpc)."""
    hint = f"{sys.executable} -m frontend_svc.client --address {address}"
    if args.tls_cert_file is not None:
        hint += f" --tls-ca-file {args.probe_tls_ca_file}"
        if args.tls_client_ca_file is not None:
            hint += " --tls-cert-file CERT --tls-key-file KEY"
    if requires_tokens(args):
        hint += " --auth-token-file FILE"
    return hint


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
    if stop.is_set():
        return "stopped"
    statuses = "; ".join(f"the {child.name}: {child.status}" for child in children)
    return f"not SERVING within {timeout_s:g} s ({statuses})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tls = probe_tls(args)
    except (OSError, TLSConfigError) as error:
        parser.error(str(error))
    from shared.model_store import ensure_default_model, resolve_model

    if args.model is None:
        args.model = str(ensure_default_model())
    model = str(resolve_model(args.model))  # a GGUF file: converted once, here
    engine_address = f"{ENGINE_HOST}:{args.engine_port}"
    # Bound to every interface, the frontend is reached here by the name its certificate
    # most likely carries.
    local = "localhost" if args.host in ("0.0.0.0", "::", "[::]") else args.host
    address = f"{local}:{args.port}"
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    python = sys.executable
    private = Path(tempfile.mkdtemp(prefix="duoserve-launcher-"))  # 0700
    engine_token, frontend_token = engine_token_flags(args, private)
    engine_command = [python, "-m", "engine_svc", "--model", model, "--host", ENGINE_HOST,
                      "--port", str(args.engine_port), *engine_token, *args.engine_arg]  # fmt: skip
    frontend_command = [python, "-m", "frontend_svc", "--engine", engine_address, "--host",
                        args.host, "--port", str(args.port), "--tokenizer", model,
                        *frontend_flags(args), *frontend_token]  # fmt: skip
    engine = Child("engine", engine_command, engine_address)
    frontend = Child("frontend", frontend_command, address, tls)
    children = [frontend, engine]  # stopped in this order
    try:
        problem = wait_serving(children, stop, args.startup_timeout)
        if problem is not None:
            print(f"launcher: {problem}; stopping", file=sys.stderr)
            return 0 if problem == "stopped" else 1
        print(
            f"\nready: frontend.v1.GenerationService on {address} (engine {engine_address}). "
            f'Try: {client_hint(address, args)} "Tell me a story" '
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
        shutil.rmtree(private, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
