"""The interface between the engine core and whatever runs the model.

The core builds no workers and reaches into no model runner: it asks its executor for the
workers' memory (to size the KV cache: the smallest worker decides), has the cache
allocated, and launches forwards that come back as futures. An executor may accept several
batches at once (`max_concurrent_batches`, pipeline parallelism); the core's batch queue
keeps that many in flight. A worker that fails reports through the failure callback.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample

RunnerResult = ModelRunnerOutput | PendingSample
FailureCallback = Callable[[BaseException], None]


@dataclasses.dataclass(frozen=True)
class WorkerMemory:
    """What one worker's memory holds besides the KV cache, and what a KV block costs it."""

    device_type: str  # "cpu" or "cuda"
    device_total_bytes: int  # the accelerator's memory; 0 on CPU (the host's budget applies)
    weight_bytes: int
    activation_bytes: int  # peak of a forward of the largest step (0: not measured)
    kv_bytes_per_block: int


class Executor(abc.ABC):
    """Started (its workers loaded) by its constructor."""

    max_concurrent_batches: int = 1

    @abc.abstractmethod
    def profile_memory(
        self, max_batched_tokens: int, max_num_seqs: int, measure: bool
    ) -> list[WorkerMemory]:
        """Each worker's memory, its activations for a step of this size measured (or, with
        `measure` false, left at 0: the KV cache size was given)."""

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every worker allocates `num_blocks` blocks (its share of each)."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[RunnerResult]:
        """Launch one step's forward; the future holds the sampled tokens, or the logits
        when sampling waits for a grammar bitmask (then call sample_tokens)."""

    @abc.abstractmethod
    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> Future[ModelRunnerOutput]: ...

    @abc.abstractmethod
    def register_failure_callback(self, callback: FailureCallback) -> None:
        """`callback(error)` once a worker fails: the engine cannot go on."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...
