"""Scheduler: continuous batching, the token budget, max_num_seqs and chunked prefill,
with a fake runner (scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

from engine_svc.messages import FinishReason
from tests.engine_svc.scheduler_harness import (
    VOCAB_SIZE,
    FakeEngine,
    expected_tokens,
    make_request,
)

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
