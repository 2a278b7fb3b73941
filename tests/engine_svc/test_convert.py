"""Protobuf <-> engine structs: defaults for unset optional fields, field names in errors."""

from __future__ import annotations

import pytest

from engine_svc.messages import EngineCoreOutput, FinishReason, TokenLogprobs
from engine_svc.server import convert
from shared.errors import InvalidRequestError
from shared.protos import engine_pb2 as pb


def test_unset_optional_fields_keep_the_engine_defaults() -> None:
    params = convert.to_sampling_params(pb.SamplingParams())
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert (params.max_tokens, params.seed, params.logprobs) == (None, None, None)


def test_zero_is_a_real_value_for_optional_fields() -> None:
    params = convert.to_sampling_params(pb.SamplingParams(temperature=0.0, logprobs=0, seed=0))
    assert (params.temperature, params.logprobs, params.seed) == (0.0, 0, 0)
    assert params.is_greedy


def test_every_sampling_field_comes_across() -> None:
    message = pb.SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.75, top_k=4, min_p=0.25, seed=3,
        stop_token_ids=[8, 9], ignore_eos=True, min_tokens=2, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.5, logprobs=2, logit_bias={4: -2.5},
    )  # fmt: skip
    params = convert.to_sampling_params(message)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (9, 0.5, 0.75, 4)
    assert (params.min_p, params.seed, params.stop_token_ids) == (0.25, 3, [8, 9])
    assert (params.ignore_eos, params.min_tokens, params.logprobs) == (True, 2, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.5
    assert params.logit_bias == {4: -2.5}


def test_errors_name_the_field_as_the_client_spells_it() -> None:
    params = convert.to_sampling_params(pb.SamplingParams(top_p=2.0))
    # The servicer's admission (the engine client checks) runs inside proto_field_names.
    with pytest.raises(InvalidRequestError) as caught, convert.proto_field_names():
        params.validate()
    assert caught.value.field == "sampling_params.top_p"


def test_more_logit_biases_than_the_limit_are_refused_by_name() -> None:
    biases = dict.fromkeys(range(convert.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)
    with pytest.raises(InvalidRequestError) as caught:
        convert.to_sampling_params(pb.SamplingParams(logit_bias=biases))
    assert caught.value.field == "sampling_params.logit_bias"


def test_an_empty_request_id_gets_one_made_up() -> None:
    first = convert.to_engine_request(pb.GenerateRequest(prompt_token_ids=[1]))
    second = convert.to_engine_request(pb.GenerateRequest(prompt_token_ids=[1]))
    assert first.request_id and first.request_id != second.request_id


def test_the_last_response_carries_the_finish_reason() -> None:
    output = EngineCoreOutput(
        request_id="r",
        new_token_ids=[4, 5],
        new_logprobs=[TokenLogprobs(4, -0.1, 1, [], []), TokenLogprobs(5, -0.2, 2, [], [])],
        finish_reason=FinishReason.STOP,
        stop_reason=5,
        num_cached_tokens=16,
    )
    response = convert.to_generate_response(output)
    assert list(response.token_ids) == [4, 5]
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert (response.stop_token_id, response.num_cached_tokens) == (5, 16)
    assert [lp.rank for lp in response.logprobs] == [1, 2]
    running = convert.to_generate_response(EngineCoreOutput(request_id="r", new_token_ids=[1]))
    assert running.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not running.HasField("stop_token_id")
