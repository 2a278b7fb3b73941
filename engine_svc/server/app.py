"""Builds the engine's grpc.aio server: EngineCoreService and vLLM's VllmEngine over the same
engine client (for gateways such as smg), with health and reflection."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health

from engine_svc.server import vllm_compat
from engine_svc.server.servicer import EngineCoreServicer
from shared.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, build_grpc_server, set_health
from shared.grpc_tls import ServerTLS
from shared.protos import engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
SERVICE_NAMES = (SERVICE_NAME, vllm_compat.SERVICE_NAME)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "SERVICE_NAME", "build_server", "set_serving"]


def build_server(
    servicer: EngineCoreServicer,
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    def register(server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineCoreServiceServicer_to_server(servicer, server)
        vllm_compat.add_to_server(servicer, server)

    return build_grpc_server(
        register, SERVICE_NAMES, host, port, max_message_bytes, interceptors, tls
    )


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    await set_health(health_servicer, SERVICE_NAMES, serving)
