"""One worker, on a thread of the engine-core process.

`execute_model` returns a future at once, so the core can do the next step's CPU work
(grammar bitmasks, taking in new requests) while the forward runs; torch releases the GIL
inside its kernels. Batches run in submission order. A forward that raises calls the failure
callback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.executor.base import Executor, FailureCallback, RunnerResult, WorkerMemory
from engine_svc.executor.memory import profile_worker_memory
from engine_svc.models.model_spec import ModelSpec
from engine_svc.worker.host_memory import keep_freed_activations
from engine_svc.worker.model_runner import ModelRunner
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class UniProcExecutor(Executor):
    def __init__(
        self,
        model_dir: str,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_concurrent_batches: int = 1,
        fail_after_steps: int | None = None,
        cpu_kernels: bool = True,
        memory_budget_bytes: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.max_concurrent_batches = max_concurrent_batches
        if device.type == "cpu":
            keep_freed_activations()  # before the worker thread exists: it joins the main arena
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        self._failure_callback: FailureCallback | None = None
        # Every torch call runs on the worker thread, loading included: each thread that
        # runs a parallel op gets its own OpenMP team, and two spinning teams on a small
        # CPU slowed each decode step by half (84 vs 47 ms per token for one request).
        self.runner: ModelRunner = self._run_on_worker(
            functools.partial(
                ModelRunner,
                memory_budget_bytes=memory_budget_bytes,
                enforce_eager=enforce_eager,
            ),
            model_dir, spec, dtype, device, block_size, fail_after_steps, cpu_kernels,
        )  # fmt: skip

    def _run_on_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run `fn` on the worker thread and wait for it (start-up work)."""
        return self._pool.submit(fn, *args).result()

    def profile_memory(
        self, max_batched_tokens: int, max_num_seqs: int, measure: bool
    ) -> list[WorkerMemory]:
        return [
            self._run_on_worker(
                profile_worker_memory, self.runner, max_batched_tokens, max_num_seqs, measure
            )
        ]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._run_on_worker(self.runner.allocate_kv_cache, num_blocks)

    def register_failure_callback(self, callback: FailureCallback) -> None:
        self._failure_callback = callback

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[RunnerResult]:
        future = self._pool.submit(self._execute_model, scheduler_output)
        future.add_done_callback(self._check_failure)
        return future

    def _execute_model(self, scheduler_output: SchedulerOutput) -> RunnerResult:
        result = self.runner.execute_model(scheduler_output)
        assert result is not None, "a single worker samples"
        return result

    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> Future[ModelRunnerOutput]:
        future = self._pool.submit(self.runner.sample_tokens, pending, grammar)
        future.add_done_callback(self._check_failure)
        return future

    def _check_failure(self, future: Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            logger.error("model runner failed: %s", error)
            if self._failure_callback is not None:
                self._failure_callback(error)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
