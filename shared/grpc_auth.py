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

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
BEARER = "Bearer "
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REFUSAL = "a valid bearer token is required (metadata `authorization: Bearer TOKEN`)"

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class AuthConfigError(ValueError):
    """Tokens were asked for but none can be read."""


class TokenSet:
    """The tokens a server accepts: those of the environment, and those of a file, re-read
    whenever the file changes (its mtime, size or inode)."""

    def __init__(self, path: Path | None = None, fixed: Sequence[str] = ()) -> None:
        self.path = path
        self.fixed = tuple(t.encode() for t in fixed if t)
        self._file_tokens: tuple[bytes, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        if path is not None:
            self._file_tokens = _read_tokens(path)
            self._stamp = _stamp(path)
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
        self._reload_if_changed()
        return self.fixed + self._file_tokens

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return
            tokens = _read_tokens(self.path)
        except OSError as error:
            # Mid-rotation the file can be briefly missing: keep the tokens we have.
            logger.warning(
                "cannot read the token file %s (%s); keeping its last tokens", self.path, error
            )
            return
        self._stamp = stamp  # read once per change, whatever it held
        if not tokens:
            logger.warning("the token file %s holds no token; keeping its last tokens", self.path)
            return
        self._file_tokens = tokens
        logger.info("token file %s re-read: %d tokens", self.path, len(tokens))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted token with UNAUTHENTICATED. Placed after the
    metrics interceptor, so refusals are counted in grpc_server_handled_total."""

    def __init__(self, tokens: TokenSet) -> None:
        self.tokens = tokens

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_METHOD_PREFIXES):
            return handler
        if self.tokens.accepts(bearer_token(handler_call_details.invocation_metadata)):
            return handler
        return _refusing(handler)


def server_interceptors(
    metrics: grpc.aio.ServerInterceptor, tokens: TokenSet | None
) -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: metrics first, so a refused call is counted
    (grpc_server_handled_total, grpc_code Unauthenticated)."""
    return [metrics] if tokens is None else [metrics, BearerTokenInterceptor(tokens)]


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The token of the call's `authorization: Bearer TOKEN` metadata, or ""."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER) :].strip()
    return ""


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


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `authorization: Bearer TOKEN` to every unary and
    server-streaming call of a grpc.aio channel. Two objects: a channel files each
    interceptor under the first call type it implements only."""
    return [_UnaryWithToken(token), _StreamWithToken(token)]


class _WithToken:
    def __init__(self, token: str) -> None:
        self.metadata = call_metadata(token)

    def with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
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


def read_client_token(token_file: Path | None, environ: Mapping[str, str], env_name: str) -> str:
    """The token a client sends: the first line of `token_file`, else the variable, else ""
    (no authorization metadata)."""
    if token_file is not None:
        tokens = _read_tokens(token_file)
        if not tokens:
            raise AuthConfigError(f"no token in {token_file}")
        return tokens[0].decode()
    return environ.get(env_name, "").strip()


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token` on a call (none without a token)."""
    return ((AUTHORIZATION, BEARER + token),) if token else ()


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    lines = path.read_text().splitlines()
    return tuple(line.strip().encode() for line in lines if line.strip())


def _stamp(path: Path) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_mtime_ns, info.st_size, info.st_ino
