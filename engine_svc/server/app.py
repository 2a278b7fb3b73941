"""Builds the grpc.aio server: EngineCoreService, vLLM's VllmEngine over the same engine
client (for gateways such as smg), the standard health service, reflection, and the message
size limits."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_svc.server import vllm_compat
from engine_svc.server.servicer import EngineCoreServicer
from shared.protos import engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def build_server(
    servicer: EngineCoreServicer,
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
    engine_pb2_grpc.add_EngineCoreServiceServicer_to_server(servicer, server)
    vllm_compat.add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, vllm_compat.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME],
        server,
    )
    server.add_insecure_port(f"{host}:{port}")
    return server, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """The overall status ("") and each engine service's, together."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for service in ("", SERVICE_NAME, vllm_compat.SERVICE_NAME):
        await health_servicer.set(service, status)
