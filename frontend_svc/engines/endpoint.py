"""One engine address: its channel and stub, whether it serves (grpc.health.v1 Watch), what
it serves (GetModelInfo) and how loaded it is (GetLoads, plus this frontend's own count)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend_svc.engines.convert import to_engine_load, to_model_info
from frontend_svc.engines.errors import REFUSALS
from frontend_svc.engines.multiplexer import Multiplexer
from frontend_svc.messages import ModelInfo
from shared.engine_load import EngineLoad
from shared.grpc_auth import ClientToken, client_interceptors
from shared.grpc_tls import ClientTLS, FilesWatcher
from shared.protos import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC's default backoff grows to two minutes: an engine that restarts would sit unused
    # long after it is back.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
SERVING = health_pb2.HealthCheckResponse.SERVING
# After a TLS rotation, calls still running on the old channel get this long to finish.
RETIRED_CHANNEL_GRACE_S = 600.0


class EngineEndpoint:
    def __init__(
        self,
        address: str,
        poll_interval_s: float,
        on_change: Callable[[], None],
        auth_token: ClientToken | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self.address = address
        self.poll_interval_s = poll_interval_s
        self.on_change = on_change
        # With a token, every call carries it (the engine may require one).
        self._auth_token = auth_token
        self._retired_muxes: set[Multiplexer] = set()  # draining after a rotation
        self._interceptors = None if auth_token is None else client_interceptors(auth_token)
        # Under TLS, rewritten certificate files (a rotated secret) open a new channel.
        self._tls_files = None if tls is None else FilesWatcher(tls.files(), tls.credentials)
        self._options = CHANNEL_OPTIONS + ([] if tls is None else tls.channel_options())
        self._open_channel(None if self._tls_files is None else self._tls_files.current)
        self.is_serving = False
        self.suspended_until = 0.0
        # Why the engine refuses this frontend's calls (its token or certificate), while it
        # does: out of service meanwhile, though its health (open to all) says SERVING.
        self.refused: str | None = None
        self.model_info: ModelInfo | None = None
        self.reported_load: EngineLoad | None = None
        self.num_in_flight = 0  # this frontend's engine calls on it
        self.num_picked = 0
        self._tasks: list[asyncio.Task[None]] = []

        self._health_task: asyncio.Task[None] | None = None
        # Channels replaced after a TLS rotation, closing once their calls end.
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}

    def _open_channel(self, credentials: grpc.ChannelCredentials | None) -> None:
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(
                self.address, options=self._options, interceptors=self._interceptors
            )
        else:
            self.channel = grpc.aio.secure_channel(
                self.address, credentials, options=self._options, interceptors=self._interceptors
            )
        self.stub = engine_pb2_grpc.EngineCoreServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._new_mux()

    def _new_mux(self) -> None:
        # Requests go over one GenerateMany call (multiplexer.py), carrying the token of the
        # time it opened; one retired (a new channel, a new token) ends after its last request.
        self.mux = Multiplexer(self.stub, self.address, MAX_MESSAGE_BYTES)
        self._mux_token = None if self._auth_token is None else self._auth_token.current()

    def start(self) -> None:
        self._health_task = asyncio.create_task(self._watch_health(), name=f"health {self.address}")
        self._tasks = [asyncio.create_task(self._poll_loads(), name=f"loads {self.address}")]

    async def close(self, grace_s: float | None = None) -> None:
        tasks = [*self._tasks, *([self._health_task] if self._health_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        muxes = [self.mux, *self._retired_muxes]
        for mux in muxes:
            mux.drain()
        await self.channel.close(grace_s)
        for mux in muxes:
            await mux.close()
        for channel, closing in list(self._retired.items()):
            closing.cancel()  # its calls get the same grace as the current channel's
            await channel.close(grace_s)

    def _follow_tls_rotation(self) -> None:
        """New calls go over a channel with the rewritten TLS files; calls on the old one
        finish there (up to RETIRED_CHANNEL_GRACE_S)."""
        credentials = None if self._tls_files is None else self._tls_files.changed()
        if credentials is None:
            return
        logger.info("engine %s: the TLS client files changed; new calls use them", self.address)
        retired = self.channel
        self._retire_mux()
        self._open_channel(credentials)
        closing = asyncio.create_task(retired.close(RETIRED_CHANNEL_GRACE_S))
        self._retired[retired] = closing
        closing.add_done_callback(lambda _: self._retired.pop(retired, None))
        if self._health_task is not None:  # watch health over the new channel
            self._health_task.cancel()
            self._health_task = asyncio.create_task(
                self._watch_health(), name=f"health {self.address}"
            )

    @property
    def is_available(self) -> bool:
        return self.is_serving and self.refused is None and time.monotonic() >= self.suspended_until

    @property
    def load_score(self) -> float:
        """Requests per rank. The engine's report counts every frontend's requests but lags
        by a poll; our own count is current: the larger is the better estimate."""
        reported = self.reported_load
        if reported is None:
            return float(self.num_in_flight)
        total = max(self.num_in_flight, reported.num_running + reported.num_waiting)
        return total / reported.num_ranks

    @property
    def num_reported_waiting(self) -> int:
        return 0 if self.reported_load is None else self.reported_load.num_waiting

    def suspend(self, seconds: float) -> None:
        """Take the engine out after a failed call, until the next health report or for
        `seconds` (a health watch that still says SERVING would never put it back)."""
        self.suspended_until = time.monotonic() + seconds
        self.on_change()

    @contextlib.contextmanager
    def track_call(self) -> Iterator[None]:
        self.num_in_flight += 1
        self.num_picked += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    async def _watch_health(self) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                async for response in self.health_stub.Watch(request):
                    serving = response.status == SERVING
                    if serving and self.model_info is None:
                        self.model_info = to_model_info(
                            await self.stub.GetModelInfo(
                                engine_pb2.GetModelInfoRequest(), timeout=self.poll_interval_s * 4
                            )
                        )
                        self._set_refused(None)
                    self._set_serving(serving)
            except grpc.aio.AioRpcError as error:
                if not self._note_refusal(error):
                    logger.debug("health watch on %s: %s", self.address, error.code().name)
            self._set_serving(False)
            await asyncio.sleep(self.poll_interval_s)

    def multiplexer(self) -> Multiplexer:
        """The shared call for a new request: one that carries the token as it is now (the
        engine may stop accepting the old one as soon as the rotation is done)."""
        self._follow_token_rotation()
        return self.mux

    def _follow_token_rotation(self) -> None:
        if self._auth_token is not None and self._auth_token.current() != self._mux_token:
            logger.info("engine %s: the token changed; new requests use it", self.address)
            self._retire_mux()
            self._new_mux()

    def _retire_mux(self) -> None:
        """The shared call ends after its last request; closing the endpoint drains and
        closes it with the current one."""
        self.mux.drain()
        self._retired_muxes = {m for m in self._retired_muxes if m.is_open} | {self.mux}

    async def _poll_loads(self) -> None:
        while True:
            self._follow_tls_rotation()
            if self.is_serving:
                try:
                    response = await self.stub.GetLoads(
                        engine_pb2.GetLoadsRequest(), timeout=self.poll_interval_s * 4
                    )
                    self.reported_load = to_engine_load(response)
                    self._set_refused(None)
                except grpc.aio.AioRpcError as error:
                    self.reported_load = None
                    self._note_refusal(error)
            await asyncio.sleep(self.poll_interval_s)

    def _note_refusal(self, error: grpc.aio.AioRpcError) -> bool:
        """Whether `error` is the engine refusing this frontend (noted, and logged once)."""
        if error.code() not in REFUSALS:
            return False
        self._set_refused(f"{error.code().name}: {error.details()}")
        return True

    def _set_refused(self, refused: str | None) -> None:
        if refused == self.refused:
            return
        if refused is not None:
            logger.warning(
                "engine %s refuses this frontend's calls (check --engine-auth-token-file and "
                "the TLS files): %s",
                self.address,
                refused,
            )
        elif self.is_serving:
            logger.info("engine %s accepts this frontend's calls again", self.address)
        self.refused = refused
        self.on_change()

    def _set_serving(self, serving: bool) -> None:
        if serving:
            self.suspended_until = 0.0
            if not self.is_serving:
                # Back after an outage: perhaps another version now (a rolling upgrade).
                self.mux.is_supported = True
        if serving != self.is_serving:
            logger.info("engine %s is %s", self.address, "serving" if serving else "not serving")
            self.is_serving = serving
            self.on_change()
