"""Scheduler: how requests end (EOS, stop token ids, min/max tokens, model length), aborts
and freed ids, with a fake runner (scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_svc.core.request import Request
from engine_svc.messages import EngineCoreOutput, FinishReason
from tests.engine_svc.scheduler_harness import (
    FakeEngine,
    Result,
    expected_tokens,
    make_request,
)

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


# ---- constraints the request itself cannot satisfy ---------------------------------------


class ScriptedGrammar:
    """A constrained request's grammar as the scheduler sees it: compiled (or failed to),
    accepting every token until the test says it allows none."""

    def __init__(self, error: str | None = None) -> None:
        self._error = error
        self.dead_end: str | None = None
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return True

    @property
    def error(self) -> str | None:
        return self._error

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    @property
    def is_terminated(self) -> bool:
        return False


def test_a_grammar_that_fails_to_compile_ends_its_request_naming_the_constraint(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    request = make_request("a", PROMPT, regex="[0-9]+")
    request.structured = ScriptedGrammar(error="grammar compilation failed: too large")
    engine.add(request)

    assert engine.schedule().scheduled == []
    (failed,) = engine.scheduler.take_failed_outputs()
    assert (failed.finish_reason, failed.invalid_field) == (FinishReason.ERROR, "regex")
    assert failed.error == "grammar compilation failed: too large"


def test_a_grammar_that_allows_no_token_ends_its_request_without_the_draw(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    request = make_request("a", PROMPT, json_schema='{"type": "object"}')
    grammar = ScriptedGrammar()
    request.structured = grammar
    engine.add(request)
    engine.step()
    engine.step()
    grammar.dead_end = "the constraint cannot be completed"  # as the step's bitmask found

    (output,) = engine.step()

    assert (output.finish_reason, output.invalid_field) == (FinishReason.ERROR, "json_schema")
    assert output.new_token_ids == [] and output.error is not None
    assert "no token can follow the 2 generated so far" in output.error
    assert engine.results["a"].token_ids == OUTPUT[:2] == grammar.accepted
    assert not engine.scheduler.has_requests()
