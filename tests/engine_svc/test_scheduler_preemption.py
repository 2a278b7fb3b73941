"""Scheduler: preemption by recompute (victims by policy, resumption order, outputs
unchanged), with a fake runner (scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_svc.core.request import Request, RequestStatus
from engine_svc.messages import FinishReason
from tests.engine_svc.scheduler_harness import (
    FakeEngine,
    expected_tokens,
    make_request,
)

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
