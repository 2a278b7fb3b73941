"""The import point for the frontend's generated protobuf code (frontend.v1), beside
shared.protos, which puts gen/ on the import path and checks that `make proto` has run."""

from __future__ import annotations

from shared.protos import GEN_DIR

if not (GEN_DIR / "frontend" / "v1" / "frontend_pb2.py").is_file():
    raise ImportError(f"no generated frontend protobuf code in {GEN_DIR}: run `make proto`")

from frontend.v1 import frontend_pb2, frontend_pb2_grpc

__all__ = ["frontend_pb2", "frontend_pb2_grpc"]
