"""Builds the grpc.aio server: GenerationService, the standard health service, reflection,
and the message size limits."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend_svc.server.servicer import GenerationServicer
from shared.frontend_protos import frontend_pb2, frontend_pb2_grpc

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def build_server(
    servicer: GenerationServicer,
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The server, bound but not started, and its health servicer (NOT_SERVING until told)."""
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second server on a busy port would
            # silently share it instead of failing.
            ("grpc.so_reuseport", 0),
        ],
    )
    frontend_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """The overall status ("") and the generation service's, together."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)
