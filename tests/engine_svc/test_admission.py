"""Admission: a request is checked once, where it enters the engine (engine_svc/admission.py),
against the limits the engine resolved; the scheduler then queues it unchecked. Here through
the fake-runner engine (scheduler_harness.py), which checks as a client does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine_svc.messages import FinishReason
from shared.errors import InvalidRequestError
from tests.engine_svc.scheduler_harness import VOCAB_SIZE, FakeEngine, make_request


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


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        # Without max_tokens, min_tokens must fit what the model length leaves (62 here).
        ({"min_tokens": 63, "max_tokens": None}, "min_tokens"),
        # While min_tokens holds them back, the sampler indexes the logits with these.
        ({"stop_token_ids": [VOCAB_SIZE], "min_tokens": 1}, "stop_token_ids"),
        # Held back until min_tokens, they would leave nothing to sample.
        ({"stop_token_ids": list(range(VOCAB_SIZE)), "min_tokens": 1}, "stop_token_ids"),
        # The sampler indexes the logits with these.
        ({"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ],
)
def test_admission_checks_the_sampling_parameters(
    make_engine: Callable[..., FakeEngine], sampling: dict[str, Any], field: str
) -> None:
    engine = make_engine()

    with pytest.raises(InvalidRequestError) as error:
        engine.add(make_request("a", [1, 2], **sampling))

    assert error.value.field == field
    assert not engine.scheduler.has_requests()


def test_min_tokens_without_max_tokens_may_fill_the_model_length(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(max_model_len=16, num_kv_blocks=4)
    engine.add(make_request("a", [1, 2], min_tokens=14, max_tokens=None))

    assert len(engine.run()["a"].token_ids) == 14
