"""frontend.v1 protobuf to requests (defaults for unset fields), and input checks that name
the field as the client spells it."""

from __future__ import annotations

import pytest

from frontend_svc.engines import convert as engine_convert
from frontend_svc.messages import EngineRequest, FinishReason, ModelInfo
from frontend_svc.server import convert
from frontend_svc.validation import validate_prompt, validate_request
from shared.errors import InvalidRequestError
from shared.frontend_protos import frontend_pb2 as pb
from shared.protos import engine_pb2

MODEL = ModelInfo(model_name="m", max_model_len=64, vocab_size=100, eos_token_ids=(2,))


def test_unset_fields_take_their_defaults() -> None:
    request = convert.to_generation_request(pb.GenerateRequest(prompt="hi"))
    sampling = request.sampling
    assert (request.prompt, request.prompt_token_ids, request.messages) == ("hi", None, None)
    assert (sampling.n, sampling.skip_special_tokens, sampling.stop) == (1, True, ())
    assert (sampling.temperature, sampling.max_tokens, sampling.seed) == (None, None, None)
    assert sampling.logit_bias == ()


def test_sampling_fields_reach_the_engine_request_and_choices_get_their_seeds() -> None:
    params = pb.SamplingParams(
        max_tokens=9, temperature=0.0, top_p=0.5, top_k=3, seed=7, stop_token_ids=[4],
        ignore_eos=True, min_tokens=1, logprobs=0, n=3, stop=["x"], skip_special_tokens=False,
        logit_bias={5: -1.5, 6: 2.0},
    )  # fmt: skip
    sampling = convert.to_sampling_options(params)
    assert (sampling.n, sampling.stop, sampling.skip_special_tokens) == (3, ("x",), False)
    engine_request = EngineRequest(
        request_id="r-2", prompt_token_ids=(1, 2), sampling=sampling.for_choice(2)
    )
    message = engine_convert.to_generate_request(engine_request)
    engine_params = message.sampling_params
    assert (engine_params.max_tokens, engine_params.temperature, engine_params.seed) == (9, 0.0, 9)
    assert engine_params.HasField("logprobs") and engine_params.logprobs == 0
    assert not engine_params.HasField("repetition_penalty")  # the engine's default
    assert list(engine_params.stop_token_ids) == [4] and engine_params.ignore_eos
    assert dict(engine_params.logit_bias) == {5: -1.5, 6: 2.0}


def test_engine_outputs_convert_with_finish_and_stop_token() -> None:
    response = engine_pb2.GenerateResponse(
        token_ids=[5, 6], finish_reason=engine_pb2.FINISH_REASON_STOP, stop_token_id=6,
        num_cached_tokens=16,
    )  # fmt: skip
    out = engine_convert.to_engine_output(response)
    assert (out.new_token_ids, out.finish_reason, out.stop_token_id) == (
        (5, 6),
        FinishReason.STOP,
        6,
    )
    assert engine_convert.to_engine_output(engine_pb2.GenerateResponse()).finish_reason is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(n=0)}, "sampling_params.n"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(n=500)}, "sampling_params.n"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(stop=[""])}, "sampling_params.stop"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(stop=["x" * 600])},
         "sampling_params.stop"),
        ({"prompt": "a", "sampling_params": pb.SamplingParams(seed=2**63 - 1, n=2)},
         "sampling_params.seed"),
        ({"messages": [pb.ChatMessage(role="", content="x")]}, "messages[0].role"),
        ({"prompt": "a", "request_id": "x" * 300}, "request_id"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(fields: dict[str, object], field: str) -> None:
    request = convert.to_generation_request(pb.GenerateRequest(**fields))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as caught:
        validate_request(request)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [([], "empty"), (list(range(64)), "no room"), ([1, 100], "vocabulary")],
)
def test_prompts_are_checked_against_the_model(token_ids: list[int], message: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_prompt("prompt", token_ids, MODEL)
    assert caught.value.field == "prompt" and message in caught.value.message
