"""Bearer-token authentication for the gRPC servers and the clients the project ships.

A client sends `authorization: Bearer TOKEN` metadata with every call. A server given tokens
(a file, one token a line, re-read when it changes, so a rotated Kubernetes Secret takes
effect without a restart; or a comma-separated environment variable) refuses any other call
with UNAUTHENTICATED, except health checks and reflection, which probes and grpcurl use
without credentials. Several tokens may be valid at once, for rotation; each is compared in
constant time.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from shared.errors import TokenRevokedError
from shared.grpc_request_streams import checking_requests

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
BEARER = "Bearer "
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REFUSAL = "a valid bearer token is required (metadata `authorization: Bearer TOKEN`)"

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# Per method of a request-streaming call: the messages let in after the call's token is
# revoked (those that only withdraw work the call added while its token was good).
Withdrawals = Mapping[str, Callable[[Any], bool]]


class AuthConfigError(ValueError):
    """Tokens were asked for but none can be read."""


class TokenFile:
    """A file of tokens, one a line, re-read whenever it changes (its mtime, size or inode).
    Mid-rotation it may be briefly missing or empty: its last tokens stay."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokens = _read_tokens(path)
        self._stamp = _stamp(path)
        self._missing: OSError | None = None

    def tokens(self) -> tuple[bytes, ...]:
        try:
            stamp = _stamp(self.path)
        except OSError as error:
            if self._missing is None:  # said once, not at every call
                logger.warning("token file %s: %s; keeping its last tokens", self.path, error)
            self._missing = error
            return self._tokens
        self._missing = None
        if stamp == self._stamp:
            return self._tokens
        try:
            tokens = _read_tokens(self.path)
        except (OSError, ValueError) as error:  # ValueError: not UTF-8
            logger.warning("token file %s: %s; keeping its last tokens", self.path, error)
            self._stamp = stamp
            return self._tokens
        self._stamp = stamp  # read once per change, whatever it held
        if not tokens:
            logger.warning("the token file %s holds no token; keeping its last tokens", self.path)
            return self._tokens
        self._tokens = tokens
        logger.info("token file %s re-read: %d tokens", self.path, len(tokens))
        return tokens


class TokenSet:
    """The tokens a server accepts: those of the environment, and those of a file, re-read
    whenever the file changes."""

    def __init__(self, path: Path | None = None, fixed: Sequence[str] = ()) -> None:
        self.path = path
        self.fixed = tuple(t.encode() for t in fixed if t)
        self._file = None if path is None else TokenFile(path)
        if not self._all():
            raise AuthConfigError(f"no token in {path or 'the environment'}")

    @classmethod
    def from_options(
        cls, token_file: Path | None, environ: Mapping[str, str], env_name: str
    ) -> TokenSet | None:
        """None when neither the file nor the variable is given: authentication off."""
        from_env = [t.strip() for t in environ.get(env_name, "").split(",")]
        if token_file is None and not any(from_env):
            return None
        return cls(token_file, from_env)

    def accepts(self, token: str) -> bool:
        candidate = token.encode()
        matched = False
        for known in self._all():
            matched |= hmac.compare_digest(known, candidate)  # no early exit
        return matched

    def _all(self) -> tuple[bytes, ...]:
        return self.fixed + (() if self._file is None else self._file.tokens())


