"""What the multiprocessing executor and its worker processes say to each other: typed
msgspec structs as msgpack over ZMQ, never pickle.

The executor sends every call to every worker (the step's scheduler output is encoded once);
a worker answers a control call (profile, allocate, shutdown) always, a step only when it is
the rank that samples, and anything when it fails.
"""

from __future__ import annotations

import msgspec

from engine_svc.config import EngineConfig
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.executor.base import WorkerMemory
from engine_svc.worker.outputs import ModelRunnerOutput


class WorkerProcArgs(msgspec.Struct, kw_only=True):
    config: EngineConfig
    rank: int
    call_address: str  # the worker's own call socket (ipc://)
    reply_address: str  # every worker's replies, to the executor
    master_port: int
    parent_pid: int  # the engine-core process: the worker exits when it is gone
    num_threads: int
    log_level: str = "INFO"


class ProfileMemory(msgspec.Struct, tag=True):
    max_batched_tokens: int
    max_num_seqs: int
    measure: bool


class AllocateKVCache(msgspec.Struct, tag=True):
    num_blocks: int


class ExecuteModel(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput


class SampleTokens(msgspec.Struct, tag=True):
    """Sample a forward's kept logits (`step`), with the grammar bitmask if there is one."""

    step: int
    grammar_request_ids: list[str] | None = None
    bitmask: bytes = b""  # int32 [len(grammar_request_ids), words], little-endian


class Shutdown(msgspec.Struct, tag=True):
    pass


WorkerCall = ProfileMemory | AllocateKVCache | ExecuteModel | SampleTokens | Shutdown


class CallEnvelope(msgspec.Struct, array_like=True):
    call_id: int
    call: WorkerCall


class WorkerReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    call_id: int  # -1: the worker is ready
    rank: int
    output: ModelRunnerOutput | None = None
    memory: WorkerMemory | None = None
    pending_request_ids: list[str] | None = None  # the logits wait for a grammar bitmask
    error: str | None = None


READY = -1

_call_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(CallEnvelope)
_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)


def encode_call(call_id: int, call: WorkerCall) -> bytes:
    return _call_encoder.encode(CallEnvelope(call_id, call))


def decode_call(data: bytes) -> CallEnvelope:
    return _call_decoder.decode(data)


def encode_reply(reply: WorkerReply) -> bytes:
    return _call_encoder.encode(reply)


def decode_reply(data: bytes) -> WorkerReply:
    return _reply_decoder.decode(data)


def encode_proc_args(args: WorkerProcArgs) -> bytes:
    return msgspec.msgpack.encode(args)


def decode_proc_args(data: bytes) -> WorkerProcArgs:
    return msgspec.msgpack.decode(data, type=WorkerProcArgs)
