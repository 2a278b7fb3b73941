"""The engine service's life: start the gRPC server, then the engines; serve until SIGTERM
(drain, exit 0) or an engine death (NOT_SERVING, exit 1 so the orchestrator restarts us)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from engine_svc.client.async_client import AsyncMPClient
from engine_svc.client.dp_client import make_async_client
from engine_svc.config import EngineConfig
from engine_svc.server import generate_many
from engine_svc.server.app import DEFAULT_MAX_MESSAGE_BYTES, build_server, set_serving
from engine_svc.server.metrics import EngineServiceMetrics
from engine_svc.server.servicer import EngineCoreServicer
from shared.gc_heap import freeze_heap
from shared.grpc_auth import TokenSet, server_interceptors
from shared.grpc_tls import ServerTLS
from shared.metrics.grpc_server import GrpcServerMetrics
from shared.metrics.http_server import start_metrics_server
from shared.metrics.process import register_process_metrics
from shared.parent_watch import stop_with_parent

logger = logging.getLogger(__name__)

# After an engine death: long enough for health checks to see NOT_SERVING and for failed
# streams to get their status out, short enough that a restart is not held up.
DEAD_LINGER_S = 2.0
STOP_GRACE_S = 2.0  # for RPCs that already have their last message to send it


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceOptions:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 8001  # Prometheus text on http://host:metrics_port/metrics
    # Also export the client's view of each request (TTFT, ITL, e2e, lengths, finished
    # requests); off where a frontend in front exports those, so dashboards count once.
    request_metrics: bool = True
    data_parallel_size: int = 1
    shutdown_timeout_s: float = 30.0  # drain for this long on SIGTERM; 0: abort at once
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    startup_timeout_s: float = 600.0
    log_level: str = "INFO"
    auth_tokens: TokenSet | None = None  # None: no authentication
    tls: ServerTLS | None = None  # None: plaintext


async def serve(config: EngineConfig, options: ServiceOptions) -> int:
    """Run the service, its metrics on their own port; returns the process exit code."""
    registry = CollectorRegistry()
    register_process_metrics(registry)
    metrics_server = start_metrics_server(registry, options.host, options.metrics_port)
    try:
        return await _serve(config, options, registry)
    finally:
        if metrics_server is not None:
            metrics_server.close()


async def _serve(config: EngineConfig, options: ServiceOptions, registry: CollectorRegistry) -> int:
    client = make_async_client(
        config, options.data_parallel_size, options.shutdown_timeout_s, options.log_level
    )
    servicer = EngineCoreServicer(
        client, Path(config.model), options.model_name, options.max_message_bytes
    )
    server, health_servicer = build_server(
        servicer,
        options.host,
        options.port,
        options.max_message_bytes,
        interceptors=server_interceptors(
            GrpcServerMetrics(registry),
            options.auth_tokens,
            {generate_many.METHOD: generate_many.withdraws_only},
        ),
        tls=options.tls,
    )
    stop_reason: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    _on_stop_signals(stop_reason)
    stop_with_parent()  # started by `make run`: end when it ends, however it ends
    client.add_dead_callback(lambda error: _settle(stop_reason, "dead"))
    try:
        await set_serving(health_servicer, False)
        await server.start()
        logger.info("gRPC server on %s:%d; starting the engine", options.host, options.port)
        if not await _start_engines(client, stop_reason, options.startup_timeout_s):
            await server.stop(grace=None)
            return 0 if stop_reason.done() and stop_reason.result() == "signal" else 1
        client.set_observer(_engine_metrics(registry, options, client))
        freeze_heap("the engine service")
        await set_serving(health_servicer, True)
        logger.info("serving %s", options.model_name)
        if await stop_reason == "dead":
            await health_servicer.enter_graceful_shutdown()
            servicer.end_shared_calls()
            await asyncio.sleep(DEAD_LINGER_S)
            await server.stop(grace=STOP_GRACE_S)
            return 1
        await health_servicer.enter_graceful_shutdown()
        logger.info("shutting down: %s", _mode(options.shutdown_timeout_s))
        clean = await client.shutdown_async(options.shutdown_timeout_s)
        servicer.end_shared_calls()
        await server.stop(grace=STOP_GRACE_S)
        return 0 if clean else 1
    finally:
        await client.close()


async def _start_engines(
    client: AsyncMPClient, stop_reason: asyncio.Future[str], timeout_s: float
) -> bool:
    """Start the engines unless a stop comes first. False if they did not start."""
    starting = asyncio.create_task(client.start(timeout_s))
    waits: set[asyncio.Future[Any]] = {starting, stop_reason}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False
    error = starting.exception()
    if error is not None:
        logger.error("the engine failed to start: %s", error)
        return False
    return True


def _engine_metrics(
    registry: CollectorRegistry, options: ServiceOptions, client: AsyncMPClient
) -> EngineServiceMetrics:
    return EngineServiceMetrics(
        registry,
        options.model_name,
        client.num_ranks,
        max_model_len=max(info.max_model_len for info in client.ready_engine_infos),
        request_metrics=options.request_metrics,
    )


def _on_stop_signals(stop_reason: asyncio.Future[str]) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _settle, stop_reason, "signal")


def _settle(future: asyncio.Future[str], reason: str) -> None:
    if not future.done():
        future.set_result(reason)


def _mode(timeout_s: float) -> str:
    return "abort every request" if timeout_s <= 0 else f"drain for up to {timeout_s:g} s"
