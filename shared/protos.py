"""The one import point for the protobuf code `make proto` generates into gen/ (git-ignored)."""

from __future__ import annotations

import sys
from pathlib import Path

GEN_DIR = Path(__file__).resolve().parent.parent / "gen"

if not (GEN_DIR / "engine" / "v1" / "engine_pb2.py").is_file():
    raise ImportError(f"no generated protobuf code in {GEN_DIR}: run `make proto`")
# protoc writes absolute imports (`from engine.v1 import engine_pb2`), so gen/ must be a
# root on the import path; appended, so it never shadows an installed package.
if str(GEN_DIR) not in sys.path:
    sys.path.append(str(GEN_DIR))

from engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

# The initial metadata an engine sends at the start of each GenerateMany call, before any
# request: a client writes only once it has it (engine.proto says why).
GENERATE_MANY_READY = ("generate-many", "ready")
# Beside it, the largest message the engine takes (its --max-message-bytes), in decimal: a
# client sends no bigger one, which would end the whole call.
GENERATE_MANY_MAX_MESSAGE_BYTES = "generate-many-max-message-bytes"


def field_entry_bytes(size: int) -> int:
    """The bytes a submessage of `size` bytes adds to a repeated field of a message (field
    numbers under 16): itself, its one-byte tag and its length as a varint."""
    return 1 + max(1, (size.bit_length() + 6) // 7) + size


__all__ = [
    "GENERATE_MANY_MAX_MESSAGE_BYTES",
    "GENERATE_MANY_READY",
    "GEN_DIR",
    "engine_pb2",
    "engine_pb2_grpc",
    "field_entry_bytes",
]
