"""Builds the frontend's grpc.aio server: GenerationService, with health and reflection."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health

from frontend_svc.server.servicer import GenerationServicer
from shared.frontend_protos import frontend_pb2, frontend_pb2_grpc
from shared.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, build_grpc_server, set_health
from shared.grpc_tls import ServerTLS

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "SERVICE_NAME", "build_server", "set_serving"]


def build_server(
    servicer: GenerationServicer,
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    def register(server: grpc.aio.Server) -> None:
        frontend_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)

    return build_grpc_server(
        register, (SERVICE_NAME,), host, port, max_message_bytes, interceptors, tls
    )


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    await set_health(health_servicer, (SERVICE_NAME,), serving)
