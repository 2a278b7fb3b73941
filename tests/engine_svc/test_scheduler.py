"""Scheduler: a real scheduler and KV-cache manager on CPU, driven by a fake model runner.

The fake runner keeps block tables and a token-level "KV cache" the way a real one does,
checks that every token a request attends to sits in its slot (so a wrong prefix-cache hit
or a block reused too early fails the test), and samples a token that depends only on the
last one. Outputs are therefore known in advance, with or without preemption.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine_svc.config import SchedulerConfig
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.core.sched.scheduler import Scheduler
from engine_svc.messages import EngineCoreOutput, FinishReason
from engine_svc.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

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
        self.scheduler = Scheduler(config)
        self.runner = FakeModelRunner(config.block_size)
        self.results: dict[str, Result] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for request in requests:
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


def assert_drained(scheduler: Scheduler) -> None:
    assert not scheduler.has_requests()
    assert scheduler.running == []
    assert len(scheduler.waiting) == 0
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.kv_cache.req_to_blocks == {}


@pytest.fixture
def make_engine() -> Iterator[Callable[..., FakeEngine]]:
    """Engines made here must end with every request finished and every block free."""
    engines: list[FakeEngine] = []

    def make(**overrides: Any) -> FakeEngine:
        engines.append(FakeEngine(make_config(**overrides)))
        return engines[-1]

    yield make
    for engine in engines:
        assert_drained(engine.scheduler)


# ---- batching and budgets ---------------------------------------------------------------


def test_a_request_generates_max_tokens_one_per_step(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", [1, 2, 3, 4, 5], max_tokens=4))

    per_step = [engine.step() for _ in range(4)]

    assert [[o.new_token_ids for o in outputs] for outputs in per_step] == [
        [[t]] for t in expected_tokens([5], 4)
    ]
    assert [outputs[0].finish_reason for outputs in per_step] == [
        None,
        None,
        None,
        FinishReason.LENGTH,
    ]
    assert engine.results["a"].finish_reason == FinishReason.LENGTH
    assert not engine.scheduler.has_requests()


def test_a_request_added_later_joins_the_running_batch(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", list(range(8)), max_tokens=10))
    engine.step()
    engine.step()

    engine.add(make_request("b", [20, 21, 22, 23, 24, 25], max_tokens=3))
    outputs = engine.step()

    assert engine.scheduled_ids(2) == ["a", "b"]
    assert engine.entries_of("a")[-1] == (9, 1)
    assert engine.entries_of("b") == [(0, 6)]
    assert {o.request_id for o in outputs} == {"a", "b"}
    results = engine.run()
    assert results["a"].token_ids == expected_tokens(list(range(8)), 10)
    assert results["b"].token_ids == expected_tokens([25], 3)


def test_the_token_budget_holds_every_step(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(max_num_batched_tokens=10)
    prompts = {f"r{n}": [(n * 5 + i) % VOCAB_SIZE for i in range(3 + 4 * n)] for n in range(6)}
    engine.add(*(make_request(rid, prompt, max_tokens=5) for rid, prompt in prompts.items()))

    results = engine.run()  # FakeEngine.schedule checks the budget

    assert max(o.total_num_scheduled_tokens for o in engine.history) == 10
    assert {rid: r.token_ids for rid, r in results.items()} == {
        rid: expected_tokens(prompt, 5) for rid, prompt in prompts.items()
    }


def test_no_more_than_max_num_seqs_requests_run_at_once(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_num_seqs=2)
    engine.add(*(make_request(f"r{n}", [n + 1] * 4, max_tokens=3) for n in range(4)))

    results = engine.run()

    assert engine.scheduled_ids(0) == ["r0", "r1"]
    assert engine.scheduled_ids(3) == ["r2", "r3"]  # once r0 and r1 have finished
    assert max(len(o.scheduled) for o in engine.history) == 2
    assert all(r.finish_reason == FinishReason.LENGTH for r in results.values())


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    prompt = list(range(20))
    engine.add(make_request("a", prompt, max_tokens=2))

    per_step = [engine.step() for _ in range(4)]

    assert engine.entries_of("a") == [(0, 8), (8, 8), (16, 4), (20, 1)]
    assert [len(o.scheduled[0].new_block_ids) for o in engine.history] == [2, 2, 1, 1]
    assert [[o.new_token_ids for o in outputs] for outputs in per_step] == [
        [],
        [],
        [[expected_tokens(prompt, 1)[0]]],
        [[expected_tokens(prompt, 2)[1]]],
    ]


def test_with_chunked_prefill_a_waiting_prompt_takes_the_budget_left(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    engine.add(make_request("a", [1] * 6, max_tokens=2), make_request("b", [2] * 6, max_tokens=2))

    engine.run()

    assert engine.entries_of("b")[:2] == [(0, 2), (2, 4)]


def test_without_chunked_prefill_a_prompt_waits_for_room_rather_than_being_split(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    engine.add(make_request("a", [1] * 4, max_tokens=8))
    engine.add(make_request("b", [2] * 13, max_tokens=2))

    results = engine.run()

    assert engine.scheduled_ids(0) == ["a"]  # 13 tokens do not fit in the 12 left
    assert engine.entries_of("b")[0] == (0, 13)
    assert results["b"].token_ids == expected_tokens([2], 2)


# ---- preemption -------------------------------------------------------------------------


def preemption_requests() -> list[Request]:
    return [
        make_request("a", list(range(8)), arrival_time=0.0, max_tokens=12),
        make_request("b", [20, 21, 22, 23, 24], arrival_time=1.0, max_tokens=12),
        make_request("c", [30, 31, 32, 33, 34], arrival_time=2.0, max_tokens=12),
    ]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_fcfs_preempts_the_latest_arrival_and_outputs_do_not_change(
    make_engine: Callable[..., FakeEngine], enable_prefix_caching: bool
) -> None:
    # Six blocks: the three prompts fill them, then "a" needs a seventh.
    engine = make_engine(
        num_kv_blocks=6, max_model_len=24, enable_prefix_caching=enable_prefix_caching
    )
    engine.add(*preemption_requests())
    engine.step()

    second = engine.schedule()

    assert second.freed_request_ids == ["c"]
    assert [entry.request_id for entry in second.scheduled] == ["a", "b"]
    assert engine.scheduler.num_preemptions == 1
    engine.execute(second)
    results = engine.run()
    unconstrained = make_engine()
    unconstrained.add(*preemption_requests())
    assert results == unconstrained.run()
    for request in preemption_requests():
        assert results[request.request_id].token_ids == expected_tokens(
            request.prompt_token_ids, 12
        )
    assert engine.scheduler.make_stats().num_preemptions == engine.scheduler.num_preemptions
    assert unconstrained.scheduler.num_preemptions == 0


@pytest.mark.parametrize(
    ("mid_priority", "victim"),
    [(1, "low"), (5, "mid")],  # same priority value as "low": the later arrival goes
)
def test_priority_preempts_the_largest_priority_value(
    make_engine: Callable[..., FakeEngine], mid_priority: int, victim: str
) -> None:
    engine = make_engine(num_kv_blocks=6, max_model_len=24, policy="priority")
    engine.add(make_request("low", [1, 2, 3, 4, 5], priority=5, arrival_time=0.0))
    engine.step()
    engine.add(
        make_request("high", list(range(10, 18)), priority=0, arrival_time=1.0),
        make_request("mid", [20, 21, 22, 23, 24], priority=mid_priority, arrival_time=2.0),
    )
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["low", "high", "mid"]

    third = engine.schedule()  # "high" needs a block and none is free

    assert third.freed_request_ids == [victim]
    assert victim not in [entry.request_id for entry in third.scheduled]
    assert engine.scheduler.requests[victim].status == RequestStatus.PREEMPTED
    engine.execute(third)
    results = engine.run()
    assert results["low"].token_ids == expected_tokens([5], 8)
    assert results["high"].token_ids == expected_tokens([17], 8)
    assert results["mid"].token_ids == expected_tokens([24], 8)


def test_fcfs_resumes_a_preempted_request_before_later_arrivals(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(num_kv_blocks=6, max_model_len=24, max_num_seqs=3)
    engine.add(*preemption_requests(), make_request("d", [40], arrival_time=3.0, max_tokens=2))
    engine.step()
    engine.step()
    assert engine.scheduler.requests["c"].status == RequestStatus.PREEMPTED

    engine.run()

    def first_run(request_id: str, after: int) -> tuple[int, int]:
        """(step, place in that step's batch) where `request_id` was first scheduled."""
        return next(
            (step, engine.scheduled_ids(step).index(request_id))
            for step in range(after, len(engine.history))
            if request_id in engine.scheduled_ids(step)
        )

    assert first_run("c", after=2) < first_run("d", after=0)


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(
        max_model_len=16, num_kv_blocks=4, max_num_batched_tokens=4, policy="priority"
    )
    engine.add(make_request("low", [1, 2, 3], priority=5, max_tokens=4))
    engine.step()
    engine.add(
        make_request("high", [10, 11, 12], priority=0, arrival_time=1.0, max_tokens=4),
        make_request("mid", list(range(30, 38)), priority=1, arrival_time=2.0, max_tokens=4),
    )
    engine.step()
    engine.step()  # all four blocks now in use; "mid" is half-way through its prompt

    # "low" is scheduled first, then preempted when "high" needs a block: its token goes
    # to "mid".
    fourth = engine.schedule()

    assert fourth.freed_request_ids == ["low"]
    assert [(e.request_id, e.num_scheduled_tokens) for e in fourth.scheduled] == [
        ("high", 1),
        ("mid", 3),
    ]
    engine.execute(fourth)
    results = engine.run()
    assert results["low"].token_ids == expected_tokens([3], 4)
    assert results["high"].token_ids == expected_tokens([12], 4)
    assert results["mid"].token_ids == expected_tokens([37], 4)


def test_a_step_that_preempts_admits_no_new_request(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(num_kv_blocks=6, max_model_len=24, max_num_seqs=3, policy="priority")
    engine.add(*preemption_requests())
    engine.step()
    engine.add(make_request("d", [40], priority=-1, arrival_time=3.0, max_tokens=2))

    second = engine.schedule()  # "c" is preempted; "d" would fit in the block left over

    assert second.freed_request_ids == ["c"]
    assert [entry.request_id for entry in second.scheduled] == ["a", "b"]
    engine.execute(second)
    engine.step()
    assert engine.scheduled_ids(2) == ["a", "b", "d"]
    engine.run()


def test_a_preempted_request_can_be_aborted(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(num_kv_blocks=6, max_model_len=24)
    engine.add(*preemption_requests())
    engine.step()
    engine.step()
    assert engine.scheduler.requests["c"].status == RequestStatus.PREEMPTED

    outputs = engine.abort("c")

    assert [(o.request_id, o.finish_reason) for o in outputs] == [("c", FinishReason.ABORT)]
    results = engine.run()
    assert set(results) == {"a", "b", "c"}
    assert results["c"].finish_reason == FinishReason.ABORT


# ---- prefix caching ---------------------------------------------------------------------


def test_a_repeated_prompt_hits_the_prefix_cache(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine()
    prompt = list(range(12))
    engine.add(make_request("first", prompt, max_tokens=2))
    engine.run()

    engine.add(make_request("again", prompt, max_tokens=2))
    results = engine.run()

    assert engine.entries_of("again")[0] == (8, 4)  # the last block is recomputed
    assert results["again"].num_cached_tokens == 8
    assert results["first"].num_cached_tokens == 0
    assert results["again"].token_ids == results["first"].token_ids
    stats = engine.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24, 8)


def test_no_prefix_hits_when_prefix_caching_is_off(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(enable_prefix_caching=False)
    prompt = list(range(12))
    engine.add(make_request("first", prompt, max_tokens=2))
    engine.run()

    engine.add(make_request("again", prompt, max_tokens=2))
    results = engine.run()

    assert engine.entries_of("again")[0] == (0, 12)
    assert results["again"].num_cached_tokens == 0
    stats = engine.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache_is_refused_while_requests_hold_blocks(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", list(range(12)), max_tokens=2))
    engine.step()

    assert engine.scheduler.reset_prefix_cache() is False
    engine.run()
    assert engine.scheduler.reset_prefix_cache() is True

    engine.add(make_request("b", list(range(12)), max_tokens=2))
    assert engine.run()["b"].num_cached_tokens == 0


# ---- admission --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_token_ids", "max_tokens", "field"),
    [
        ([], 4, "prompt_token_ids"),
        ([1, VOCAB_SIZE], 4, "prompt_token_ids"),
        ([1, -1], 4, "prompt_token_ids"),
        ([1] * 32, None, "prompt_token_ids"),  # leaves no room to generate
        ([1] * 30, 3, "max_tokens"),  # 33 > max_model_len
        ([1] * 10, 10, "max_tokens"),  # 20 tokens need 5 blocks, 4 exist
    ],
)
def test_admission_rejects_a_request_that_could_never_finish(
    make_engine: Callable[..., FakeEngine],
    prompt_token_ids: list[int],
    max_tokens: int | None,
    field: str,
) -> None:
    engine = make_engine(max_model_len=32, num_kv_blocks=4)

    with pytest.raises(InvalidRequestError) as error:
        engine.add(make_request("a", prompt_token_ids, max_tokens=max_tokens))

    assert error.value.field == field
    assert not engine.scheduler.has_requests()


def test_admission_accepts_a_request_that_fits_exactly(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_model_len=16, num_kv_blocks=4)
    engine.add(make_request("a", [VOCAB_SIZE - 1] * 12, max_tokens=4))

    assert engine.run()["a"].finish_reason == FinishReason.LENGTH


def test_a_duplicate_request_id_is_rejected_until_the_first_finishes(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", [1, 2], max_tokens=2))

    with pytest.raises(InvalidRequestError) as error:
        engine.add(make_request("a", [3, 4], max_tokens=2))

    assert error.value.field == "request_id"
    assert engine.run()["a"].token_ids == expected_tokens([2], 2)
    engine.add(make_request("a", [3, 4], max_tokens=2))
    engine.run()


# ---- finishing --------------------------------------------------------------------------

PROMPT = [1]
OUTPUT = expected_tokens(PROMPT, 8)  # 10, 9, 2, 17, 58, ...: no repeats


def run_one(make_engine: Callable[..., FakeEngine], request: Request, **config: Any) -> Result:
    engine = make_engine(**config)
    engine.add(request)
    return engine.run()[request.request_id]


def test_eos_stops_a_request(make_engine: Callable[..., FakeEngine]) -> None:
    request = make_request("a", PROMPT, eos_token_ids=frozenset({OUTPUT[2]}), max_tokens=8)

    result = run_one(make_engine, request)

    assert result.token_ids == OUTPUT[:3]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, None)


def test_eos_is_ignored_with_ignore_eos(make_engine: Callable[..., FakeEngine]) -> None:
    request = make_request(
        "a", PROMPT, eos_token_ids=frozenset({OUTPUT[2]}), ignore_eos=True, max_tokens=5
    )

    result = run_one(make_engine, request)

    assert result.token_ids == OUTPUT[:5]
    assert result.finish_reason == FinishReason.LENGTH


def test_eos_does_not_stop_a_request_before_min_tokens(
    make_engine: Callable[..., FakeEngine],
) -> None:
    eos = frozenset({OUTPUT[0], OUTPUT[3]})
    request = make_request("a", PROMPT, eos_token_ids=eos, min_tokens=3, max_tokens=8)

    result = run_one(make_engine, request)

    assert result.token_ids == OUTPUT[:4]
    assert result.finish_reason == FinishReason.STOP


def test_a_stop_token_id_stops_a_request_and_is_reported(
    make_engine: Callable[..., FakeEngine],
) -> None:
    request = make_request("a", PROMPT, stop_token_ids=[OUTPUT[3]], max_tokens=8)

    result = run_one(make_engine, request)

    assert result.token_ids == OUTPUT[:4]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, OUTPUT[3])


def test_max_tokens_ends_a_request_with_length(make_engine: Callable[..., FakeEngine]) -> None:
    result = run_one(make_engine, make_request("a", PROMPT, max_tokens=6))

    assert result.token_ids == OUTPUT[:6]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.LENGTH, None)


def test_max_model_len_ends_a_request_with_length(make_engine: Callable[..., FakeEngine]) -> None:
    request = make_request("a", [7, 8, 9, 10, 1], max_tokens=None)

    result = run_one(make_engine, request, max_model_len=16)

    assert result.token_ids == expected_tokens([1], 11)  # 5 + 11 = max_model_len
    assert result.finish_reason == FinishReason.LENGTH


# ---- aborts and freed ids ---------------------------------------------------------------


def test_aborting_a_waiting_request(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add(make_request("a", [1, 2], max_tokens=3), make_request("b", [3, 4]))
    engine.step()

    outputs = engine.abort("b")

    assert outputs == [
        EngineCoreOutput(request_id="b", new_token_ids=[], finish_reason=FinishReason.ABORT)
    ]
    assert "b" not in engine.scheduler.requests
    engine.step()
    assert engine.history[-1].freed_request_ids == ["b"]
    results = engine.run()
    assert results["a"].token_ids == expected_tokens([2], 3)
    assert results["b"] == Result(token_ids=[], finish_reason=FinishReason.ABORT)


def test_aborting_a_running_request_frees_its_blocks(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", list(range(10)), max_tokens=4))
    engine.step()
    assert engine.scheduler.kv_cache.pool.num_free_blocks < engine.config.num_kv_blocks

    outputs = engine.abort("a")

    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.ABORT)]
    assert engine.scheduler.kv_cache.pool.num_free_blocks == engine.config.num_kv_blocks
    assert engine.scheduler.running == []
    assert engine.schedule().freed_request_ids == ["a"]


def test_a_token_for_a_request_aborted_in_flight_is_dropped(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", [1, 2], max_tokens=4), make_request("b", [3, 4], max_tokens=4))
    scheduler_output = engine.schedule()
    runner_output = engine.runner.execute(scheduler_output)

    engine.abort("a")
    outputs = engine.update(scheduler_output, runner_output)

    assert [o.request_id for o in outputs] == ["b"]
    engine.run()


def test_unknown_request_ids_are_ignored_when_finishing(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()

    assert engine.abort("nope") == []


def test_the_next_step_frees_the_requests_that_finished(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", [1, 2], max_tokens=1), make_request("b", [3, 4], max_tokens=3))
    engine.step()
    assert engine.results["a"].finish_reason == FinishReason.LENGTH

    engine.step()

    assert engine.history[-1].freed_request_ids == ["a"]
    engine.run()
    assert engine.scheduler.schedule().freed_request_ids == ["b"]


# ---- a mixed workload -------------------------------------------------------------------


def random_workload(seed: int) -> list[tuple[int, Request]]:
    """(step at which it arrives, request): prompts share prefixes, some arrive late."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(8)] for _ in range(3)]
    workload = []
    for n in range(14):
        prompt = rng.choice(prefixes)[: rng.randint(0, 8)]
        prompt += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
        request = make_request(
            f"r{n}",
            prompt,
            priority=rng.randrange(3),
            arrival_time=float(n),
            max_tokens=rng.randint(1, 16),
        )
        workload.append((rng.choice([0, 0, 3, 6, 10]), request))
    return workload


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize(
    ("enable_chunked_prefill", "max_num_batched_tokens"), [(True, 12), (False, 40)]
)
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_a_mixed_workload_under_memory_pressure_gives_the_expected_outputs(
    make_engine: Callable[..., FakeEngine],
    seed: int,
    policy: str,
    enable_chunked_prefill: bool,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool,
) -> None:
    engine = make_engine(
        max_model_len=40,
        num_kv_blocks=10,
        max_num_seqs=4,
        policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    workload = random_workload(seed)

    for step in range(1000):
        engine.add(*(request for arrival, request in workload if arrival == step))
        if step > max(arrival for arrival, _ in workload) and not engine.scheduler.has_requests():
            break
        engine.step()

    assert engine.scheduler.num_preemptions > 0
    for _, request in workload:
        result = engine.results[request.request_id]
        num_tokens = request.sampling_params.max_tokens or 0
        assert result.token_ids == expected_tokens(request.prompt_token_ids, num_tokens)
        assert result.finish_reason == FinishReason.LENGTH
