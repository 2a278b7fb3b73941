"""engine.v1 GenerateMany against one running service (tiny model, started once): many
requests on one call give the in-process engine's tokens with one message a step for all of
them; a bad request gets its own error entry while the rest run; aborts by id and cancelling
the call free the engine; the call ends after its last request once the client half-closes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from engine_svc import LLM, SamplingParams
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.raw_requests import with_raw_string
from tests.service_processes import ServiceProcess, generate_request, run_async

NUM_REQUESTS = 12


def _stub(channel: grpc.aio.Channel) -> engine_pb2_grpc.EngineCoreServiceStub:
    return engine_pb2_grpc.EngineCoreServiceStub(channel)


async def _until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)


def _workload() -> list[tuple[list[int], int, dict[str, Any]]]:
    """Short prompts (one step prefills them all), greedy and seeded sampling."""
    greedy, seeded = {"temperature": 0.0}, {"temperature": 0.8}
    return [
        ([3 + i, 900 + 7 * i, 41, 12 + i], 5 + i, {**seeded, "seed": i} if i % 3 else greedy)
        for i in range(NUM_REQUESTS)
    ]


def test_requests_on_one_call_match_the_engine_with_a_message_a_step(
    service: ServiceProcess, tiny_model_dir: Path
) -> None:
    """Sent while the engine is paused, the requests start in one step: from then on each
    response carries the step's tokens of every request still running."""
    workload = _workload()
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    try:
        params = [SamplingParams(max_tokens=n, **sampling) for _, n, sampling in workload]
        expected = [out.token_ids for out in llm.generate([p for p, _, _ in workload], params)]
    finally:
        llm.shutdown()

    async def body() -> list[pb.GenerateManyResponse]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = _stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            try:
                call = stub.GenerateMany(timeout=60)
                requests = [
                    generate_request(f"many-{i}", prompt, max_tokens, **sampling)
                    for i, (prompt, max_tokens, sampling) in enumerate(workload)
                ]
                await call.write(pb.GenerateManyRequest(requests=requests))
                await call.done_writing()  # the call still runs until its requests end
                await _until(lambda: service.num_requests() == NUM_REQUESTS)
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            responses = [response async for response in call]
            assert await call.code() == grpc.StatusCode.OK
            return responses

    responses = run_async(body)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    for response in responses:
        assert not response.errors
        ids = [output.request_id for output in response.outputs]
        assert len(ids) == len(set(ids)), "one output per request in a response"
        for output in response.outputs:
            assert output.request_id not in finished, "nothing after a request's last output"
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finished[output.request_id] = output.finish_reason
    assert [tokens[f"many-{i}"] for i in range(NUM_REQUESTS)] == expected
    assert len(finished) == NUM_REQUESTS
    # The first step gives every request its first token, all in the first response (the
    # outputs of a step reach the call together); later steps give one response each at
    # most (fewer when the call's writer lags and steps merge), where Generate would send a
    # message per request and step: 12 x 5 + 66 = 126 here.
    assert len(responses[0].outputs) == NUM_REQUESTS
    assert len(responses) <= 5 + NUM_REQUESTS - 1


def test_a_bad_request_gets_its_own_error_and_the_others_run(service: ServiceProcess) -> None:
    good = generate_request("good", [5, 6, 7], 4, ignore_eos=True)
    bad_value = generate_request("hot", [5, 6, 7], 4, temperature=-1.0)
    no_id = generate_request("", [5, 6, 7], 4)
    held = generate_request("held", [8, 9], 900, ignore_eos=True)

    async def body() -> tuple[list[pb.GenerateManyResponse], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = _stub(channel)
            # Paused until "held" has ended: it cannot run its 900 tokens to the end before
            # its twin and its abort are read, however slowly the call's messages are handled.
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            responses: list[pb.GenerateManyResponse] = []
            try:
                call = stub.GenerateMany(timeout=60)
                await call.write(pb.GenerateManyRequest(requests=[good, bad_value, no_id, held]))
                # The same id again while "held" runs: refused, and "held" goes on.
                await call.write(pb.GenerateManyRequest(requests=[held]))
                await call.write(pb.GenerateManyRequest(abort_request_ids=["held", "unknown"]))
                await call.done_writing()
                while not _has_ended(responses, "held"):  # a paused engine still aborts
                    response = await call.read()
                    assert isinstance(response, pb.GenerateManyResponse), "the call ended"
                    responses.append(response)
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            while isinstance(response := await call.read(), pb.GenerateManyResponse):
                responses.append(response)
            return responses, await call.code()

    responses, code = run_async(body)
    assert code == grpc.StatusCode.OK
    errors = {(e.request_id, e.code, e.message.split(":")[0]) for r in responses for e in r.errors}
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors == {
        ("hot", invalid, "sampling_params.temperature"),
        ("", invalid, "request_id"),
        ("held", invalid, "request_id"),
    }
    outputs = [o for r in responses for o in r.outputs]
    assert sum(len(o.token_ids) for o in outputs if o.request_id == "good") == 4
    ends = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert ends == {"good": pb.FINISH_REASON_LENGTH, "held": pb.FINISH_REASON_ABORT}
    assert service.num_requests() == 0


def _has_ended(responses: list[pb.GenerateManyResponse], request_id: str) -> bool:
    return any(
        o.request_id == request_id and o.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        for r in responses
        for o in r.outputs
    )


def test_cancelling_the_call_aborts_its_requests(service: ServiceProcess) -> None:
    async def body() -> int:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = _stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            try:
                call = stub.GenerateMany()
                requests = [
                    generate_request(f"gone-{i}", [4, 5, i], 900, ignore_eos=True) for i in range(4)
                ]
                await call.write(pb.GenerateManyRequest(requests=requests))
                await _until(lambda: service.num_requests() == 4)
                call.cancel()
                await _until(lambda: service.num_requests() == 0)
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            load = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads[0]
            return load.num_free_kv_blocks

    assert run_async(body) == 256


def test_too_many_requests_in_one_message_end_the_call(service: ServiceProcess) -> None:
    async def body() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            call = _stub(channel).GenerateMany(timeout=60)
            await call.write(pb.GenerateManyRequest(abort_request_ids=["x"] * 1025))
            await call.done_writing()
            return await call.code(), await call.details()

    code, details = run_async(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("requests: 1025 requests and aborts")


def test_an_undecodable_message_ends_the_call_and_frees_its_requests(
    service: ServiceProcess,
) -> None:
    """A message protobuf cannot parse (a request id that is not UTF-8, as a client in
    another language can send) is the client's mistake: INVALID_ARGUMENT naming the message
    type, not INTERNAL, and the request the call holds is aborted."""
    held = pb.GenerateManyRequest(requests=[generate_request("held", [8, 9], 900, ignore_eos=True)])
    undecodable = with_raw_string(pb.GenerateManyRequest(), ["requests", "request_id"], b"\xff")

    async def body() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = _stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            try:
                call = channel.stream_stream(
                    "/engine.v1.EngineCoreService/GenerateMany",
                    request_serializer=lambda raw: raw,
                    response_deserializer=pb.GenerateManyResponse.FromString,
                )(timeout=60)
                await call.write(held.SerializeToString())
                await _until(lambda: service.num_requests() == 1)
                await call.write(undecodable)
                code, details = await call.code(), await call.details()
                await _until(lambda: service.num_requests() == 0)
            finally:
                await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            return code, details

    code, details = run_async(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        "request is not a valid engine.v1.GenerateManyRequest: a string field is not valid UTF-8"
    )