class ClientToken:
    """The token a client sends: the first line of a file, re-read when the file changes
    (so a frontend follows a rotated engine token without a restart: write the new token on
    the first line, the old one after it until every engine has the new one), or a fixed
    one from the environment."""

    def __init__(self, path: Path | None = None, fixed: str = "") -> None:
        self._file = None if path is None else TokenFile(path)
        self._fixed = fixed
        if not (fixed if self._file is None else self._file.tokens()):
            raise AuthConfigError(f"no token in {path or 'the environment'}")

    @classmethod
    def from_options(
        cls, token_file: Path | None, environ: Mapping[str, str], env_name: str
    ) -> ClientToken | None:
        """None when neither the file nor the variable is given: no authorization sent."""
        fixed = environ.get(env_name, "").strip()
        if token_file is None and not fixed:
            return None
        return cls(token_file, "" if token_file is not None else fixed)

    def current(self) -> str:
        return self._fixed if self._file is None else self._file.tokens()[0].decode()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted token with UNAUTHENTICATED. Placed after the
    metrics interceptor, so refusals are counted in grpc_server_handled_total."""

    def __init__(self, tokens: TokenSet, withdrawals: Withdrawals | None = None) -> None:
        self.tokens = tokens
        self.withdrawals = withdrawals or {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_METHOD_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if not self.tokens.accepts(token):
            return _refusing(handler)
        if handler.request_streaming:
            withdraws = self.withdrawals.get(handler_call_details.method, _nothing)
            return _rechecking(handler, token, self.tokens, withdraws)
        return handler


def server_interceptors(
    metrics: grpc.aio.ServerInterceptor,
    tokens: TokenSet | None,
    withdrawals: Withdrawals | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: metrics first, so a refused call is counted
    (grpc_server_handled_total, grpc_code Unauthenticated)."""
    if tokens is None:
        return [metrics]
    return [metrics, BearerTokenInterceptor(tokens, withdrawals)]


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The token of the call's `authorization: Bearer TOKEN` metadata, or "". The scheme's
    name in any case, as HTTP's authentication schemes are (RFC 9110, 11.1)."""
    for key, value in metadata or ():
        if (
            key == AUTHORIZATION
            and isinstance(value, str)
            and value[: len(BEARER)].lower() == BEARER.lower()
        ):
            return value[len(BEARER) :].strip()
    return ""


def _nothing(message: Any) -> bool:
    return False


def _rechecking(
    handler: grpc.RpcMethodHandler,
    token: str,
    tokens: TokenSet,
    withdraws: Callable[[Any], bool],
) -> grpc.RpcMethodHandler:
    """A request-streaming call may outlive its token (the frontend's GenerateMany call runs
    for as long as both services do): each of its messages is let in only while the token is
    still accepted, so a revoked token ends the call UNAUTHENTICATED at its next message.
    A message that only withdraws work (`withdraws`) is let in still: a client that rotated
    its token can cancel what it sent before on the call that carries it."""

    async def checked(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if not (withdraws(request) or tokens.accepts(token)):
                raise TokenRevokedError(REFUSAL)
            yield request

    return checking_requests(handler, checked)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # never reached: makes this a generator, as a streaming handler is

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    behavior = refuse_stream if handler.response_streaming else refuse
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def client_interceptors(token: ClientToken) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `authorization: Bearer TOKEN` to every unary, server-streaming
    and bidirectional call of a grpc.aio channel, TOKEN the current one at each call. One
    object a call type: a channel files each interceptor under the first type it implements."""
    return [_UnaryWithToken(token), _StreamWithToken(token), _BidiWithToken(token)]


class _WithToken:
    def __init__(self, token: ClientToken) -> None:
        self.token = token

    def with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        token_metadata = call_metadata(self.token.current())
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *token_metadata)
        return details._replace(metadata=metadata)


class _UnaryWithToken(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.with_token(client_call_details), request)


class _StreamWithToken(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.with_token(client_call_details), request)


class _BidiWithToken(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self.with_token(client_call_details), requests)


def read_client_token(token_file: Path | None, environ: Mapping[str, str], env_name: str) -> str:
    """The token a one-shot client sends: the first line of `token_file`, else the
    variable, else "" (no authorization metadata)."""
    token = ClientToken.from_options(token_file, environ, env_name)
    return "" if token is None else token.current()


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token` on a call (none without a token)."""
    return ((AUTHORIZATION, BEARER + token),) if token else ()


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    lines = path.read_text().splitlines()
    return tuple(line.strip().encode() for line in lines if line.strip())


def _stamp(path: Path) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_mtime_ns, info.st_size, info.st_ino
