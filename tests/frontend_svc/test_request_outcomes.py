"""How the frontend's metrics count a request's end (frontend_svc/metrics.py), driven by
update streams the test writes: a passed deadline is an abort whichever side saw it first
(gRPC cancelling the call, or the engine call's own deadline raising TimeoutError); a
failure after the first update is an error; a refusal before any is not counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from frontend_svc.messages import ChoiceDelta, FinishReason, GenerationUpdate, ModelInfo
from frontend_svc.metrics import FrontendMetrics
from shared.errors import DeadlinePassedError

MODEL = ModelInfo(model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=(2,))


async def _updates(
    tokens: int, then: BaseException | None, first_finishes: bool = False
) -> AsyncGenerator[GenerationUpdate]:
    for i in range(tokens):
        yield GenerationUpdate(request_id="r", choices=[ChoiceDelta(index=0, token_ids=[i])])
    if first_finishes:  # n = 2: choice 0 stops, choice 1 goes on
        choices = [ChoiceDelta(index=0, finish_reason=FinishReason.STOP),
                   ChoiceDelta(index=1, token_ids=[7])]  # fmt: skip
        yield GenerationUpdate(request_id="r", choices=choices)
    if then is not None:
        raise then


def _outcomes(
    tokens: int, then: BaseException | None, first_finishes: bool = False
) -> dict[str, float]:
    registry = CollectorRegistry()

    async def body() -> None:
        updates = _updates(tokens, then, first_finishes)
        tracked = FrontendMetrics(registry).track(MODEL, 3, updates)
        with pytest.raises(type(then)) if then is not None else contextlib.nullcontext():
            async for _ in tracked:
                pass

    asyncio.run(body())
    return {
        sample.labels["finished_reason"]: sample.value
        for family in registry.collect()
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value
    }


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_passed_deadline_is_an_abort_before_or_after_the_first_token(tokens: int) -> None:
    assert _outcomes(tokens, DeadlinePassedError()) == {"abort": 1.0}


def test_a_cancelled_call_is_an_abort() -> None:
    assert _outcomes(2, asyncio.CancelledError()) == {"abort": 1.0}


def test_a_failure_after_the_first_token_is_an_error_and_before_it_not_a_request() -> None:
    assert _outcomes(2, RuntimeError("engine failed")) == {"error": 1.0}
    assert _outcomes(0, RuntimeError("no engine")) == {}


def test_the_first_choices_finish_counts_only_where_the_stream_ran_to_its_end() -> None:
    assert _outcomes(1, None, first_finishes=True) == {"stop": 1.0}
    # n = 2: choice 0 stopped, then the deadline passed (or the client left) before choice 1.
    assert _outcomes(1, DeadlinePassedError(), first_finishes=True) == {"abort": 1.0}
    assert _outcomes(1, asyncio.CancelledError(), first_finishes=True) == {"abort": 1.0}
    assert _outcomes(1, RuntimeError("engine failed"), first_finishes=True) == {"error": 1.0}


def test_a_timeout_that_is_not_the_clients_deadline_is_an_error() -> None:
    assert _outcomes(2, TimeoutError("a lock took too long")) == {"error": 1.0}
