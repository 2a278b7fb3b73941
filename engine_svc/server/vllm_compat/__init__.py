"""vLLM's gRPC contract (`vllm.grpc.engine.VllmEngine`, from the PyPI package smg-grpc-proto)
on the same server and engine client as engine.v1, so gateways that drive vLLM engines over
gRPC (the Shepherd Model Gateway, smg) can drive this engine too."""

from __future__ import annotations

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from engine_svc.server.servicer import EngineCoreServicer
from engine_svc.server.vllm_compat.servicer import VllmEngineServicer

SERVICE_NAME: str = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def add_to_server(engine_servicer: EngineCoreServicer, server: grpc.aio.Server) -> None:
    """Serve VllmEngine beside EngineCoreService, over the same engine client and model."""
    servicer = VllmEngineServicer(
        engine_servicer.client, engine_servicer.model_dir, engine_servicer.model_name
    )
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)


__all__ = ["SERVICE_NAME", "VllmEngineServicer", "add_to_server"]
