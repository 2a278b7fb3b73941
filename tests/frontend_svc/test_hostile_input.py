"""Hostile input against both services, as subprocesses with the tiny model: property-based
requests (hypothesis, derandomized so every run sends the same ones) with NaN, infinite,
negative and huge numbers, unknown and huge token ids, empty and huge prompts, thousands of
stop strings, deep and enormous JSON schemas and catastrophic regexes, and string fields
that are not UTF-8 (lone surrogates, 0xFF), sent as raw bytes. Every answer is a result,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message (INVALID_ARGUMENT naming the request
type for bytes that do not parse): never INTERNAL or UNKNOWN, never a dead process or a stuck
engine; afterwards a greedy request gives the same text as before."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as epb
from shared.protos import engine_pb2_grpc
from tests.frontend_svc.frontend_helpers import greedy
from tests.raw_requests import INVALID_UTF8, send_raw, with_raw_string
from tests.service_processes import FrontendProcess, ServiceProcess, wait_all_serving

ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_TIMEOUT_S = 60.0
REFERENCE = fpb.GenerateRequest(prompt="The reference prompt", sampling_params=greedy(12))
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Services:
    def __init__(self, engine: ServiceProcess, frontend: FrontendProcess, reference: str):
        self.engine = engine
        self.frontend = frontend
        self.reference = reference


def _reference_text(frontend: FrontendProcess) -> str:
    with frontend.channel() as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        return str(stub.Generate(REFERENCE, timeout=CALL_TIMEOUT_S).choices[0].text)


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    logs = tmp_path_factory.mktemp("hostile")
    engine = ServiceProcess(tiny_model_dir, logs / "engine.log")
    frontend = FrontendProcess([engine.address], logs / "frontend.log")
    wait_all_serving([engine, frontend])
    yield Services(engine, frontend, _reference_text(frontend))
    frontend.stop()
    engine.stop()


FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, -1e30, 1e-30]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 7, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
INT32 = st.one_of(
    st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1]), st.integers(-(2**31), 2**31 - 1)
)
INT64 = st.one_of(st.sampled_from([-(2**63), -1, 0, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))
SMALL_MAX_TOKENS = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32 - 1]))
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ufffd" * 50, "🙂" * 200, "a" * 100_000]),
)


def _nested_schema(depth: int) -> str:
    """An object schema nested `depth` deep, written as text (json.dumps would recurse)."""
    opening = '{"type": "object", "required": ["x"], "properties": {"x": '
    schema = opening * depth + '{"type": "string"}' + "}}" * depth
    json.loads(schema) if depth < 500 else None  # the shallow ones are checked to parse
    return schema


CONSTRAINTS = st.one_of(
    st.none(),
    st.builds(lambda t: {"json_schema": t}, TEXT),
    st.sampled_from(
        [
            {"json_schema": _nested_schema(5)},
            {"json_schema": _nested_schema(3000)},
            {"json_schema": json.dumps({"enum": [str(i) for i in range(20_000)]})},
            {"json_schema": "{" * 100_000},
            {"json_object": True},
            {"regex": "(a+)+$"},
            {"regex": "(a|aa)*b" * 50},
            {"regex": "[" * 1000},
            {"regex": "x{1000000}"},
        ]
    ),
    st.builds(lambda t: {"regex": t}, TEXT),
)


@st.composite
def sampling_params(draw: st.DrawFn) -> fpb.SamplingParams:
    params = fpb.SamplingParams(
        top_k=draw(INT32),
        min_p=draw(FLOATS),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.one_of(st.integers(0, 4), UINT32)),
        presence_penalty=draw(FLOATS),
        frequency_penalty=draw(FLOATS),
        stop_token_ids=draw(st.lists(UINT32, max_size=5)),
        stop=draw(st.one_of(st.lists(TEXT, max_size=4), st.just([f"s{i}" for i in range(5000)]))),
    )
    if draw(st.booleans()):
        params.max_tokens = draw(SMALL_MAX_TOKENS)
    else:
        params.max_tokens = 4  # unset would run to the model's length: kept short
    for field in ("temperature", "top_p", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(params, field, draw(FLOATS))
    if draw(st.booleans()):
        params.seed = draw(INT64)
    if draw(st.booleans()):
        params.logprobs = draw(st.one_of(st.integers(0, 5), UINT32))
    if draw(st.booleans()):
        params.n = draw(st.one_of(st.integers(0, 3), UINT32))
    constraint = draw(CONSTRAINTS)
    if constraint is not None:
        for field, value in constraint.items():
            setattr(params, field, value)
    return params


@st.composite
def frontend_requests(draw: st.DrawFn) -> fpb.GenerateRequest:
    request = fpb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), TEXT)),
        sampling_params=draw(sampling_params()),
        priority=draw(INT32),
    )
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        request.prompt = draw(TEXT)
    elif kind == "ids":
        request.prompt_token_ids.extend(draw(st.lists(UINT32, max_size=20)))
    elif kind == "messages":
        roles = st.sampled_from(["user", "assistant", "system", "", "tool", "x" * 1000])
        for role, content in draw(st.lists(st.tuples(roles, TEXT), max_size=4)):
            request.messages.add(role=role, content=content)
    return request


def _answer(call: grpc.UnaryUnaryMultiCallable, request: object) -> grpc.StatusCode:
    try:
        call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        code = error.code()
        assert code in ACCEPTABLE, f"{code}: {error.details()} for {request!r:.2000}"
        assert error.details(), "a refusal without a message"
        return code
    return grpc.StatusCode.OK


@SETTINGS
@given(request=frontend_requests())
def test_the_frontend_answers_any_request_with_a_result_or_a_clear_refusal(
    services: Services, request: fpb.GenerateRequest
) -> None:
    with services.frontend.channel() as channel:
        _answer(frontend_pb2_grpc.GenerationServiceStub(channel).Generate, request)
    assert services.frontend.process.poll() is None and services.engine.process.poll() is None


@SETTINGS
@given(
    prompt=st.lists(UINT32, max_size=20),
    params=sampling_params(),
    request_id=st.one_of(st.just(""), TEXT),
)
def test_the_engine_answers_any_request_with_a_result_or_a_clear_refusal(
    services: Services, prompt: list[int], params: fpb.SamplingParams, request_id: str
) -> None:
    fields = {f.name for f in epb.SamplingParams.DESCRIPTOR.fields}
    engine_params = epb.SamplingParams()
    for descriptor, value in params.ListFields():
        if descriptor.name in fields:
            if isinstance(value, str | bytes | int | float | bool):
                setattr(engine_params, descriptor.name, value)
            elif descriptor.message_type is not None:
                getattr(engine_params, descriptor.name).CopyFrom(value)
            else:  # a repeated scalar field
                getattr(engine_params, descriptor.name).extend(value)
    request = epb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=engine_params
    )
    with services.engine.channel() as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        try:
            for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                pass
        except grpc.RpcError as error:
            code = error.code()
            assert code in ACCEPTABLE, f"{code}: {error.details()} for {request!r:.2000}"
            assert error.details()
    assert services.engine.process.poll() is None


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": _nested_schema(3000)},
        {"json_schema": json.dumps({"enum": [str(i) for i in range(20_000)]})},
        {"json_schema": "{" * 100_000},
        {"regex": "(a+)+$"},
        {"regex": "(a|aa)*b" * 50},
        {"regex": "[" * 1000},
        {"regex": "x{1000000}"},
        {"stop": [f"s{i}" for i in range(5000)]},
        {"n": 2**32 - 1},
        {"logprobs": 2**32 - 1},
        {"temperature": math.nan},
        {"seed": -(2**63)},
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_the_worst_of_them_every_time(services: Services, fields: dict[str, object]) -> None:
    params = greedy(4)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
    request = fpb.GenerateRequest(prompt="Hostile", sampling_params=params)
    with services.frontend.channel() as channel:
        _answer(frontend_pb2_grpc.GenerationServiceStub(channel).Generate, request)
    assert services.frontend.process.poll() is None and services.engine.process.poll() is None


def test_ten_megabyte_prompts_are_refused_with_the_field_named(services: Services) -> None:
    huge_text = fpb.GenerateRequest(prompt="word " * 2_000_000, sampling_params=greedy(4))
    huge_ids = fpb.GenerateRequest(prompt_token_ids=[5] * 2_500_000, sampling_params=greedy(4))
    with services.frontend.channel() as channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        for request in (huge_text, huge_ids):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(request, timeout=CALL_TIMEOUT_S)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt" in (caught.value.details() or "")


FRONTEND_SERVICE = "/frontend.v1.GenerationService/"
# (method, whether it streams, the request it carries, a string field of that request)
FRONTEND_STRING_FIELDS = [
    ("Generate", False, REFERENCE, ("request_id",)),
    ("Generate", False, REFERENCE, ("prompt",)),
    ("Generate", False, REFERENCE, ("messages", "content")),
    ("Generate", False, REFERENCE, ("messages", "role")),
    ("Generate", False, REFERENCE, ("sampling_params", "stop")),
    ("GenerateStream", True, REFERENCE, ("sampling_params", "json_schema")),
    ("GenerateStream", True, REFERENCE, ("sampling_params", "regex")),
    ("GenerateStream", True, REFERENCE, ("sampling_params", "choice", "choices")),
    ("Tokenize", False, fpb.TokenizeRequest(text="x"), ("text",)),
]


def _refused_as_undecodable(
    service: ServiceProcess, method: str, streaming: bool, raw: bytes, type_name: str
) -> None:
    with service.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        send_raw(channel, method, raw, streaming, CALL_TIMEOUT_S)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert (
        error.details() == f"request is not a valid {type_name}: a string field is not valid UTF-8"
    )


@settings(SETTINGS, max_examples=12)
@given(target=st.sampled_from(FRONTEND_STRING_FIELDS), raw=INVALID_UTF8)
def test_a_string_field_that_is_not_utf8_is_invalid_argument(
    services: Services,
    target: tuple[str, bool, fpb.GenerateRequest | fpb.TokenizeRequest, tuple[str, ...]],
    raw: bytes,
) -> None:
    method, streaming, request, path = target
    sent = with_raw_string(request, path, raw)
    type_name = request.DESCRIPTOR.full_name
    _refused_as_undecodable(
        services.frontend, FRONTEND_SERVICE + method, streaming, sent, type_name
    )
    assert services.frontend.process.poll() is None and services.engine.process.poll() is None


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\xed\xa0\x80"], ids=["0xFF", "lone-surrogate"])
def test_a_prompt_that_is_not_utf8_is_refused_and_the_next_request_served(
    services: Services, raw: bytes
) -> None:
    request = with_raw_string(REFERENCE, ("prompt",), raw)
    method = FRONTEND_SERVICE + "Generate"
    _refused_as_undecodable(
        services.frontend, method, False, request, "frontend.v1.GenerateRequest"
    )
    assert _reference_text(services.frontend) == services.reference


def test_after_all_that_the_same_greedy_text(services: Services) -> None:
    # Runs last in this module: the services took every request above and still agree.
    services.engine.wait_idle(60)
    assert _reference_text(services.frontend) == services.reference
    assert services.frontend.process.poll() is None and services.engine.process.poll() is None
