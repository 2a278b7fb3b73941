"""An engine call's gRPC status, as the frontend's typed errors (shared.grpc_errors then maps
those to the client's status), and whether another engine may succeed where this one failed."""

from __future__ import annotations

import dataclasses

import grpc

from shared.errors import (
    DeadlinePassedError,
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
)

# An engine's answers to a frontend whose credentials it does not take (a missing or revoked
# token, a certificate): configuration to fix, not the client's request; the endpoint's
# authenticated polls take the engine out of service while it answers so.
REFUSALS = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})

# The engine could not take or finish the request (gone, starting, draining, full, refusing
# this frontend); the request itself is fine, so another engine may serve it (UNAVAILABLE to
# the client, not INTERNAL).
_ENGINE_TROUBLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,  # cancelled by the engine's side: it is shutting down
    grpc.StatusCode.ABORTED,
    *REFUSALS,
}

# engine.v1 fields the frontend fills from one of the client's that has another name.
_CLIENT_FIELDS = {"sampling_params.bad_words_token_ids": "sampling_params.bad_words"}


@dataclasses.dataclass(frozen=True)
class EngineCallError:
    error: Exception
    is_retriable: bool  # before the first token, another engine may serve the request


def classify(error: grpc.aio.AioRpcError, address: str, has_output: bool) -> EngineCallError:
    return classify_status(error.code(), error.details() or "", address, has_output)


def classify_status(
    code: grpc.StatusCode, details: str, address: str, has_output: bool
) -> EngineCallError:
    """What a request that ended with this status (its call's, or its own on a shared
    call) means to the client."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # The engine names the field as "field: message", the way our own errors do.
        field, _, message = details.partition(": ")
        field = _CLIENT_FIELDS.get(field, field)
        return EngineCallError(InvalidRequestError(field, message or details), False)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EngineCallError(DeadlinePassedError(), False)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not has_output:
        return EngineCallError(EngineOverloadedError(f"engine {address}: {details}"), True)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        details = f"it refuses this frontend's credentials ({code.name}: {details})"
    if code in _ENGINE_TROUBLE or code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if has_output:
            return EngineCallError(engine_failed_mid_request(address, details), False)
        return EngineCallError(EngineUnavailableError(f"engine {address}: {details}"), True)
    return EngineCallError(RuntimeError(f"engine {address}: {code.name}: {details}"), False)


def engine_failed_mid_request(address: str, details: str) -> EngineDeadError:
    # Tokens already went to the client: retrying elsewhere would restart the text.
    return EngineDeadError(f"engine {address} failed mid-request: {details}")
