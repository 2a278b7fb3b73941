"""The ZMQ wire protocol between engine clients and EngineCoreProc: frame headers and codecs.

A message is two ZMQ frames: a header (the message type, one byte; outputs add the sending
rank) and a msgpack payload holding one typed msgspec struct (engine_svc/messages.py and
control_messages.py). Never pickle.
"""

from __future__ import annotations

import enum
import struct

import msgspec

from engine_svc.config import EngineConfig
from engine_svc.control_messages import (
    EngineDead,
    EngineInfo,
    RequestRejected,
    ShutdownRequest,
    UtilityCall,
    UtilityResult,
)
from engine_svc.messages import EngineCoreOutputs, EngineCoreRequest


class RequestType(enum.IntEnum):
    """Client -> engine."""

    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3
    # Never on the wire: the executor's failure callback puts it on the input queue.
    EXECUTOR_FAILED = 4


class OutputType(enum.IntEnum):
    """Engine -> client."""

    READY = 0
    OUTPUTS = 1
    REJECTED = 2
    UTILITY_RESULT = 3
    ENGINE_CORE_DEAD = 4


class EngineProcArgs(msgspec.Struct):
    """What a spawned engine process needs, encoded to bytes before the spawn."""

    config: EngineConfig
    input_address: str
    output_address: str
    engine_index: int = 0
    shutdown_timeout_s: float = 0.0  # used when the process itself gets SIGTERM
    log_level: str = "INFO"


EngineInput = EngineCoreRequest | list[str] | UtilityCall | ShutdownRequest | None
EngineOutput = EngineInfo | EngineCoreOutputs | RequestRejected | UtilityResult | EngineDead

_REQUEST_PAYLOADS: dict[RequestType, type] = {
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: list[str],
    RequestType.UTILITY: UtilityCall,
    RequestType.SHUTDOWN: ShutdownRequest,
}
_OUTPUT_PAYLOADS: dict[OutputType, type] = {
    OutputType.READY: EngineInfo,
    OutputType.OUTPUTS: EngineCoreOutputs,
    OutputType.REJECTED: RequestRejected,
    OutputType.UTILITY_RESULT: UtilityResult,
    OutputType.ENGINE_CORE_DEAD: EngineDead,
}
_OUTPUT_HEADER = struct.Struct("!BH")  # message type, sending rank


def encode_request(request_type: RequestType, payload: EngineInput) -> list[bytes]:
    return [bytes([request_type]), msgspec.msgpack.encode(payload)]


def decode_request(frames: list[bytes]) -> tuple[RequestType, EngineInput]:
    request_type = RequestType(frames[0][0])
    payload: EngineInput = msgspec.msgpack.decode(frames[1], type=_REQUEST_PAYLOADS[request_type])
    return request_type, payload


def encode_output(output_type: OutputType, engine_index: int, payload: EngineOutput) -> list[bytes]:
    return [_OUTPUT_HEADER.pack(output_type, engine_index), msgspec.msgpack.encode(payload)]


def decode_output(frames: list[bytes]) -> tuple[OutputType, int, EngineOutput]:
    type_byte, engine_index = _OUTPUT_HEADER.unpack(frames[0])
    output_type = OutputType(type_byte)
    payload: EngineOutput = msgspec.msgpack.decode(frames[1], type=_OUTPUT_PAYLOADS[output_type])
    return output_type, engine_index, payload


def request_id_of(payload: bytes) -> str | None:
    """The request id of an ADD payload that did not decode, so it can be rejected by id."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    # EngineCoreRequest is array_like: the id is the first element.
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def encode_proc_args(args: EngineProcArgs) -> bytes:
    return msgspec.msgpack.encode(args)


def decode_proc_args(data: bytes) -> EngineProcArgs:
    return msgspec.msgpack.decode(data, type=EngineProcArgs)
