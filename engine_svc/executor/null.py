"""An executor that runs no model: each request that reaches the end of its input gets the
next token of a fixed cycle of ordinary tokens, at no cost. What is left to measure is the
engine's own cost (scheduling, the busy loop's IPC, gRPC) and the frontend's (detokenization,
output assembly): `--null-executor`, which `python -m engine_svc.bench overhead` runs.

It keeps no KV cache and samples nothing: logprobs come back empty and grammars are not
followed. Its memory report is the real model's (the checkpoint's bytes, its K/V bytes per
block), so the engine sizes its block pool as it would for the model.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.executor.base import Executor, FailureCallback, RunnerResult, WorkerMemory
from engine_svc.models.model_spec import ModelSpec
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample

CYCLE_LENGTH = 64


class NullExecutor(Executor):
    def __init__(self, model_dir: str, spec: ModelSpec, block_size: int, dtype_bytes: int) -> None:
        self._memory = WorkerMemory(
            device_type="cpu",
            device_total_bytes=0,
            weight_bytes=sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")),
            activation_bytes=0,
            kv_bytes_per_block=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
            * block_size * dtype_bytes,
        )  # fmt: skip
        # Ordinary tokens from the middle of the vocabulary: no EOS, few special tokens.
        first = spec.vocab_size // 4
        self._cycle = [t for t in range(first, first + 2 * CYCLE_LENGTH)
                       if t not in spec.eos_token_ids][:CYCLE_LENGTH]  # fmt: skip
        self._lengths: dict[str, int] = {}  # request -> its tokens so far (prompt + outputs)

    def profile_memory(
        self, max_batched_tokens: int, max_num_seqs: int, measure: bool
    ) -> list[WorkerMemory]:
        return [self._memory]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[RunnerResult]:
        for request_id in scheduler_output.freed_request_ids:
            self._lengths.pop(request_id, None)
        sampled: dict[str, int] = {}
        for entry in scheduler_output.scheduled:
            if entry.new_request is not None:
                self._lengths[entry.request_id] = len(entry.new_request.all_token_ids)
            length = self._lengths[entry.request_id]
            if entry.num_computed_tokens + entry.num_scheduled_tokens >= length:
                sampled[entry.request_id] = self._cycle[length % len(self._cycle)]
                self._lengths[entry.request_id] = length + 1
        done: Future[RunnerResult] = Future()
        done.set_result(ModelRunnerOutput(sampled_token_ids=sampled, logprobs={}))
        return done

    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> Future[ModelRunnerOutput]:
        raise AssertionError("the null executor never defers sampling")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        pass

    def shutdown(self) -> None:
        pass
