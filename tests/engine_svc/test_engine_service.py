"""engine.v1.EngineCoreService against one running service (tiny model, started once):
streams match the in-process engine, cancellation frees everything within a second, bad
input is INVALID_ARGUMENT naming the field (or, for bytes that do not parse, such as a string
field that is not UTF-8, the request type), and the utility RPCs answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine_svc import LLM, SamplingParams
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.raw_requests import send_raw, with_raw_string
from tests.service_processes import (
    SERVING,
    ServiceProcess,
    StreamResult,
    consume,
    engine_stub,
    frozen_at_start,
    generate_request,
    run_async,
)


def _workload(count: int) -> list[tuple[list[int], int, dict[str, Any]]]:
    """Prompts of mixed lengths; most greedy, some seeded sampling (batch-independent)."""
    rng = np.random.default_rng(7)
    workload = []
    for i in range(count):
        prompt = rng.integers(3, 49152, size=int(rng.integers(1, 80))).tolist()
        max_tokens = int(rng.integers(1, 40))
        sampling = {"temperature": 0.8, "seed": 1000 + i} if i % 4 == 3 else {"temperature": 0.0}
        workload.append((prompt, max_tokens, sampling))
    return workload


def test_32_concurrent_streams_match_the_in_process_engine(
    service: ServiceProcess, tiny_model_dir: Path
) -> None:
    workload = _workload(32)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    try:
        params = [SamplingParams(max_tokens=n, **sampling) for _, n, sampling in workload]
        expected = [out.token_ids for out in llm.generate([p for p, _, _ in workload], params)]
    finally:
        llm.shutdown()

    async def body() -> list[StreamResult]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            requests = [
                generate_request(f"match-{i}", prompt, max_tokens, **sampling)
                for i, (prompt, max_tokens, sampling) in enumerate(workload)
            ]
            return await asyncio.gather(*(consume(stub, r, StreamResult()) for r in requests))

    results = run_async(body)
    assert [r.code for r in results] == [None] * 32
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) for r in results)


def test_cancelling_16_streams_frees_every_request_and_block(service: ServiceProcess) -> None:
    """The streams are cancelled while the engine is paused with them inside, so what frees
    their requests and blocks is the cancellation, not their end. The engine is paused while
    they arrive, then runs exactly one step (ResumeGeneration with max_steps), which gives
    each its first token."""

    async def body() -> int:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            results = [StreamResult() for _ in range(16)]
            tasks = [
                asyncio.create_task(
                    consume(stub, generate_request(f"cancel-{i}", [7, 8, 9 + i], 900,
                                                   ignore_eos=True), result)
                )
                for i, result in enumerate(results)
            ]  # fmt: skip
            await _until(lambda: service.num_requests() == 16)
            await stub.ResumeGeneration(pb.ResumeGenerationRequest(max_steps=1), timeout=30)
            await asyncio.gather(*(r.first_message.wait() for r in results))
            in_engine = service.num_requests()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Generous: only the cancellations have to reach the engine.
            await _until(lambda: service.num_requests() == 0, timeout_s=30)
            load = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads[0]
            await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            assert (load.kv_cache_usage, load.num_free_kv_blocks) == (0.0, 256)
            return in_engine

    assert run_async(body) == 16


def test_a_bounded_resume_runs_exactly_that_many_steps(service: ServiceProcess) -> None:
    """ResumeGeneration(max_steps=k) returns once the engine ran k steps and paused again:
    the engine's own token count has moved by exactly k for one decoding request, and the
    stream has every one of them."""
    before = service.settled_generation_tokens()
    result = StreamResult()

    async def body() -> list[int]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            request = generate_request("stepped", [3, 4, 5], 20, ignore_eos=True)
            task = asyncio.create_task(consume(stub, request, result))
            counts = []
            try:
                await _until(lambda: service.num_requests() == 1)
                for steps in (1, 2, 5):
                    resume = pb.ResumeGenerationRequest(max_steps=steps)
                    response = await stub.ResumeGeneration(resume, timeout=30)
                    assert list(response.steps_run) == [steps]
                    counts.append(service.generation_tokens_total() - before)
                assert service.num_requests() == 1  # paused again, with 12 tokens to go
                # More steps than the request has left: answered when it ends.
                resume = pb.ResumeGenerationRequest(max_steps=50)
                response = await stub.ResumeGeneration(resume, timeout=30)
                assert list(response.steps_run) == [12]
                await task
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            return counts

    assert run_async(body) == [1, 3, 8]
    assert (result.finish_reason, len(result.token_ids)) == (pb.FINISH_REASON_LENGTH, 20)
    with service.channel() as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        refused = pb.ResumeGenerationRequest(max_steps=0)
        error = _rpc_error(lambda: stub.ResumeGeneration(refused, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "max_steps: must be at least 1 when set"


def _rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, 49152]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5] * 200_000}, "prompt_token_ids"),  # an oversized message
        ({"prompt_token_ids": [5] * 1000, "max_tokens": 100}, "sampling_params.max_tokens"),
        ({"temperature": -1.0}, "sampling_params.temperature"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"top_k": -5}, "sampling_params.top_k"),
        ({"logprobs": 1000}, "sampling_params.logprobs"),
        ({"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
        ({"min_tokens": 50, "max_tokens": 10}, "sampling_params.min_tokens"),
        ({"stop_token_ids": list(range(5000))}, "sampling_params.stop_token_ids"),
        # Past the vocabulary, these ids crashed the sampler once min_tokens held them back.
        ({"stop_token_ids": [49152], "min_tokens": 1}, "sampling_params.stop_token_ids"),
        ({"min_tokens": 4_000_000_000, "max_tokens": None}, "sampling_params.min_tokens"),
        # Parses, but no token can continue it: ended naming the field, not as a fault.
        ({"regex": r"[^\s\S]"}, "sampling_params.regex"),
        ({"allowed_token_ids": [5, 49152]}, "sampling_params.allowed_token_ids"),
        ({"allowed_token_ids": [5] * 300_000}, "sampling_params.allowed_token_ids"),
        ({"bad_words_token_ids": [pb.TokenIds()]}, "sampling_params.bad_words_token_ids"),
        # Two tokens allowed and every pair of them banned: after the first, none can follow.
        (
            {
                "allowed_token_ids": [5, 6],
                "bad_words_token_ids": [
                    pb.TokenIds(token_ids=[a, b]) for a in (5, 6) for b in (5, 6)
                ],
            },
            "sampling_params.bad_words_token_ids",
        ),
        ({"request_id": "x" * 5000}, "request_id"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    service: ServiceProcess, request_fields: dict[str, Any], field: str
) -> None:
    fields = {"request_id": "", "prompt_token_ids": [5, 6, 7], "max_tokens": 4, **request_fields}
    request = generate_request(fields.pop("request_id"), fields.pop("prompt_token_ids"),
                               fields.pop("max_tokens"), **fields)  # fmt: skip
    with grpc.insecure_channel(service.address) as channel:
        error = _rpc_error(lambda: list(engine_stub(channel).Generate(request, timeout=30)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(f"{field}:"), error.details()
        # The engine keeps serving.
        good = list(engine_stub(channel).Generate(generate_request("", [5, 6], 2), timeout=30))
        assert sum(len(r.token_ids) for r in good) == 2


GOOD = generate_request("", [5, 6], 2)
# (method, whether it streams, the request it carries, a string field of that request)
STRING_FIELDS = [
    ("/engine.v1.EngineCoreService/Generate", True, GOOD, ("request_id",)),
    ("/engine.v1.EngineCoreService/Generate", True, GOOD, ("sampling_params", "json_schema")),
    ("/engine.v1.EngineCoreService/Generate", True, GOOD, ("sampling_params", "regex")),
    ("/engine.v1.EngineCoreService/Generate", True, GOOD, ("sampling_params", "choice", "choices")),
    ("/engine.v1.EngineCoreService/Abort", False, pb.AbortRequest(), ("request_ids",)),
    ("/vllm.grpc.engine.VllmEngine/Generate", True, vpb.GenerateRequest(), ("request_id",)),
]


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\xed\xa0\x80"], ids=["0xFF", "lone-surrogate"])
@pytest.mark.parametrize(
    ("method", "streaming", "request_message", "path"),
    STRING_FIELDS,
    ids=[f"{m.rpartition('/')[2]}:{'.'.join(p)}" for m, _, _, p in STRING_FIELDS],
)
def test_a_string_field_that_is_not_utf8_is_invalid_argument_naming_the_type(
    service: ServiceProcess,
    method: str,
    streaming: bool,
    request_message: Any,
    path: tuple[str, ...],
    raw: bytes,
) -> None:
    """A client in another language can send any bytes in a string field; Python's protobuf
    cannot parse them, and the service says so instead of answering UNKNOWN."""
    type_name = request_message.DESCRIPTOR.full_name
    refused = {"grpc_method": method.rpartition("/")[2], "grpc_code": "InvalidArgument"}
    refused_before = service.metric_total("grpc_server_handled_total", **refused)
    with grpc.insecure_channel(service.address) as channel:
        sent = with_raw_string(request_message, path, raw)
        error = _rpc_error(lambda: send_raw(channel, method, sent, streaming, timeout_s=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert error.details() == (
            f"request is not a valid {type_name}: a string field is not valid UTF-8"
        )
        # Counted like any refusal, and the engine keeps serving.
        handled = service.metric_total_reaching(
            "grpc_server_handled_total", refused_before + 1, **refused
        )
        assert handled == refused_before + 1
        good = list(engine_stub(channel).Generate(GOOD, timeout=30))
        assert sum(len(r.token_ids) for r in good) == 2
    assert service.process.poll() is None


def test_a_request_id_already_in_flight_is_refused(service: ServiceProcess) -> None:
    """Paused, the first request stays in flight whatever the second one's delay."""

    async def body() -> None:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            first = StreamResult()
            request = generate_request("twin", [1, 2, 3], 900, ignore_eos=True)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            try:
                task = asyncio.create_task(consume(stub, request, first))
                await _until(lambda: service.num_requests() == 1)
                second = await consume(stub, request, StreamResult())
                assert second.code == grpc.StatusCode.INVALID_ARGUMENT
                assert second.details.startswith("request_id:")
                await stub.Abort(pb.AbortRequest(request_ids=["twin"]), timeout=5)
                await task
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            assert first.finish_reason == pb.FINISH_REASON_ABORT

    run_async(body)


