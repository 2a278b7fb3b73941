"""EngineCore stepped with a fake executor (tests/engine_svc/fake_executor.py): no model, and
every event at a point the test chooses. An abort that arrives during a forward, the batch
queue's fill-then-collect order, the KV cache sized for the tightest worker, a failing worker,
the pause before retrying when nothing could be launched, and an abort while paused."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import engine_core as engine_core_module
from engine_svc.core.engine_core import EngineCore
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.executor.base import WorkerMemory
from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine_svc.sampling_params import SamplingParams
from tests.engine_svc.fake_executor import FakeExecutor
from tests.engine_svc.scheduler_harness import expected_tokens

BLOCK_SIZE = 16


def _core(model_dir: Path, executor: FakeExecutor, **config: object) -> EngineCore:
    values: dict[str, object] = {"num_kv_blocks": 64, "max_model_len": 512, **config}
    return EngineCore(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, **values), executor)  # type: ignore[arg-type]


def _add(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(
        EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
    )


def _run(core: EngineCore, max_steps: int = 200) -> dict[str, EngineCoreOutput]:
    """Step until idle; each request's tokens and its final output."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return finished
        outputs, _ = core.step_fn()
        for output in outputs.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                output.new_token_ids = tokens[output.request_id]
                finished[output.request_id] = output
    raise AssertionError(f"still busy after {max_steps} steps")


def _all_blocks_free(core: EngineCore) -> bool:
    pool = core.scheduler.kv_cache.pool
    return pool.num_free_blocks == pool.num_blocks


def test_an_abort_during_a_forward_ends_the_request_after_it(tiny_model_dir: Path) -> None:
    executor = FakeExecutor(BLOCK_SIZE)
    core = _core(tiny_model_dir, executor)
    _add(core, "kept", [1, 2, 3], 6)
    _add(core, "aborted", [4, 5, 6], 6)

    def abort_in_third_forward(scheduler_output: SchedulerOutput) -> None:
        if executor.events.count("launch 2") == 1 and not core._aborts_in_flight:
            core.abort_requests_in_flight(["aborted"])

    executor.on_launch = abort_in_third_forward
    finished = _run(core)
    assert finished["aborted"].finish_reason == FinishReason.ABORT
    # Two steps gave two tokens; the third forward's token for it is dropped with it.
    assert finished["aborted"].new_token_ids == expected_tokens([4, 5, 6], 2)
    assert finished["kept"].finish_reason == FinishReason.LENGTH
    assert finished["kept"].new_token_ids == expected_tokens([1, 2, 3], 6)
    assert _all_blocks_free(core)


def test_the_batch_queue_fills_before_it_collects(tiny_model_dir: Path) -> None:
    """Two batches in flight: each step launches the next batch before it collects the
    oldest, so a pipeline's stages would work on both at once."""
    executor = FakeExecutor(BLOCK_SIZE, max_concurrent_batches=2)
    core = _core(tiny_model_dir, executor, max_concurrent_batches=2, max_num_batched_tokens=32)
    assert core.step_fn == core.step_with_batch_queue
    prompt = list(range(1, 101))  # 100 tokens: chunks of 32, each a batch of its own
    _add(core, "long", prompt, 4)
    outputs, ran = core.step_fn()
    assert ran and outputs.outputs == [] and executor.events == ["launch 0"]
    core.step_fn()
    assert executor.events == ["launch 0", "launch 1", "collect 0"]
    finished = _run(core)
    assert finished["long"].new_token_ids == expected_tokens(prompt, 4)
    assert executor.max_in_flight == 2
    launches = [i for i, e in enumerate(executor.events) if e.startswith("launch")]
    collects = [i for i, e in enumerate(executor.events) if e.startswith("collect")]
    assert len(launches) == len(collects)
    # Every batch was collected in launch order, after the next one was launched (when
    # there was a next one to launch).
    assert [executor.events[i].split()[1] for i in collects] == [
        str(n) for n in range(len(collects))
    ]
    assert _all_blocks_free(core)


