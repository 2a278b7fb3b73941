"""What every grpc.aio server here has: message limits, no port sharing, health, reflection,
and INVALID_ARGUMENT for requests that do not parse."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.grpc_request_decoding import RequestDecodeInterceptor
from shared.grpc_tls import ServerTLS

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def build_grpc_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A server with the services `register` adds, bound but not started, and its health
    servicer (NOT_SERVING until told). Reflection lists `service_names` and health. With
    `tls`, the port serves TLS only. `interceptors` run outside the one that refuses
    undecodable requests, so they see those calls end with INVALID_ARGUMENT."""
    server = grpc.aio.server(
        interceptors=[*interceptors, RequestDecodeInterceptor()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second server on a busy port would
            # silently share it instead of failing.
            ("grpc.so_reuseport", 0),
        ],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{host}:{port}"
    bound = (
        server.add_insecure_port(address)
        if tls is None
        else server.add_secure_port(address, tls.credentials())
    )
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, health_servicer


async def set_health(
    health_servicer: health.aio.HealthServicer, service_names: Sequence[str], serving: bool
) -> None:
    """The overall status ("") and each named service's, together."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for service in ("", *service_names):
        await health_servicer.set(service, status)