def test_abort_by_id_ends_the_stream_and_is_idempotent(service: ServiceProcess) -> None:
    """The request is aborted while the engine is paused with it inside: it cannot have
    finished first, however slow the Abort call (beside busy loops a 900-token request once
    finished between its first token and the Abort)."""

    async def body() -> None:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            result = StreamResult()
            request = generate_request("abort-me", [4, 5, 6], 900, ignore_eos=True)
            assert not await asyncio.to_thread(service.pause)
            try:
                task = asyncio.create_task(consume(stub, request, result))
                await _until(lambda: service.num_requests() == 1)
                ids = ["abort-me", "never-existed"]
                await stub.Abort(pb.AbortRequest(request_ids=ids), timeout=5)
                await asyncio.wait_for(task, 30)
                await stub.Abort(pb.AbortRequest(request_ids=ids), timeout=5)
            finally:
                await asyncio.to_thread(service.resume)
            assert result.code is None
            assert result.finish_reason == pb.FINISH_REASON_ABORT
            assert len(result.token_ids) == 0
            assert service.num_requests() == 0

    run_async(body)


async def _until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)


def test_logprobs_come_with_each_token(service: ServiceProcess) -> None:
    with grpc.insecure_channel(service.address) as channel:
        request = generate_request("lp", [9, 10, 11], 6, logprobs=3)
        responses = list(engine_stub(channel).Generate(request, timeout=30))
    for response in responses:
        assert len(response.logprobs) == len(response.token_ids)
        for token_id, logprobs in zip(response.token_ids, response.logprobs, strict=True):
            assert logprobs.token_id == token_id
            assert len(logprobs.top_token_ids) == len(logprobs.top_logprobs) == 3
            assert logprobs.logprob <= 0.0
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_model_info_health_and_reflection(service: ServiceProcess, tiny_model_dir: Path) -> None:
    assert service.health() == SERVING
    with grpc.insecure_channel(service.address) as channel:
        info = engine_stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        query = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(iter(reflection.ServerReflectionInfo(iter([query]), timeout=5)))
    assert (info.model_name, info.max_model_len, info.vocab_size) == (
        tiny_model_dir.name,
        1024,
        49152,
    )
    assert (list(info.eos_token_ids), info.block_size, info.num_kv_blocks) == ([2], 16, 256)
    assert (info.data_parallel_size, info.architecture) == (1, "LlamaForCausalLM")
    names = {s.name for s in answer.list_services_response.service}
    assert {"engine.v1.EngineCoreService", "grpc.health.v1.Health"} <= names


def test_the_engine_processes_freeze_their_start_up_heap(service: ServiceProcess) -> None:
    # Full collections skip what start-up built (shared/gc_heap.py): the model, the blocks.
    assert frozen_at_start(service.log_path, "engine core 0") > 10_000
    assert frozen_at_start(service.log_path, "the engine service") > 10_000


def test_tokenizer_streams_a_loadable_copy(
    service: ServiceProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    with grpc.insecure_channel(service.address) as channel:
        for chunk in engine_stub(channel).GetTokenizer(pb.GetTokenizerRequest(), timeout=30):
            with (tmp_path / chunk.file_name).open("ab") as file:
                file.write(chunk.data)
    assert not (tmp_path / "model.safetensors").exists()
    text = "Hello, engine service!"
    copy = AutoTokenizer.from_pretrained(tmp_path)
    original = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert copy.encode(text) == original.encode(text)
    assert copy.chat_template == original.chat_template


def test_reset_prefix_cache_when_idle(service: ServiceProcess) -> None:
    with grpc.insecure_channel(service.address) as channel:
        stub = engine_stub(channel)
        list(stub.Generate(generate_request("", list(range(3, 60)), 2), timeout=30))
        assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=5).success
