"""`python -m frontend_svc`: the frontend service (frontend.v1.GenerationService over gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from frontend_svc.engines.resolver import parse_target
from frontend_svc.serve import FrontendOptions, serve
from frontend_svc.server.app import DEFAULT_MAX_MESSAGE_BYTES
from shared.grpc_auth import AuthConfigError, ClientToken, TokenSet
from shared.grpc_errors import DEFAULT_STREAM_WRITE_TIMEOUT_S
from shared.grpc_tls import (
    TLSConfigError,
    add_client_arguments,
    add_server_arguments,
    client_tls,
    server_tls,
)

AUTH_TOKENS_ENV = "DUOSERVE_AUTH_TOKENS"
ENGINE_AUTH_TOKEN_ENV = "DUOSERVE_ENGINE_AUTH_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend_svc", description=__doc__)
    add = parser.add_argument
    add(
        "--engine",
        nargs="+",
        default=["127.0.0.1:50061"],
        metavar="HOST:PORT",
        help="engine services: several addresses, or a DNS name that resolves to several pods "
        "(re-resolved periodically) (default: %(default)s)",
    )
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=50051, help="gRPC port (default: %(default)s)")
    add(
        "--metrics-port",
        type=int,
        default=8000,
        help="Prometheus metrics on http://HOST:PORT/metrics (default: %(default)s)",
    )
    add("--tokenizer", type=Path, help="tokenizer directory (default: fetch from an engine)")
    add(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="refuse new requests (RESOURCE_EXHAUSTED) while this many wait for an engine "
        "(default: %(default)s)",
    )
    add("--engine-poll-interval", type=float, default=0.5, help="seconds between load polls")
    add("--resolve-interval", type=float, default=5.0, help="seconds between DNS look-ups")
    add("--startup-timeout", type=float, default=600.0, help="seconds to wait for a tokenizer")
    add("--shutdown-grace", type=float, default=10.0, help="seconds for in-flight calls on stop")
    add(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message the frontend accepts from or sends to a client (default: "
        "%(default)s)",
    )
    add(
        "--stream-write-timeout",
        type=float,
        default=DEFAULT_STREAM_WRITE_TIMEOUT_S,
        help="drop a stream (RESOURCE_EXHAUSTED) whose client has taken no response for this "
        "many seconds with its flow-control window full (default: %(default)s)",
    )
    add(
        "--auth-token-file",
        type=Path,
        help="require `authorization: Bearer TOKEN` on every call but health and reflection, "
        f"TOKEN one of this file's lines (re-read when it changes); or set {AUTH_TOKENS_ENV} "
        "to comma-separated tokens (default: no authentication)",
    )
    add(
        "--engine-auth-token-file",
        type=Path,
        help="send the first line of this file as the bearer token to the engines, re-read "
        f"when it changes (or set {ENGINE_AUTH_TOKEN_ENV}; default: none)",
    )
    add_server_arguments(parser)
    add_client_arguments(parser, "--engine-tls", "the engines")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One --engine with commas works too, as environment variables tend to give it.
    engines = tuple(a for arg in args.engine for a in arg.split(",") if a)
    for engine in engines:
        try:
            parse_target(engine)
        except ValueError as error:
            parser.error(f"--engine: {error}")
    if args.stream_write_timeout <= 0:
        parser.error("--stream-write-timeout must be > 0")
    if args.max_waiting_requests < 0:
        parser.error("--max-waiting-requests must be >= 0")
    if args.tokenizer is not None and not args.tokenizer.is_dir():
        parser.error(f"--tokenizer: {args.tokenizer} is not a directory")
    try:
        auth_tokens = TokenSet.from_options(args.auth_token_file, os.environ, AUTH_TOKENS_ENV)
        engine_token = ClientToken.from_options(
            args.engine_auth_token_file, os.environ, ENGINE_AUTH_TOKEN_ENV
        )
        tls = server_tls(args)
        engine_tls = client_tls(args, "--engine-tls")
    except (OSError, AuthConfigError, TLSConfigError) as error:
        parser.error(str(error))
    options = FrontendOptions(
        engines=engines,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        tokenizer_dir=args.tokenizer,
        max_waiting_requests=args.max_waiting_requests,
        engine_poll_interval_s=args.engine_poll_interval,
        resolve_interval_s=args.resolve_interval,
        startup_timeout_s=args.startup_timeout,
        shutdown_grace_s=args.shutdown_grace,
        max_message_bytes=args.max_message_bytes,
        stream_write_timeout_s=args.stream_write_timeout,
        auth_tokens=auth_tokens,
        engine_auth_token=engine_token,
        tls=tls,
        engine_tls=engine_tls,
    )
    return asyncio.run(serve(options))


if __name__ == "__main__":
    sys.exit(main())
