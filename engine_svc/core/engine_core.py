"""EngineCore: scheduler + KV-cache manager + executor, stepped by whoever owns it.

`step()` is the whole engine: schedule, launch the forward (a future), do the next step's
CPU work while it runs, apply aborts that arrived meanwhile, then write the sampled tokens
into the requests. `step_with_batch_queue()` keeps several batches in flight for
executors that take more than one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

import torch

from engine_svc.config import EngineConfig, SchedulerConfig
from engine_svc.control_messages import EngineInfo
from engine_svc.core.kv_cache.sizing import KVCachePlan, cpu_budget_bytes, plan_kv_cache
from engine_svc.core.request import Request
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.core.sched.scheduler import Scheduler
from engine_svc.executor.base import Executor, RunnerResult, WorkerMemory
from engine_svc.executor.factory import build_executor
from engine_svc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine_svc.models.model_spec import ModelSpec, load_model_spec
from engine_svc.structured.compiler import GrammarCompiler
from engine_svc.structured.manager import StructuredOutputManager
from engine_svc.worker.model_runner import resolve_device, resolve_dtype
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample
from shared.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class EngineCore:
    """`executor`: what runs the model (default: the one the config asks for, built here);
    tests hand in a fake one whose steps they control."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.spec = load_model_spec(config.model)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.spec, device)
        self.max_model_len = _resolve_max_model_len(config, self.spec)
        enable_chunking, enable_caching = _attention_constraints(config, self.spec)
        max_batched = _resolve_max_batched_tokens(config, self.max_model_len, enable_chunking)

        if executor is None:
            executor = build_executor(config, self.spec, dtype, device)
        self.executor = executor
        self.executor_failed: BaseException | None = None
        self.executor.register_failure_callback(self._on_executor_failure)
        try:
            self.kv_plan = self._initialize_kv_caches(max_batched)
        except BaseException:
            self.executor.shutdown()  # its workers may be processes of their own
            raise

        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                block_size=config.block_size,
                num_kv_blocks=self.kv_plan.num_blocks,
                enable_prefix_caching=enable_caching,
                enable_chunked_prefill=enable_chunking,
                policy=config.scheduling_policy,
                vocab_size=self.spec.vocab_size,
                eos_token_ids=frozenset(self.spec.eos_token_ids),
                attention_span=self.spec.attention_span,
            )
        )
        self.structured_output = StructuredOutputManager(
            GrammarCompiler(
                config.model,
                self.spec.vocab_size,
                list(self.spec.eos_token_ids),
                config.grammar_cache_bytes,
            )
        )
        self.batch_queue: deque[tuple[Future[RunnerResult], SchedulerOutput]] = deque()
        # Pipeline parallelism sets the executor's own limit: one batch per stage.
        self.step_fn = (
            self.step if executor.max_concurrent_batches == 1 else self.step_with_batch_queue
        )
        self.max_batches_in_flight = 0
        self._aborts_in_flight: list[str] = []
        self._pending_outputs: list[EngineCoreOutput] = []
        self._paused = False
        self._steps_left: int | None = None  # a bounded resume: batches before pausing again
        self.num_batches_scheduled = 0

    # ---- start-up --------------------------------------------------------------------

    def _initialize_kv_caches(self, max_batched_tokens: int) -> KVCachePlan:
        """Size the KV cache for the tightest worker, and have every worker allocate it."""
        workers = self.executor.profile_memory(
            max_batched_tokens, self.config.max_num_seqs, measure=self.config.num_kv_blocks is None
        )
        plans = [
            plan_kv_cache(
                budget_bytes=self._memory_budget(worker, len(workers)),
                weight_bytes=worker.weight_bytes,
                activation_bytes=worker.activation_bytes,
                bytes_per_block=worker.kv_bytes_per_block,
                block_size=self.config.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                num_blocks_override=self.config.num_kv_blocks,
                attention_span=self.spec.attention_span,
                max_step_tokens=max_batched_tokens,
            )
            for worker in workers
        ]
        plan = min(plans, key=lambda p: p.num_blocks)
        self.executor.allocate_kv_cache(plan.num_blocks)
        logger.info("%s", plan.describe())
        return plan

    def _memory_budget(self, worker: WorkerMemory, num_workers: int) -> int:
        """A worker's budget: on a GPU, of that GPU's memory; on CPU, an equal part of the
        engine's (the workers share the host's memory)."""
        if worker.device_type == "cuda":
            if self.config.kv_cache_memory_bytes is not None:
                return self.config.kv_cache_memory_bytes
            return int(worker.device_total_bytes * self.config.gpu_memory_utilization)
        return cpu_budget_bytes(self.config.kv_cache_memory_bytes, num_workers)

    # ---- requests --------------------------------------------------------------------

    def info(self, engine_index: int = 0) -> EngineInfo:
        """The limits this engine resolved at start-up, which requests are checked against
        where they enter (engine_svc/admission.py)."""
        config = self.scheduler.config
        return EngineInfo(
            engine_index=engine_index,
            max_model_len=self.max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=list(self.spec.eos_token_ids),
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            architecture=self.spec.architecture,
            attention_span=config.attention_span,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request its client checked (admission.check_request): the core trusts it."""
        params = request.sampling_params
        core_request = Request.from_engine_core_request(request, frozenset(self.spec.eos_token_ids))
        if params.constraint is not None:
            core_request.structured = self.structured_output.start(params)
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests now; their ABORT outputs come with the next step's outputs."""
        self._pending_outputs.extend(
            self.scheduler.finish_requests(request_ids, FinishReason.ABORT)
        )

    def abort_requests_in_flight(self, request_ids: list[str]) -> None:
        """During a forward: remember the aborts and apply them once it returns."""
        self._aborts_in_flight.extend(request_ids)

    def pause(self) -> bool:
        """Stop scheduling after the step in progress; requests stay where they are, and
        new requests and aborts are still taken in (vLLM's pause_generation)."""
        self._paused = True
        self._steps_left = None
        return True

    def resume(self, max_steps: int | None = None) -> bool:
        """Schedule again; with `max_steps`, pause again on its own once that many
        batches are scheduled (a debugger's or a test's single step)."""
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {max_steps}")
        self._paused = False
        self._steps_left = max_steps
        return True

    @property
    def is_resumed_for_steps(self) -> bool:
        return self._steps_left is not None

    @property
    def is_paused(self) -> bool:
        return self._paused

    # ---- stepping --------------------------------------------------------------------

    def _can_schedule(self) -> bool:
        return not self._paused and self.scheduler.has_requests()

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self._pending_outputs)

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """One iteration. Returns the outputs and whether a forward ran."""
        if not self._can_schedule():
            self._flush_freed_requests()
            return self._collect([]), False
        scheduler_output = self._schedule()
        future = self.executor.execute_model(scheduler_output)
        self.max_batches_in_flight = max(self.max_batches_in_flight, 1)
        grammar = self.structured_output.grammar_bitmask(scheduler_output, self.scheduler.requests)
        self.overlap_forward(scheduler_output)
        runner_output = self._sampled(future.result(), grammar)
        return self._finish_step(scheduler_output, runner_output), True

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs, bool]:
        """Fill the queue of in-flight batches first; collect the oldest when it is full or
        nothing more can be scheduled."""
        queue = self.batch_queue
        if len(queue) < self.executor.max_concurrent_batches and self._can_schedule():
            scheduler_output = self._schedule()
            if not scheduler_output.is_empty:
                queue.appendleft((self.executor.execute_model(scheduler_output), scheduler_output))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
                if len(queue) < self.executor.max_concurrent_batches:
                    return self._collect([]), True
            elif scheduler_output.freed_request_ids:
                # Nothing to run, but the runner must still drop freed requests' state.
                self.executor.execute_model(scheduler_output)
        if not queue:
            self._flush_freed_requests()
            if self._can_schedule():
                time.sleep(0.001)  # waiting on something else: release the GIL, do not spin
            return self._collect([]), False
        future, scheduler_output = queue.pop()
        grammar = self.structured_output.grammar_bitmask(scheduler_output, self.scheduler.requests)
        self.overlap_forward(scheduler_output)
        runner_output = self._sampled(future.result(), grammar)
        return self._finish_step(scheduler_output, runner_output), True

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next batch, counted against a bounded resume."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return scheduler_output
        self.num_batches_scheduled += 1
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                self._paused = True
                self._steps_left = None
        return scheduler_output

    def _sampled(self, result: RunnerResult, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        """The forward's tokens; when it held back sampling for a grammar, sample now."""
        if isinstance(result, PendingSample):
            return self.executor.sample_tokens(result, grammar).result()
        return result

    def _flush_freed_requests(self) -> None:
        """Going idle: tell the runner which requests ended, so it holds no stale state.
        Only with no request left: the step runs whatever schedule() gives, and a paused
        engine's requests would be scheduled by it, run, and their tokens dropped (the next
        real step tells the runner of the freed ones anyway)."""
        idle = not self.scheduler.has_requests() and not self.batch_queue
        if idle and self.scheduler.has_freed_requests:
            self.executor.execute_model(self.scheduler.schedule()).result()

    def overlap_forward(self, scheduler_output: SchedulerOutput) -> None:
        """CPU work for the next step, done while the forward runs (torch releases the GIL).
        Here: hash the waiting prompts' blocks for the prefix-cache lookup. Subclasses add
        theirs (taking in new requests in the engine process; grammar bitmasks)."""
        self.scheduler.prepare_waiting()

    def _finish_step(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        if self._aborts_in_flight:
            aborts, self._aborts_in_flight = self._aborts_in_flight, []
            self.abort_requests(aborts)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not self.scheduler.has_requests():
            self._flush_freed_requests()
        return self._collect(outputs)

    def _collect(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        self._pending_outputs.extend(self.scheduler.take_failed_outputs())
        if self._pending_outputs:
            outputs = self._pending_outputs + outputs
            self._pending_outputs = []
        stats = self.scheduler.make_stats(
            num_generation_tokens=sum(len(o.new_token_ids) for o in outputs)
        )
        stats.num_batches_in_flight = len(self.batch_queue)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _on_executor_failure(self, error: BaseException) -> None:
        self.executor_failed = error

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()


def _resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise InvalidRequestError(
            "max_model_len", f"{config.max_model_len} exceeds the model's {limit} positions"
        )
    return config.max_model_len


def _attention_constraints(config: EngineConfig, spec: ModelSpec) -> tuple[bool, bool]:
    """Chunked prefill and prefix caching both assume causal attention over the prompt."""
    if spec.is_causal:
        return config.enable_chunked_prefill, config.enable_prefix_caching
    logger.warning(
        "%s attends both ways over the prompt: chunked prefill and prefix caching are off, "
        "or the KV cache would be corrupted",
        spec.architecture,
    )
    return False, False


def _resolve_max_batched_tokens(config: EngineConfig, max_model_len: int, chunking: bool) -> int:
    requested = config.max_num_batched_tokens
    if chunking:
        return requested or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if requested is not None and requested < max_model_len:
        raise InvalidRequestError(
            "max_num_batched_tokens",
            f"{requested} < max_model_len={max_model_len}: without chunked prefill a whole "
            "prompt must fit in one step",
        )
    return requested or max_model_len
