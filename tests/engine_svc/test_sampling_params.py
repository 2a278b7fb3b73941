"""SamplingParams: each invalid value is rejected naming its field; msgpack round trips."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from engine_svc.sampling_params import MAX_LOGPROBS, SamplingParams
from shared.errors import InvalidRequestError

NAN = float("nan")


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),  # logits / inf: NaN where masked
        ({"temperature": 1e39}, "temperature"),  # finite, but inf in float32
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 1e-46}, "repetition_penalty"),  # 0 in float32: -inf * 0
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"temperature": NAN}, "temperature"),
        ({"top_p": NAN}, "top_p"),
        ({"min_p": NAN}, "min_p"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"frequency_penalty": NAN}, "frequency_penalty"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"50": 1.0}}, "logit_bias"),  # OpenAI's JSON keys, unconverted
        ({"logit_bias": {50: "1.0"}}, "logit_bias"),
        ({"logit_bias": {5: 100.01}}, "logit_bias"),
        ({"logit_bias": {5: -100.01}}, "logit_bias"),
        ({"logit_bias": {5: NAN}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ],
)
def test_an_invalid_value_is_rejected_naming_its_field(values: dict[str, Any], field: str) -> None:
    params = SamplingParams(**values)  # built without a check: admission checks, once

    with pytest.raises(InvalidRequestError) as error:
        params.validate()

    assert error.value.field == field


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 1, "min_tokens": 1},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 0.01},
        {"temperature": 3.4e38, "repetition_penalty": 1e-6},
        {"repetition_penalty": 1e6},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"logit_bias": {0: -100.0, 49151: 100.0}},
        {"logit_bias": {}},
    ],
)
def test_values_at_the_limits_are_accepted(values: dict[str, Any]) -> None:
    SamplingParams(**values).validate()


def test_the_defaults_are_vllms() -> None:
    params = SamplingParams()

    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert not params.is_greedy
    assert not params.has_penalties


def test_greedy_and_penalties_are_derived_from_the_values() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_a_msgpack_round_trip_keeps_every_value() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        max_tokens=None,
        min_tokens=3,
        stop_token_ids=[2, 13],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=5,
        logit_bias={7: -3.5, 49151: 100.0},
    )

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)

    assert decoded == params


def test_a_msgpack_round_trip_of_the_defaults_keeps_them() -> None:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams)

    assert decoded == SamplingParams()
    assert decoded.max_tokens == 16


def test_decoding_trusts_the_values_and_validate_names_the_bad_one() -> None:
    """The engine process decodes what its own client checked: no second check there."""
    encoded = msgspec.msgpack.encode({"top_p": 0.0})

    decoded = msgspec.msgpack.decode(encoded, type=SamplingParams)

    with pytest.raises(InvalidRequestError, match="top_p"):
        decoded.validate()
