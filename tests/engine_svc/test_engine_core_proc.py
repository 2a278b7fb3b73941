"""The engine process's busy loop in this process, fed through its input queue and read
through its outputs: how it orders inputs that arrive while a forward runs, and what it
refuses once shutting down. Inputs are queued at points the test chooses (a hook in the
forward), never raced against the clock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_svc.config import EngineConfig
from engine_svc.control_messages import (
    RequestRejected,
    ShutdownRequest,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine_svc.proc.engine_core_proc import EngineCoreProc
from engine_svc.proc.engine_io import EngineIO
from engine_svc.proc.wire import EngineInput, EngineOutput, OutputType, RequestType
from engine_svc.sampling_params import SamplingParams
from shared.engine_load import RankLoad

InputItem = tuple[RequestType, EngineInput]


class RecordingIO(EngineIO):
    """The engine's I/O without its socket threads: the test fills the input queue and
    reads what the loop sent."""

    def __init__(self) -> None:
        super().__init__("ipc://unused-input", "ipc://unused-output", engine_index=0)
        self.sent: list[tuple[OutputType, EngineOutput]] = []
        self._changed = threading.Condition()

    def send(self, output_type: OutputType, payload: EngineOutput) -> None:
        with self._changed:
            self.sent.append((output_type, payload))
            self._changed.notify_all()

    def wait_for_result(self, call_id: int, timeout_s: float = 60.0) -> UtilityResult:
        def result() -> UtilityResult | None:
            for payload in self.of_type(OutputType.UTILITY_RESULT):
                if isinstance(payload, UtilityResult) and payload.call_id == call_id:
                    return payload
            return None

        with self._changed:
            found = self._changed.wait_for(result, timeout_s)
        assert found is not None, f"no answer to utility call {call_id} within {timeout_s} s"
        return found

    def of_type(self, output_type: OutputType) -> list[EngineOutput]:
        return [payload for kind, payload in self.sent if kind == output_type]


class HookedEngineCoreProc(EngineCoreProc):
    """Queues the given inputs while its first forward runs, as a client would."""

    def __init__(self, config: EngineConfig, io: EngineIO, during_forward: list[InputItem]):
        self.during_forward = during_forward
        self.num_forwards = 0
        super().__init__(config, io)

    def overlap_forward(self, scheduler_output: SchedulerOutput) -> None:
        self.num_forwards += 1
        for item in self.during_forward:
            self.io.input_queue.put(item)
        self.during_forward = []
        super().overlap_forward(scheduler_output)


def _utility(call_id: int, method: UtilityMethod) -> InputItem:
    return RequestType.UTILITY, UtilityCall(call_id, method)


def _shut_down(io: RecordingIO, loop: threading.Thread, drain_s: float) -> None:
    """SHUTDOWN to a busy loop running in `loop`, and wait for it to end."""
    io.input_queue.put((RequestType.SHUTDOWN, ShutdownRequest(timeout_s=drain_s)))
    loop.join(timeout=60)
    assert not loop.is_alive()


def _resume(call_id: int, max_steps: int) -> InputItem:
    return RequestType.UTILITY, UtilityCall(call_id, UtilityMethod.RESUME, max_steps=max_steps)


def _add(request_id: str, max_tokens: int = 4) -> InputItem:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    request = EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling_params=params
    )
    return RequestType.ADD, request


@pytest.fixture
def config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, max_model_len=256)


@pytest.fixture
def run_loop(config: EngineConfig) -> Callable[[list[InputItem], list[InputItem]], RecordingIO]:
    def run(before: list[InputItem], during_forward: list[InputItem]) -> RecordingIO:
        io = RecordingIO()
        proc = HookedEngineCoreProc(config, io, during_forward)
        for item in before:
            io.input_queue.put(item)
        try:
            proc.run_busy_loop()  # returns once shut down with nothing left to run
        finally:
            proc.shutdown()
        return io

    return run


def _finished(io: RecordingIO) -> dict[str, FinishReason]:
    return {
        output.request_id: output.finish_reason
        for outputs in io.of_type(OutputType.OUTPUTS)
        if isinstance(outputs, EngineCoreOutputs)
        for output in outputs.outputs
        if output.finish_reason is not None
    }


def _assert_refused_as_shutting_down(io: RecordingIO, request_id: str) -> None:
    rejected = [r for r in io.of_type(OutputType.REJECTED) if isinstance(r, RequestRejected)]
    assert [(r.request_id, r.unavailable) for r in rejected] == [(request_id, True)]
    assert "shutting down" in rejected[0].message
    results = [r for r in io.of_type(OutputType.UTILITY_RESULT) if isinstance(r, UtilityResult)]
    assert [(r.call_id, r.unavailable, r.value) for r in results] == [(7, True, None)]


def test_nothing_sent_after_a_shutdown_during_a_forward_is_admitted(
    run_loop: Callable[[list[InputItem], list[InputItem]], RecordingIO],
) -> None:
    late = [
        (RequestType.SHUTDOWN, ShutdownRequest(timeout_s=60.0)),
        _add("late"),
        (RequestType.UTILITY, UtilityCall(7, UtilityMethod.GET_LOAD)),
    ]
    io = run_loop([_add("running")], late)
    # The request in flight drains to its end; the one sent after SHUTDOWN never runs.
    assert _finished(io) == {"running": FinishReason.LENGTH}
    _assert_refused_as_shutting_down(io, "late")


def test_the_core_refuses_adds_and_utility_calls_once_shutting_down(
    run_loop: Callable[[list[InputItem], list[InputItem]], RecordingIO],
) -> None:
    # Straight to the core, with no client in front to refuse first.
    io = run_loop(
        [
            (RequestType.SHUTDOWN, ShutdownRequest(timeout_s=60.0)),
            _add("late"),
            (RequestType.UTILITY, UtilityCall(7, UtilityMethod.GET_LOAD)),
        ],
        [],
    )
    assert _finished(io) == {}
    _assert_refused_as_shutting_down(io, "late")


def test_an_add_during_a_forward_is_admitted_at_once(
    run_loop: Callable[[list[InputItem], list[InputItem]], RecordingIO],
) -> None:
    io = run_loop(
        [_add("first")],
        [_add("second"), (RequestType.SHUTDOWN, ShutdownRequest(timeout_s=60.0))],
    )
    assert _finished(io) == {"first": FinishReason.LENGTH, "second": FinishReason.LENGTH}
    assert io.of_type(OutputType.REJECTED) == []


def test_a_paused_engine_runs_no_forward_until_resumed(config: EngineConfig) -> None:
    io = RecordingIO()
    pause_at_first_forward = [_utility(1, UtilityMethod.PAUSE), _utility(2, UtilityMethod.GET_LOAD)]
    proc = HookedEngineCoreProc(config, io, pause_at_first_forward)
    io.input_queue.put(_add("paused", max_tokens=12))
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop", daemon=True)
    loop.start()
    try:
        assert io.wait_for_result(1).value is True
        load = io.wait_for_result(2).value
        assert isinstance(load, RankLoad) and load.num_running == 1
        assert proc.num_forwards == 1
        # Each answer means the loop went round again: still no forward while paused.
        for call_id in range(3, 6):
            io.input_queue.put(_utility(call_id, UtilityMethod.GET_LOAD))
            io.wait_for_result(call_id)
            assert proc.num_forwards == 1
        io.input_queue.put(_utility(6, UtilityMethod.RESUME))
        _shut_down(io, loop, drain_s=60.0)
    finally:
        proc.shutdown()
    assert _finished(io) == {"paused": FinishReason.LENGTH}
    assert proc.num_forwards == 12  # one token a forward: nothing was skipped or repeated


def _tokens_sent(io: RecordingIO) -> int:
    outputs = [o for o in io.of_type(OutputType.OUTPUTS) if isinstance(o, EngineCoreOutputs)]
    return sum(len(output.new_token_ids) for batch in outputs for output in batch.outputs)


def test_a_bounded_resume_runs_that_many_forwards_and_answers_after_their_tokens(
    config: EngineConfig,
) -> None:
    """RESUME with max_steps: the loop schedules that many batches, pauses itself, and
    answers once their tokens are sent; out of requests, it answers at once, paused."""
    io = RecordingIO()
    proc = HookedEngineCoreProc(config, io, [])
    io.input_queue.put(_utility(1, UtilityMethod.PAUSE))
    io.input_queue.put(_add("stepped", max_tokens=10))
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop", daemon=True)
    loop.start()
    try:
        io.wait_for_result(1)
        expected_forwards = 0
        for call_id, steps in ((2, 1), (3, 3), (4, 1)):
            io.input_queue.put(_resume(call_id, steps))
            assert io.wait_for_result(call_id).value == steps
            expected_forwards += steps
            # The answer comes after the steps' tokens (one a forward), and nothing more.
            assert proc.num_forwards == _tokens_sent(io) == expected_forwards
            assert proc.is_paused
        io.input_queue.put(_utility(5, UtilityMethod.GET_LOAD))
        io.wait_for_result(5)
        assert proc.num_forwards == expected_forwards  # still paused
        # More steps than the request has left: answered when it ends, and paused again.
        io.input_queue.put(_resume(6, 50))
        assert io.wait_for_result(6).value == 10 - expected_forwards
        assert _finished(io) == {"stepped": FinishReason.LENGTH}
        assert proc.num_forwards == _tokens_sent(io) == 10
        assert proc.is_paused and not proc.is_resumed_for_steps
        io.input_queue.put(_add("waits", max_tokens=3))
        io.input_queue.put(_utility(7, UtilityMethod.GET_LOAD))
        load = io.wait_for_result(7).value
        assert isinstance(load, RankLoad) and load.num_waiting == 1
        assert proc.num_forwards == 10
        _shut_down(io, loop, drain_s=60.0)
    finally:
        proc.shutdown()
    assert _finished(io) == {"stepped": FinishReason.LENGTH, "waits": FinishReason.LENGTH}


def test_a_bounded_resume_is_answered_when_another_call_takes_over(config: EngineConfig) -> None:
    """A PAUSE or another RESUME sent while a bounded RESUME runs answers it at once, with
    the steps it ran; a bound below 1 is refused."""
    io = RecordingIO()
    # Sent during the bounded resume's first forward: the second takes over from it.
    proc = HookedEngineCoreProc(config, io, [_resume(3, max_steps=2)])
    io.input_queue.put(_utility(1, UtilityMethod.PAUSE))
    io.input_queue.put(_add("stepped", max_tokens=20))
    io.input_queue.put(_resume(2, max_steps=10))
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop", daemon=True)
    loop.start()
    try:
        assert io.wait_for_result(2).value == 1  # taken over after its first forward
        assert io.wait_for_result(3).value == 2
        assert proc.num_forwards == 3 and proc.is_paused
        io.input_queue.put(_resume(4, max_steps=0))
        assert "max_steps must be at least 1" in (io.wait_for_result(4).error or "")
        _shut_down(io, loop, drain_s=0.0)
    finally:
        proc.shutdown()
    assert _finished(io) == {"stepped": FinishReason.ABORT}


class ClockedEngineCoreProc(EngineCoreProc):
    """Reads the time from a clock the test moves: `advance_at` forward -> `advance_s`."""

    def __init__(self, config: EngineConfig, io: EngineIO, clock: list[float],
                 advance_at: int, advance_s: float) -> None:  # fmt: skip
        self.clock, self.advance_at, self.advance_s = clock, advance_at, advance_s
        self.num_forwards = 0
        super().__init__(config, io)

    def overlap_forward(self, scheduler_output: SchedulerOutput) -> None:
        self.num_forwards += 1
        if self.num_forwards == self.advance_at:
            self.clock[0] += self.advance_s
        super().overlap_forward(scheduler_output)


@pytest.mark.parametrize(("advance_s", "expected"), [(0.0, FinishReason.LENGTH),
                                                      (31.0, FinishReason.ABORT)])  # fmt: skip
def test_a_drain_finishes_in_flight_requests_until_its_deadline_then_aborts_the_rest(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch, advance_s: float, expected: FinishReason
) -> None:
    """SHUTDOWN with a 30 s drain: requests keep running while the engine's clock stays
    within it; once the clock passes it (at the third forward), what is left is aborted
    and the loop ends. The clock is the test's, so no step's speed matters."""
    import engine_svc.proc.engine_core_proc as engine_core_proc

    clock = [1000.0]
    fake_time = type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(engine_core_proc, "time", fake_time)
    io = RecordingIO()
    proc = ClockedEngineCoreProc(config, io, clock, advance_at=3, advance_s=advance_s)
    for request_id in ("a", "b"):
        io.input_queue.put(_add(request_id, max_tokens=40))
    io.input_queue.put((RequestType.SHUTDOWN, ShutdownRequest(30.0)))
    try:
        proc.run_busy_loop()
    finally:
        proc.shutdown()
    assert _finished(io) == {"a": expected, "b": expected}
    outputs = [o for o in io.of_type(OutputType.OUTPUTS) if isinstance(o, EngineCoreOutputs)]
    tokens = sum(len(output.new_token_ids) for batch in outputs for output in batch.outputs)
    if expected == FinishReason.LENGTH:
        assert tokens == 2 * 40
    else:  # the forward during which the deadline passed was the last: its tokens count
        assert (proc.num_forwards, tokens) == (3, 2 * 3)
