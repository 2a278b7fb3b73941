"""The asyncio multi-process client that the gRPC server holds: engine processes behind ZMQ,
one output stream per request, and the failure model (ENGINE_CORE_DEAD, process monitor)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import zmq
import zmq.asyncio

from engine_svc.admission import check_request
from engine_svc.client.engine_procs import EngineProcesses
from engine_svc.client.observer import GuardedObserver, NullObserver, RequestObserver
from engine_svc.client.output_stream import OutputGroup, RequestOutputStream
from engine_svc.client.proc_monitor import ProcessMonitor
from engine_svc.client.utility_calls import PendingUtilityCalls, as_steps, unwrap
from engine_svc.config import EngineConfig
from engine_svc.control_messages import (
    EngineDead,
    EngineInfo,
    RequestRejected,
    ShutdownRequest,
    UtilityMethod,
    UtilityResult,
    UtilityValue,
)
from engine_svc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine_svc.proc.wire import (
    EngineInput,
    EngineOutput,
    RequestType,
    decode_output,
    encode_request,
)
from shared.engine_load import RankLoad
from shared.errors import EngineDeadError, EngineUnavailableError, InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
EXIT_GRACE_S = 10.0  # beyond the drain timeout, for the engines to flush and exit
STREAM_FLUSH_S = 1.0  # for outputs already sent when an engine exited to reach their streams

DeadCallback = Callable[[EngineDeadError], None]


class AsyncMPClient:
    def __init__(
        self,
        config: EngineConfig,
        shutdown_timeout_s: float = 0.0,
        log_level: str = "INFO",
        num_ranks: int = 1,
    ) -> None:
        self._procs = EngineProcesses(config, num_ranks, shutdown_timeout_s, log_level)
        self._stream_interval = config.stream_interval
        self._context = zmq.asyncio.Context()
        self._inputs = [self._context.socket(zmq.PUSH) for _ in range(num_ranks)]
        for socket, address in zip(self._inputs, self._procs.input_addresses, strict=True):
            socket.bind(address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(self._procs.output_address)
        self._monitor: ProcessMonitor | None = None
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._streams: dict[str, RequestOutputStream] = {}
        self._rank_of: dict[str, int] = {}
        self.num_unfinished = [0] * num_ranks  # per rank
        self._utility_calls = PendingUtilityCalls()
        self.engine_infos: list[EngineInfo | None] = [None] * num_ranks
        self._ready = asyncio.Event()
        self._exited: set[int] = set()
        self._all_exited = asyncio.Event()
        self._accepting = False
        self._shutting_down = False
        self.dead_error: EngineDeadError | None = None
        self._died = asyncio.Event()
        self._dead_callbacks: list[DeadCallback] = []
        self._observer: RequestObserver = NullObserver()

    @property
    def num_ranks(self) -> int:
        return self._procs.num_ranks

    @property
    def ready_engine_infos(self) -> list[EngineInfo]:
        """Each rank's limits, once all are ready."""
        infos = [info for info in self.engine_infos if info is not None]
        if len(infos) < self.num_ranks:
            raise EngineUnavailableError("the engine is still starting")
        return infos

    # ---- life cycle ----------------------------------------------------------------------

    async def start(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Spawn the engines and wait until every rank is ready (or one dies)."""
        loop = asyncio.get_running_loop()
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-outputs")
        self._procs.start()

        def on_exit(rank: int, exit_code: int | None) -> None:  # on the monitor's thread
            loop.call_soon_threadsafe(self._on_process_exit, rank, exit_code)

        self._monitor = ProcessMonitor(self._procs.processes, on_exit)
        self._monitor.start()
        waits = {asyncio.create_task(self._ready.wait()), asyncio.create_task(self._died.wait())}
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when="FIRST_COMPLETED")
        for wait in waits:
            wait.cancel()
        if self.dead_error is not None:
            raise self.dead_error
        if not done:
            raise TimeoutError(f"the engine was not ready within {timeout_s} s")
        self._accepting = True

    def add_dead_callback(self, callback: DeadCallback) -> None:
        self._dead_callbacks.append(callback)

    def set_observer(self, observer: RequestObserver) -> None:
        """Who hears of every request and output from now on (metrics)."""
        self._observer = GuardedObserver(observer)

    def check_accepting(self) -> None:
        """Raise unless new requests and utility calls are welcome now."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._shutting_down:
            raise EngineUnavailableError("the engine is shutting down")
        if not self._accepting:
            raise EngineUnavailableError("the engine is still starting")

    async def shutdown_async(self, timeout_s: float) -> bool:
        """Drain for up to `timeout_s` (0: abort every request now), then wait for the engines
        to exit. True if they all exited cleanly."""
        self._accepting = False
        self._shutting_down = True
        if self.dead_error is None:
            for rank in range(self.num_ranks):
                await self._send(rank, RequestType.SHUTDOWN, ShutdownRequest(timeout_s))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s + EXIT_GRACE_S):  # wait_for can drop a cancel
                await self._all_exited.wait()
        clean = self._all_exited.is_set() and self.dead_error is None
        deadline = asyncio.get_running_loop().time() + STREAM_FLUSH_S
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        self._fail_all(EngineUnavailableError("the engine shut down"))
        return clean

    async def close(self) -> None:
        """Stop everything now, engines included. Safe to call twice."""
        self._accepting = False
        if self._monitor is not None:
            self._monitor.stop()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_all(EngineUnavailableError("the engine client is closed"))
        self._procs.close()
        self._context.destroy(linger=0)

    # ---- requests ------------------------------------------------------------------------

    async def add_request_async(
        self, request: EngineCoreRequest, group: OutputGroup | None = None
    ) -> RequestOutputStream:
        """The request's output stream, read alone or with the rest of `group`."""
        self.check_accepting()
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        rank = self._select_rank(request)
        check_request(request, self.ready_engine_infos[rank])
        stream = RequestOutputStream(request_id, self._stream_interval, group)
        self._streams[request_id] = stream
        self._rank_of[request_id] = rank
        self.num_unfinished[rank] += 1
        self._observer.on_request_added(request, rank)
        try:
            await self._send(rank, RequestType.ADD, request)
        except BaseException:
            # Cancelled mid-send: the engine may or may not have the request.
            self.abort_soon([request_id])
            self._forget(request_id)
            raise
        return stream

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        """Add a request and yield its outputs until it finishes. Closing the iterator early
        (the caller was cancelled) aborts the request in the engine."""
        stream = await self.add_request_async(request)
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.is_done:
                self.abort_soon([request.request_id])

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort by id; ids not in flight are ignored. Their streams end with ABORT."""
        for rank, ids in self._by_rank(request_ids).items():
            await self._send(rank, RequestType.ABORT, ids)

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort from code that cannot wait (a generator being closed)."""
        if self.dead_error is not None:
            return
        for rank, ids in self._by_rank(request_ids).items():
            send = self._send(rank, RequestType.ABORT, ids)
            task = asyncio.get_running_loop().create_task(send)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _by_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.get(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        return by_rank

    def _select_rank(self, request: EngineCoreRequest) -> int:
        return 0

    # ---- utility calls -------------------------------------------------------------------

    async def reset_prefix_cache_async(self) -> bool:
        results = await self._call_all(UtilityMethod.RESET_PREFIX_CACHE)
        return all(bool(r) for r in results)

    async def pause_async(self) -> None:
        """Returns once every rank has stopped scheduling."""
        await self._call_all(UtilityMethod.PAUSE)

    async def resume_async(self) -> None:
        await self._call_all(UtilityMethod.RESUME)

    async def resume_for_steps_async(self, max_steps: int) -> list[int]:
        """Every rank schedules at most `max_steps` batches and pauses again; returns once
        their outputs are sent (a rank with no request left answers at once): the steps
        each rank ran, by rank."""
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {max_steps}")
        return [as_steps(r) for r in await self._call_all(UtilityMethod.RESUME, max_steps)]

    async def get_loads_async(self) -> list[RankLoad]:
        results = await self._call_all(UtilityMethod.GET_LOAD)
        return [r for r in results if isinstance(r, RankLoad)]

    async def _call_all(
        self, method: UtilityMethod, max_steps: int | None = None
    ) -> list[UtilityValue]:
        self.check_accepting()
        calls = [self._call_utility(rank, method, max_steps) for rank in range(self.num_ranks)]
        return list(await asyncio.gather(*calls))

    async def _call_utility(
        self, rank: int, method: UtilityMethod, max_steps: int | None = None
    ) -> UtilityValue:
        call, result = self._utility_calls.new_call(method, max_steps)
        await self._send(rank, RequestType.UTILITY, call)
        return unwrap(await result, method, rank)

    # ---- engine -> client ----------------------------------------------------------------

    async def _send(self, rank: int, request_type: RequestType, payload: EngineInput) -> None:
        await self._inputs[rank].send_multipart(encode_request(request_type, payload))

    async def _read_outputs(self) -> None:
        while True:
            frames = await self._output.recv_multipart()
            try:
                _, rank, payload = decode_output(frames)
                self._dispatch(rank, payload)
            except Exception:
                logger.exception("could not handle a message from the engine")

    def _dispatch(self, rank: int, payload: EngineOutput) -> None:
        if isinstance(payload, EngineCoreOutputs):
            self._observer.on_outputs(rank, payload)
            for output in payload.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        self._forget(output.request_id)
        elif isinstance(payload, RequestRejected):
            stream = self._forget(payload.request_id)
            if stream is not None:
                stream.fail(_rejection_error(payload))
        elif isinstance(payload, UtilityResult):
            self._utility_calls.settle(payload)
        elif isinstance(payload, EngineInfo):
            self.engine_infos[rank] = payload
            if all(info is not None for info in self.engine_infos):
                self._ready.set()
        elif isinstance(payload, EngineDead):
            self._on_dead(EngineDeadError(f"engine core {rank} died: {payload.reason}"))

    def _forget(self, request_id: str) -> RequestOutputStream | None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.num_unfinished[rank] -= 1
            self._observer.on_request_gone(request_id)
        return self._streams.pop(request_id, None)

    # ---- failure -------------------------------------------------------------------------

    def _on_process_exit(self, rank: int, exit_code: int | None) -> None:
        if self._shutting_down and exit_code == 0:
            self._exited.add(rank)
            if len(self._exited) == self.num_ranks:
                self._all_exited.set()
            return
        self._on_dead(EngineDeadError(f"engine core {rank} exited with code {exit_code}"))

    def _on_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        logger.error("%s", error)
        self.dead_error = error
        self._died.set()
        self._accepting = False
        self._fail_all(error)
        for callback in self._dead_callbacks:
            callback(error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            stream = self._forget(request_id)
            if stream is not None:
                stream.fail(error)
        self._utility_calls.fail_all(error)


def _rejection_error(rejected: RequestRejected) -> Exception:
    if rejected.unavailable:
        return EngineUnavailableError(rejected.message)
    return InvalidRequestError(rejected.field, rejected.message)
