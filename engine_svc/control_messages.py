"""The engine core's control messages, beside the requests and outputs of messages.py: utility
calls and their results, shutdown, a refused request, the limits an engine announces when it
is ready, and its last word when it dies. msgspec structs: msgpack on the wire, never pickle."""

from __future__ import annotations

import enum

import msgspec

from shared.engine_load import RankLoad


class UtilityMethod(enum.IntEnum):
    GET_LOAD = 0
    RESET_PREFIX_CACHE = 1
    PAUSE = 2
    RESUME = 3


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: UtilityMethod
    # RESUME only: pause again after this many scheduled batches, and answer then.
    max_steps: int | None = None


# GET_LOAD: the rank's load; RESET_PREFIX_CACHE: whether it reset; a bounded RESUME: the
# steps it ran; PAUSE and RESUME: True.
UtilityValue = RankLoad | bool | int | None


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    value: UtilityValue = None
    error: str | None = None
    unavailable: bool = False  # refused because the engine is shutting down


class ShutdownRequest(msgspec.Struct, array_like=True):
    timeout_s: float  # 0: abort every request now; > 0: let them finish for that long


class RequestRejected(msgspec.Struct, array_like=True):
    """An ADD the engine refused: the request never ran. `field` names the bad input."""

    request_id: str
    field: str
    message: str
    unavailable: bool = False  # refused because the engine is shutting down


class EngineInfo(msgspec.Struct, array_like=True):
    """Sent once, when the engine is ready: the limits it resolved at start-up."""

    engine_index: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    architecture: str = ""  # config.json's architectures[0]
    # Where every layer is windowed: the span, and the longest step (its KV use is bounded).
    attention_span: int | None = None
    max_num_batched_tokens: int | None = None


class EngineDead(msgspec.Struct, array_like=True):
    reason: str