def test_the_kv_cache_is_sized_for_the_tightest_worker(tiny_model_dir: Path) -> None:
    roomy = WorkerMemory("cpu", 0, weight_bytes=1 << 20, activation_bytes=0,
                         kv_bytes_per_block=1 << 10)  # fmt: skip
    tight = WorkerMemory("cpu", 0, weight_bytes=1 << 20, activation_bytes=0,
                         kv_bytes_per_block=4 << 10)  # fmt: skip
    executor = FakeExecutor(BLOCK_SIZE, workers=[roomy, tight])
    # On CPU the workers split the engine's budget: each gets the weights and 100 of the
    # tight worker's blocks.
    budget = 2 * ((1 << 20) + 100 * (4 << 10))
    core = _core(tiny_model_dir, executor, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    assert core.kv_plan.num_blocks == executor.allocated_blocks
    assert core.kv_plan.num_blocks <= 100 < 400  # the roomy worker alone would take 400
    assert core.scheduler.config.num_kv_blocks == core.kv_plan.num_blocks


def test_a_failing_worker_reaches_the_core_through_the_callback(tiny_model_dir: Path) -> None:
    executor = FakeExecutor(BLOCK_SIZE)
    executor.fail_at_batch = 1
    core = _core(tiny_model_dir, executor)
    _add(core, "r", [1, 2, 3], 4)
    core.step_fn()
    with pytest.raises(RuntimeError, match="injected failure in batch 1"):
        core.step_fn()
    assert isinstance(core.executor_failed, RuntimeError)


def test_nothing_to_launch_with_requests_pending_sleeps_a_millisecond(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests wait on something else (say a grammar still compiling): the batch-queue
    step releases the GIL for 1 ms instead of spinning."""
    executor = FakeExecutor(BLOCK_SIZE, max_concurrent_batches=2)
    core = _core(tiny_model_dir, executor, max_concurrent_batches=2)
    _add(core, "r", [1, 2, 3], 4)
    sleeps: list[float] = []
    monkeypatch.setattr(engine_core_module.time, "sleep", sleeps.append)
    monkeypatch.setattr(core.scheduler, "schedule", lambda: SchedulerOutput([], []))
    outputs, ran = core.step_fn()
    assert (outputs.outputs, ran, sleeps, executor.events) == ([], False, [0.001], [])


def test_shutdown_reaches_the_executor(tiny_model_dir: Path) -> None:
    executor = FakeExecutor(BLOCK_SIZE)
    core = _core(tiny_model_dir, executor)
    core.shutdown()
    assert executor.shut_down


@pytest.mark.parametrize("max_concurrent_batches", [1, 2])
def test_an_abort_while_paused_leaves_the_other_requests_to_go_on(
    tiny_model_dir: Path, max_concurrent_batches: int
) -> None:
    """Paused, the engine takes an abort in and runs no forward; resumed, the request left
    gets every token it asked for (a paused step once ran the others and dropped their
    tokens, and they never got another)."""
    executor = FakeExecutor(BLOCK_SIZE, max_concurrent_batches=max_concurrent_batches)
    core = _core(tiny_model_dir, executor)
    _add(core, "kept", [1, 2, 3], 6)
    _add(core, "aborted", [4, 5, 6], 6)
    tokens: dict[str, list[int]] = {}

    def step() -> bool:
        outputs, ran = core.step_fn()
        for output in outputs.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        return ran

    while len(tokens.get("kept", [])) < 2:
        step()
    core.pause()
    while core.batch_queue:  # batches launched before the pause still come back
        step()
    core.abort_requests(["aborted"])
    launched = len(executor.events)
    outputs, ran = core.step_fn()
    assert not ran and len(executor.events) == launched  # paused: no forward at all
    assert [(o.request_id, o.finish_reason) for o in outputs.outputs] == [
        ("aborted", FinishReason.ABORT)
    ]
    core.resume()
    finished = _run(core)
    kept = tokens["kept"] + finished["kept"].new_token_ids
    assert kept == expected_tokens([1, 2, 3], 6)
    assert finished["kept"].finish_reason == FinishReason.LENGTH
    assert _all_blocks_free(core)


@pytest.mark.parametrize("max_concurrent_batches", [1, 2])
def test_a_bounded_resume_schedules_that_many_batches_then_pauses(
    tiny_model_dir: Path, max_concurrent_batches: int
) -> None:
    """resume(max_steps=3) launches three batches, whatever the batch queue's depth, and
    pauses the core; the batches in flight still come back, and nothing more launches."""
    executor = FakeExecutor(BLOCK_SIZE, max_concurrent_batches=max_concurrent_batches)
    core = _core(tiny_model_dir, executor)
    _add(core, "stepped", [1, 2, 3], 10)
    core.pause()
    core.resume(max_steps=3)
    tokens: list[int] = []
    for _ in range(20):
        outputs, _ = core.step_fn()
        tokens += [t for output in outputs.outputs for t in output.new_token_ids]
    launches = [event for event in executor.events if event.startswith("launch")]
    assert len(launches) == 3 and len(tokens) == 3
    assert core.is_paused and not core.is_resumed_for_steps and not core.batch_queue
    core.resume()
    finished = _run(core)
    assert tokens + finished["stepped"].new_token_ids == expected_tokens([1, 2, 3], 10)
