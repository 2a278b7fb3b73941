"""An Executor for engine-core tests: no model, steps the test controls.

Its forward is the scheduler harness's fake model runner (token t+1 follows t, the KV cache
checked slot by slot). `on_launch` runs while a batch is "in the forward", so a test can act
at that point (an abort arriving mid-step); `events` records launches and collections in
order, and `max_in_flight` how many batches were launched and not yet collected at once.
`fail_at_batch` makes one batch raise, as a worker that fails would."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.executor.base import Executor, FailureCallback, RunnerResult, WorkerMemory
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample
from tests.engine_svc.scheduler_harness import FakeModelRunner

ONE_WORKER = [WorkerMemory("cpu", 0, weight_bytes=1 << 20, activation_bytes=0,
                           kv_bytes_per_block=1 << 10)]  # fmt: skip


class FakeExecutor(Executor):
    def __init__(
        self,
        block_size: int,
        max_concurrent_batches: int = 1,
        workers: list[WorkerMemory] = ONE_WORKER,
    ) -> None:
        self.max_concurrent_batches = max_concurrent_batches
        self.runner = FakeModelRunner(block_size)
        self.workers = workers
        self.allocated_blocks: int | None = None
        self.events: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.on_launch: Callable[[SchedulerOutput], None] = lambda _: None
        self.fail_at_batch: int | None = None
        self._num_batches = 0
        self._failure_callback: FailureCallback | None = None
        self.shut_down = False

    def profile_memory(
        self, max_batched_tokens: int, max_num_seqs: int, measure: bool
    ) -> list[WorkerMemory]:
        return list(self.workers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.allocated_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[RunnerResult]:
        if scheduler_output.is_empty:  # only freed requests to drop: no forward
            self.runner.execute(scheduler_output)
            done: Future[RunnerResult] = Future()
            done.set_result(ModelRunnerOutput(sampled_token_ids={}, logprobs={}))
            return done
        batch = self._num_batches
        self._num_batches += 1
        self.events.append(f"launch {batch}")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        future = _Collected(self, batch)
        if batch == self.fail_at_batch:
            error = RuntimeError(f"injected failure in batch {batch}")
            future.set_exception(error)
            if self._failure_callback is not None:
                self._failure_callback(error)
        else:
            future.set_result(self.runner.execute(scheduler_output))
        self.on_launch(scheduler_output)
        return future

    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> Future[ModelRunnerOutput]:
        raise AssertionError("the fake model never defers sampling")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        self._failure_callback = callback

    def shutdown(self) -> None:
        self.shut_down = True


class _Collected(Future[RunnerResult]):
    """A batch's future that records when the core collects it."""

    def __init__(self, executor: FakeExecutor, batch: int) -> None:
        super().__init__()
        self.executor = executor
        self.batch = batch
        self.collected = False

    def result(self, timeout: float | None = None) -> RunnerResult:
        if not self.collected:
            self.collected = True
            self.executor.in_flight -= 1
            self.executor.events.append(f"collect {self.batch}")
        return super().result(timeout)
