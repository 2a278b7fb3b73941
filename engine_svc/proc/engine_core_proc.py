"""EngineCoreProc: the engine core's busy loop in a background process, fed by queues.

`while not done: process_input_queue(); process_engine_step()`. The loop sleeps on its input
queue when it has nothing to step, takes in new requests while a forward runs, and shuts
down in drain mode (finish in-flight requests, up to a deadline) or abort mode (timeout 0).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from engine_svc.config import EngineConfig
from engine_svc.control_messages import (
    RequestRejected,
    ShutdownRequest,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from engine_svc.core.engine_core import EngineCore
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from engine_svc.proc.engine_io import EngineIO
from engine_svc.proc.wire import EngineInput, OutputType, RequestType
from shared.engine_load import RankLoad
from shared.errors import InvalidRequestError

logger = logging.getLogger(__name__)

InputItem = tuple[RequestType, EngineInput]
FAILURE_CALLBACK_WAIT_S = 1.0


class ExecutorFailedError(RuntimeError):
    """A worker failed: the engine cannot step any more."""


class EngineCoreProc(EngineCore):
    def __init__(self, config: EngineConfig, io: EngineIO) -> None:
        # Set before the core is built: the executor's failure callback reaches for it.
        self.io = io
        self._deferred: list[InputItem] = []
        self._shutdown_deadline: float | None = None
        self._executor_failure = threading.Event()
        self._last_stats_sent: SchedulerStats | None = None
        # A bounded RESUME, answered when its steps are done: the call, and the batch count
        # when it began.
        self._stepping: tuple[UtilityCall, int] | None = None
        super().__init__(config)

    @property
    def is_shutting_down(self) -> bool:
        return self._shutdown_deadline is not None

    def run_busy_loop(self) -> None:
        self.io.send(OutputType.READY, self.info(self.io.engine_index))
        while not (self.is_shutting_down and not self._has_unfinished()):
            self._process_input_queue()
            self._process_engine_step()
            self._settle_stepping()
        logger.info("engine core %d shut down", self.io.engine_index)

    def _has_unfinished(self) -> bool:
        return self.has_work() or bool(self.batch_queue)

    def _nothing_to_step(self) -> bool:
        if self._deferred or self.is_shutting_down:
            return False
        if self.is_paused:  # only outputs to send and batches to collect
            return not (self._pending_outputs or self.batch_queue)
        return not self._has_unfinished()

    # ---- input -----------------------------------------------------------------------

    def _process_input_queue(self) -> None:
        if self._nothing_to_step():
            # Sleep on the queue instead of spinning a core.
            self._handle(*self.io.input_queue.get())
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._handle(*item)
        while True:
            try:
                item = self.io.input_queue.get_nowait()
            except queue.Empty:
                break
            self._handle(*item)
        self._enforce_shutdown_deadline()

    def overlap_forward(self, scheduler_output: SchedulerOutput) -> None:
        """While the forward runs: admit new requests and note aborts (the rest waits until
        the step is over, when the scheduler's state is settled), then the core's own work."""
        self._take_in_during_forward()
        super().overlap_forward(scheduler_output)

    def _take_in_during_forward(self) -> None:
        """Inputs keep their order: once one waits for the step's end (a shutdown, a
        utility call), every later one waits behind it, so nothing sent after a SHUTDOWN
        is admitted."""
        while True:
            try:
                request_type, payload = self.io.input_queue.get_nowait()
            except queue.Empty:
                return
            if self._deferred:
                self._deferred.append((request_type, payload))
            elif request_type == RequestType.ADD and isinstance(payload, EngineCoreRequest):
                self._add(payload)
            elif request_type == RequestType.ABORT and isinstance(payload, list):
                self.abort_requests_in_flight(payload)
            else:
                self._deferred.append((request_type, payload))

    def _handle(self, request_type: RequestType, payload: EngineInput) -> None:
        if request_type == RequestType.EXECUTOR_FAILED:
            error = self.executor_failed
            raise ExecutorFailedError(f"Executor failed: {_describe(error)}") from error
        if isinstance(payload, EngineCoreRequest):
            self._add(payload)
        elif isinstance(payload, list):
            self.abort_requests(payload)
        elif isinstance(payload, UtilityCall):
            self._call_utility(payload)
        elif isinstance(payload, ShutdownRequest):
            self._begin_shutdown(payload.timeout_s)

    def _add(self, request: EngineCoreRequest) -> None:
        request_id = request.request_id
        if self.is_shutting_down:
            self.io.send(
                OutputType.REJECTED,
                RequestRejected(request_id, "request", "the engine is shutting down", True),
            )
            return
        try:
            self.add_request(request)
        except InvalidRequestError as error:
            self.io.send(
                OutputType.REJECTED, RequestRejected(request_id, error.field, error.message)
            )
        except Exception as error:
            # A failure that belongs to this one request ends it; the others go on.
            logger.exception("request %s failed on admission", request_id)
            failed = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=f"{type(error).__name__}: {error}",
            )
            self.io.send(OutputType.OUTPUTS, EngineCoreOutputs(outputs=[failed]))

    def _call_utility(self, call: UtilityCall) -> None:
        if call.method in (UtilityMethod.PAUSE, UtilityMethod.RESUME):
            self._answer_stepping()  # one pending is taken over: answered with its steps so far
        bounded = call.method == UtilityMethod.RESUME and call.max_steps is not None
        if bounded and not self.is_shutting_down:
            self._resume_for_steps(call)
            return
        if self.is_shutting_down:
            result = UtilityResult(call.call_id, error="shutting down", unavailable=True)
        else:
            try:
                result = UtilityResult(call.call_id, value=self._run_utility(call.method))
            except Exception as error:
                logger.exception("utility call %s failed", call.method.name)
                result = UtilityResult(call.call_id, error=f"{type(error).__name__}: {error}")
        self._send_result(result)

    def _send_result(self, result: UtilityResult) -> None:
        self.io.send(OutputType.UTILITY_RESULT, result)

    def _resume_for_steps(self, call: UtilityCall) -> None:
        try:
            self.resume(call.max_steps)
        except ValueError as error:
            self._send_result(UtilityResult(call.call_id, error=str(error)))
            return
        self._stepping = (call, self.num_batches_scheduled)

    def _settle_stepping(self) -> None:
        """A bounded RESUME is answered once its steps are done and their outputs sent
        (the engine paused itself and collected its batches), or once it has no request
        left to step (paused again: the next request waits for a resume as well)."""
        if self._stepping is None or self.batch_queue:
            return
        if self.is_resumed_for_steps:
            if self.scheduler.has_requests():
                return
            self.pause()
        self._answer_stepping()

    def _answer_stepping(self) -> None:
        """Answer the bounded RESUME with the batches scheduled since it began."""
        if self._stepping is None:
            return
        call, batches_before = self._stepping
        self._stepping = None
        steps = self.num_batches_scheduled - batches_before
        self._send_result(UtilityResult(call.call_id, value=steps))

    def _run_utility(self, method: UtilityMethod) -> RankLoad | bool:
        if method == UtilityMethod.RESET_PREFIX_CACHE:
            return self.reset_prefix_cache()
        if method == UtilityMethod.PAUSE:
            return self.pause()
        if method == UtilityMethod.RESUME:
            return self.resume()
        scheduler = self.scheduler
        pool = scheduler.kv_cache.pool
        return RankLoad(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=pool.usage,
            num_free_kv_blocks=pool.num_free_blocks,
            num_batches_in_flight=len(self.batch_queue),
            max_batches_in_flight=self.max_batches_in_flight,
        )

    # ---- shutdown --------------------------------------------------------------------

    def _begin_shutdown(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        if self._shutdown_deadline is not None:
            deadline = min(deadline, self._shutdown_deadline)
        self._shutdown_deadline = deadline
        self._answer_stepping()
        self.resume()  # a paused engine could never drain
        mode = "abort" if timeout_s <= 0 else f"drain (up to {timeout_s:g} s)"
        logger.info("engine core %d shutting down: %s", self.io.engine_index, mode)

    def _enforce_shutdown_deadline(self) -> None:
        deadline = self._shutdown_deadline
        if deadline is not None and time.monotonic() >= deadline and self.scheduler.requests:
            self.abort_requests(list(self.scheduler.requests))

    # ---- stepping --------------------------------------------------------------------

    def _process_engine_step(self) -> None:
        if self.executor_failed is not None:
            error = self.executor_failed
            raise ExecutorFailedError(f"Executor failed: {_describe(error)}") from error
        try:
            outputs, _ = self.step_fn()
        except Exception as error:
            # The forward's exception reaches us through its future, possibly a moment
            # before the executor's failure callback has run: wait that moment for it.
            if self._executor_failure.wait(FAILURE_CALLBACK_WAIT_S):
                raise ExecutorFailedError(f"Executor failed: {_describe(error)}") from error
            raise
        if outputs.outputs or self._stats_worth_sending(outputs.scheduler_stats):
            self._last_stats_sent = outputs.scheduler_stats
            self.io.send(OutputType.OUTPUTS, outputs)

    def _stats_worth_sending(self, stats: SchedulerStats | None) -> bool:
        """Stats go out alone too when they count tokens (a prefill chunk that sampled
        nothing) or changed, so that no tokens go uncounted and no gauge sticks."""
        if stats is None:
            return False
        computed = stats.num_prompt_tokens or stats.num_generation_tokens
        return bool(computed) or stats != self._last_stats_sent

    def _on_executor_failure(self, error: BaseException) -> None:
        super()._on_executor_failure(error)
        self._executor_failure.set()
        self.io.input_queue.put((RequestType.EXECUTOR_FAILED, None))


def _describe(error: BaseException | None) -> str:
    return "unknown error" if error is None else f"{type(error).__name__}: {error}"
