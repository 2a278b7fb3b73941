"""The frontend service's life: serve gRPC at once (NOT_SERVING), find the engines, load the
tokenizer (from --tokenizer or from an engine), then report SERVING while at least one engine
is healthy; on SIGTERM or SIGINT, stop taking calls and let in-flight ones finish."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from frontend_svc.engines.endpoint import EngineEndpoint
from frontend_svc.engines.pool import EnginePool
from frontend_svc.engines.resolver import AddressResolver
from frontend_svc.engines.tokenizer_fetch import fetch_tokenizer
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.server.app import DEFAULT_MAX_MESSAGE_BYTES, build_server, set_serving
from frontend_svc.server.servicer import GenerationServicer
from frontend_svc.service import Frontend
from frontend_svc.tokenizer import Tokenizer
from shared.gc_heap import freeze_heap
from shared.grpc_auth import ClientToken, TokenSet, server_interceptors
from shared.grpc_errors import DEFAULT_STREAM_WRITE_TIMEOUT_S
from shared.grpc_tls import ClientTLS, ServerTLS
from shared.metrics.http_server import start_metrics_server
from shared.metrics.process import register_process_metrics
from shared.parent_watch import stop_with_parent

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontendOptions:
    engines: tuple[str, ...] = ("127.0.0.1:50061",)
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 8000  # Prometheus text on http://host:metrics_port/metrics
    tokenizer_dir: Path | None = None  # None: fetch from an engine's GetTokenizer
    max_waiting_requests: int = 1024
    engine_poll_interval_s: float = 0.5
    resolve_interval_s: float = 5.0
    startup_timeout_s: float = 600.0
    shutdown_grace_s: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    auth_tokens: TokenSet | None = None  # None: no authentication
    engine_auth_token: ClientToken | None = None  # sent to the engines (None: none)
    tls: ServerTLS | None = None  # None: plaintext
    engine_tls: ClientTLS | None = None  # None: plaintext to the engines
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S


async def serve(options: FrontendOptions) -> int:
    """Run the service, its metrics on their own port; returns the process exit code."""
    metrics = FrontendMetrics(CollectorRegistry())
    register_process_metrics(metrics.registry)
    metrics_server = start_metrics_server(metrics.registry, options.host, options.metrics_port)
    try:
        return await _serve(options, metrics)
    finally:
        if metrics_server is not None:
            metrics_server.close()


async def _serve(options: FrontendOptions, metrics: FrontendMetrics) -> int:
    pool = EnginePool(
        _endpoint_factory(
            options.engine_poll_interval_s, options.engine_auth_token, options.engine_tls
        ),
        options.max_waiting_requests,
    )
    frontend = Frontend(pool, metrics=metrics)
    server, health_servicer = build_server(
        GenerationServicer(frontend, options.stream_write_timeout_s, options.max_message_bytes),
        options.host,
        options.port,
        options.max_message_bytes,
        interceptors=server_interceptors(metrics.grpc_interceptor, options.auth_tokens),
        tls=options.tls,
    )
    resolver = AddressResolver(options.engines, pool.set_addresses, options.resolve_interval_s)
    stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    _on_stop_signals(stop)
    stop_with_parent()  # started by `make run`: end when it ends, however it ends
    health_changed = pool.subscribe()
    tasks = [
        asyncio.create_task(resolver.run()),
        asyncio.create_task(_report_health(frontend, health_servicer, health_changed)),
    ]
    try:
        await set_serving(health_servicer, False)
        await server.start()
        logger.info(
            "gRPC server on %s:%d; engines: %s",
            options.host,
            options.port,
            ", ".join(options.engines),
        )
        tokenizer = await _first(_load_tokenizer(pool, options), stop, options.startup_timeout_s)
        if tokenizer is None:
            await server.stop(grace=None)
            return 0 if stop.done() else 1
        frontend.tokenizer = tokenizer
        freeze_heap("the frontend")
        pool.notify()
        await stop
        logger.info("shutting down: in-flight calls get %g s", options.shutdown_grace_s)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=options.shutdown_grace_s)
        return 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pool.close()


def _endpoint_factory(
    poll_interval_s: float, auth_token: ClientToken | None, tls: ClientTLS | None
) -> Callable[[str, Callable[[], None]], EngineEndpoint]:
    return lambda address, on_change: EngineEndpoint(
        address, poll_interval_s, on_change, auth_token, tls
    )


async def _load_tokenizer(pool: EnginePool, options: FrontendOptions) -> Tokenizer:
    if options.tokenizer_dir is not None:
        return await asyncio.to_thread(Tokenizer.load, options.tokenizer_dir)
    changed = pool.subscribe()
    while True:
        for endpoint in pool.available:
            try:
                tokenizer = await fetch_tokenizer(endpoint.stub, timeout_s=60.0)
            except Exception as error:  # the next engine, or the next round, may do better
                logger.warning("no tokenizer from engine %s: %s", endpoint.address, error)
                continue
            logger.info("tokenizer loaded from engine %s", endpoint.address)
            return tokenizer
        changed.clear()
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands
        # as the event is set (a health report every poll), and the start-up wait then ran
        # past --startup-timeout and every stop signal.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await changed.wait()


async def _first(work: Any, stop: asyncio.Future[str], timeout_s: float) -> Tokenizer | None:
    """The tokenizer, unless a stop signal or the start-up timeout comes first (None)."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait(
        {task, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not stop.done():
            logger.error("no tokenizer within %g s (no engine serving?)", timeout_s)
        return None
    if task.exception() is not None:
        logger.error("cannot load the tokenizer: %s", task.exception())
        return None
    return task.result()


async def _report_health(
    frontend: Frontend, health_servicer: health.aio.HealthServicer, changed: asyncio.Event
) -> None:
    """SERVING while the frontend can serve (tokenizer loaded, an engine healthy), so load
    balancers and readiness probes route around a frontend whose engines are all gone."""
    serving: bool | None = None
    while True:
        await changed.wait()
        changed.clear()
        if frontend.is_ready != serving:
            serving = frontend.is_ready
            logger.info("frontend %s", "SERVING" if serving else "NOT_SERVING")
            await set_serving(health_servicer, serving)


def _on_stop_signals(stop: asyncio.Future[str]) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, functools.partial(_settle, stop, "signal"))


def _settle(future: asyncio.Future[str], reason: str) -> None:
    if not future.done():
        future.set_result(reason)
