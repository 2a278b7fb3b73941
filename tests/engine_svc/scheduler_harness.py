"""Scheduler tests' harness: a real scheduler and KV-cache manager on CPU, driven by a fake
model runner.

The fake runner keeps block tables and a token-level "KV cache" the way a real one does,
checks that every token a request attends to sits in its slot (so a wrong prefix-cache hit
or a block reused too early fails the test), and samples a token that depends only on the
last one. Outputs are therefore known in advance, with or without preemption. The
`make_engine` fixture (conftest.py) checks every engine it made drains completely.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_svc.admission import check_request
from engine_svc.config import SchedulerConfig
from engine_svc.control_messages import EngineInfo
from engine_svc.core.request import Request
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.core.sched.scheduler import Scheduler
from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.outputs import ModelRunnerOutput

VOCAB_SIZE = 64
BLOCK_SIZE = 4


def next_token(token_id: int) -> int:
    """The fake model."""
    return (token_id * 7 + 3) % VOCAB_SIZE


def expected_tokens(prompt_token_ids: list[int], num_tokens: int) -> list[int]:
    tokens = [prompt_token_ids[-1]]
    for _ in range(num_tokens):
        tokens.append(next_token(tokens[-1]))
    return tokens[1:]


def make_config(**overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = {
        "max_model_len": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 32,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "vocab_size": VOCAB_SIZE,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_ids: frozenset[int] = frozenset(),
    **sampling: Any,
) -> Request:
    sampling.setdefault("max_tokens", 8)
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(**sampling),
        arrival_time=arrival_time,
        priority=priority,
        eos_token_ids=eos_token_ids,
    )


class FakeModelRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv_cache: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.block_tables: dict[str, list[int]] = {}
        self.token_ids: dict[str, list[int]] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.freed_request_ids:
            self.block_tables.pop(request_id, None)
            self.token_ids.pop(request_id, None)
        # Like each attention layer: every token of the batch writes its KV, then attends.
        for entry in scheduler_output.scheduled:
            if entry.new_request is not None:
                assert entry.request_id not in self.block_tables, "resent without being freed"
                self.block_tables[entry.request_id] = list(entry.new_block_ids)
                self.token_ids[entry.request_id] = list(entry.new_request.all_token_ids)
            else:
                self.block_tables[entry.request_id].extend(entry.new_block_ids)
            tokens = self.token_ids[entry.request_id]
            start = entry.num_computed_tokens
            assert entry.token_ids == tokens[start : start + entry.num_scheduled_tokens]
            for position in range(start, start + entry.num_scheduled_tokens):
                self.kv_cache[self._slot(entry.request_id, position)] = tokens[position]
        sampled: dict[str, int] = {}
        for entry in scheduler_output.scheduled:
            tokens = self.token_ids[entry.request_id]
            end = entry.num_computed_tokens + entry.num_scheduled_tokens
            attended = [self.kv_cache.get(self._slot(entry.request_id, p)) for p in range(end)]
            assert attended == tokens[:end], f"{entry.request_id} reads a wrong KV cache"
            if end == len(tokens):
                sampled[entry.request_id] = next_token(tokens[-1])
                tokens.append(sampled[entry.request_id])
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs={})

    def _slot(self, request_id: str, position: int) -> tuple[int, int]:
        block_table = self.block_tables[request_id]
        return block_table[position // self.block_size], position % self.block_size


@dataclasses.dataclass
class Result:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0


class FakeEngine:
    """A scheduler stepped with the fake runner; checks the per-step limits, keeps outputs."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.limits = EngineInfo(
            engine_index=0,
            max_model_len=config.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=sorted(config.eos_token_ids),
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
        )
        self.scheduler = Scheduler(config)
        self.runner = FakeModelRunner(config.block_size)
        self.results: dict[str, Result] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        """As a client and the engine core do: checked at admission, then queued."""
        for request in requests:
            check_request(_as_message(request), self.limits)
            self.scheduler.add_request(request)
            self.results.pop(request.request_id, None)  # an id may be reused once finished

    def abort(self, *request_ids: str) -> list[EngineCoreOutput]:
        outputs = self.scheduler.finish_requests(list(request_ids), FinishReason.ABORT)
        self.record(outputs)
        return outputs

    def schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.history.append(scheduler_output)
        assert scheduler_output.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        assert all(entry.num_scheduled_tokens > 0 for entry in scheduler_output.scheduled)
        return scheduler_output

    def step(self) -> list[EngineCoreOutput]:
        return self.execute(self.schedule())

    def execute(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        runner_output = self.runner.execute(scheduler_output)
        self.scheduler.prepare_waiting()  # EngineCore does this while the forward runs
        return self.update(scheduler_output, runner_output)

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.record(outputs)
        return outputs

    def record(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            result = self.results.setdefault(output.request_id, Result())
            assert result.finish_reason is None, "output after the request finished"
            result.token_ids.extend(output.new_token_ids)
            result.finish_reason = output.finish_reason
            result.stop_reason = output.stop_reason
            result.num_cached_tokens = output.num_cached_tokens

    def run(self, max_steps: int = 1000) -> dict[str, Result]:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return self.results
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def scheduled_ids(self, step: int) -> list[str]:
        return [entry.request_id for entry in self.history[step].scheduled]

    def entries_of(self, request_id: str) -> list[tuple[int, int]]:
        """(num_computed_tokens, num_scheduled_tokens) of each step that ran `request_id`."""
        return [
            (entry.num_computed_tokens, entry.num_scheduled_tokens)
            for output in self.history
            for entry in output.scheduled
            if entry.request_id == request_id
        ]


def _as_message(request: Request) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
    )


def assert_drained(scheduler: Scheduler) -> None:
    assert not scheduler.has_requests()
    assert scheduler.running == []
    assert len(scheduler.waiting) == 0
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.kv_cache.req_to_blocks == {}
