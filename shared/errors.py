"""Typed errors that both services map to gRPC status codes in one place."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input from a client. `field` names the offending field (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine core process died or failed; in-flight requests cannot finish (UNAVAILABLE)."""


class RequestFailedError(RuntimeError):
    """An engine failed this one request and goes on serving the others (INTERNAL): a fault
    of the engine that the request met, so another engine would most likely meet it too."""


class EngineOverloadedError(RuntimeError):
    """Too many waiting requests (RESOURCE_EXHAUSTED). `retry_after_s`: when a client may
    try again, sent as gRPC's retry pushback."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine takes no new work right now: still starting, or draining (UNAVAILABLE)."""


class DeadlinePassedError(TimeoutError):
    """The client's deadline passed before the request finished (DEADLINE_EXCEEDED): seen
    by the service itself (a timer on the request, an engine call's own deadline) rather than
    by gRPC cancelling the call. An abort of the client's, not a fault."""

    def __init__(self, message: str = "the deadline passed") -> None:
        super().__init__(message)


class StreamStalledError(RuntimeError):
    """A client stopped reading its stream: the last response could not be written for the
    server's stall bound, so the call was dropped (RESOURCE_EXHAUSTED, no retry hint)."""


class MessageTooLargeError(RuntimeError):
    """A message over the size a call's peer takes (RESOURCE_EXHAUSTED, as gRPC's own
    message limit): on a shared call, the one request whose input or output it is fails."""


class TokenRevokedError(PermissionError):
    """A long-lived call's bearer token was taken off the accepted list while the call ran
    (UNAUTHENTICATED, as a new call with that token would be)."""
