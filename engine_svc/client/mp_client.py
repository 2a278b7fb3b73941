"""The synchronous multi-process client: the in-process client's interface, with the engine
core in a background process behind ZMQ. `get_output()` blocks until the engine sends one."""

from __future__ import annotations

import itertools
import logging
from collections import deque

import zmq

from engine_svc.admission import check_request
from engine_svc.client.engine_procs import EngineProcesses
from engine_svc.client.utility_calls import as_steps
from engine_svc.config import EngineConfig
from engine_svc.control_messages import (
    EngineDead,
    EngineInfo,
    RequestRejected,
    ShutdownRequest,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
    UtilityValue,
)
from engine_svc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine_svc.proc.wire import (
    EngineInput,
    EngineOutput,
    OutputType,
    RequestType,
    decode_output,
    encode_request,
)
from shared.engine_load import RankLoad
from shared.errors import EngineDeadError

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0


class SyncMPClient:
    def __init__(
        self,
        config: EngineConfig,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_level: str = "INFO",
    ) -> None:
        self._procs = EngineProcesses(config, log_level=log_level)
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(self._procs.input_addresses[0])
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(self._procs.output_address)
        self._procs.start()
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        for sentinel in self._procs.sentinels:
            self._poller.register(sentinel, zmq.POLLIN)
        self._unfinished: set[str] = set()
        self._buffered: deque[EngineCoreOutputs] = deque()
        self._call_ids = itertools.count()
        self._is_shut_down = False
        self._is_dead = False
        try:
            self.engine_info = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- the in-process client's interface --------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises InvalidRequestError, naming the field, for a request that cannot run."""
        check_request(request, self.engine_info)
        self._send(RequestType.ADD, request)
        self._unfinished.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(RequestType.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs. A request the engine refused comes back finished with
        FinishReason.ERROR and the reason in `error`."""
        while not self._buffered:
            self._handle(self._receive(timeout_s=None))
        return self._buffered.popleft()

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call_utility(UtilityMethod.RESET_PREFIX_CACHE))

    def pause(self) -> None:
        """Returns once the engine has stopped scheduling; it still takes requests and aborts."""
        self._call_utility(UtilityMethod.PAUSE)

    def resume(self) -> None:
        self._call_utility(UtilityMethod.RESUME)

    def resume_for_steps(self, max_steps: int) -> int:
        """Schedule at most `max_steps` batches, pause again, and return once their outputs
        are in (buffered for get_output()) or no request is left: the steps it ran. A PAUSE
        or RESUME sent meanwhile ends it at once."""
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {max_steps}")
        return as_steps(self._call_utility(UtilityMethod.RESUME, max_steps))

    def get_load(self) -> RankLoad:
        value = self._call_utility(UtilityMethod.GET_LOAD)
        if not isinstance(value, RankLoad):
            raise TypeError(f"GET_LOAD answered {value!r}")
        return value

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Ask the engine to drain for `timeout_s` (0: abort), wait for it, then clean up."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if not self._is_dead and self._procs.exit_code(0) is None:
            try:
                self._input.send_multipart(
                    encode_request(RequestType.SHUTDOWN, ShutdownRequest(timeout_s)),
                    flags=zmq.NOBLOCK,
                )
            except zmq.Again:
                logger.warning("the engine is not reading its input: killing it")
            self._procs.wait(timeout_s + 5.0)
        self._procs.close()
        self._context.destroy(linger=0)

    # ---- internals -----------------------------------------------------------------------

    def _send(self, request_type: RequestType, payload: EngineInput) -> None:
        if self._is_shut_down:
            raise EngineDeadError("the client is shut down")
        self._input.send_multipart(encode_request(request_type, payload))

    def _receive(self, timeout_s: float | None) -> tuple[OutputType, EngineOutput]:
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        events = dict(self._poller.poll(timeout_ms))
        if self._output in events:
            output_type, _, payload = decode_output(self._output.recv_multipart())
            return output_type, payload
        if events:  # a sentinel: the process is gone and sent nothing more
            self._is_dead = True
            raise EngineDeadError(f"engine core exited with code {self._procs.exit_code(0)}")
        raise TimeoutError(f"no message from the engine within {timeout_s} s")

    def _handle(self, message: tuple[OutputType, EngineOutput]) -> UtilityResult | None:
        _, payload = message
        if isinstance(payload, EngineDead):
            self._is_dead = True
            raise EngineDeadError(f"engine core died: {payload.reason}")
        if isinstance(payload, EngineCoreOutputs):
            for output in payload.outputs:
                if output.finished:
                    self._unfinished.discard(output.request_id)
            self._buffered.append(payload)
        elif isinstance(payload, RequestRejected):
            self._unfinished.discard(payload.request_id)
            rejected = EngineCoreOutput(
                request_id=payload.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=f"{payload.field}: {payload.message}",
            )
            self._buffered.append(EngineCoreOutputs(outputs=[rejected]))
        elif isinstance(payload, UtilityResult):
            return payload
        return None

    def _call_utility(self, method: UtilityMethod, max_steps: int | None = None) -> UtilityValue:
        call_id = next(self._call_ids)
        self._send(RequestType.UTILITY, UtilityCall(call_id, method, max_steps))
        while True:
            # Outputs that arrive meanwhile are buffered for get_output().
            result = self._handle(self._receive(timeout_s=None))
            if result is not None and result.call_id == call_id:
                if result.error is not None:
                    raise RuntimeError(f"{method.name} failed in the engine: {result.error}")
                return result.value

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        output_type, payload = self._receive(timeout_s)
        if isinstance(payload, EngineDead):
            self._is_dead = True
            raise EngineDeadError(f"engine core failed to start: {payload.reason}")
        if not isinstance(payload, EngineInfo):
            raise RuntimeError(f"expected READY from the engine, got {output_type.name}")
        return payload
