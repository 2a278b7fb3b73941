"""The engine service's failure and shutdown model, each test on a service of its own: an
engine killed or failing ends every stream with UNAVAILABLE and the service with a non-zero
exit; SIGTERM drains (or aborts, with timeout 0) and exits 0; data parallelism spreads load."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from engine_svc import LLM, SamplingParams
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.process_tree import descendants, is_alive
from tests.service_processes import (
    NOT_SERVING,
    ServiceProcess,
    StreamResult,
    consume,
    engine_stub,
    generate_request,
    run_async,
    start_service,
)

ServiceFactory = Callable[..., ServiceProcess]


@pytest.fixture
def launch(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServiceFactory]:
    started: list[ServiceProcess] = []

    def factory(*extra_args: str) -> ServiceProcess:
        service = start_service(
            tiny_model_dir, tmp_path / f"service-{len(started)}.log", *extra_args
        )
        started.append(service)
        return service

    yield factory
    for service in started:
        service.stop()


def _long_requests(count: int, max_tokens: int, prefix: str) -> list[pb.GenerateRequest]:
    return [
        generate_request(f"{prefix}-{i}", [11, 12, 13 + i], max_tokens, ignore_eos=True)
        for i in range(count)
    ]


async def _start_streams(
    stub: engine_pb2_grpc.EngineCoreServiceStub,
    requests: list[pb.GenerateRequest],
    paused_service: ServiceProcess | None = None,
) -> tuple[list[StreamResult], list[asyncio.Task[StreamResult]]]:
    """Start the streams and wait until each has its first tokens. The engine is paused while
    they arrive, so one step schedules them all and they advance together: none can finish
    while another still waits for its first token, however slowly they were admitted.
    With `paused_service` (the engine's), the engine stays paused and runs a step at a time
    until every stream has its first tokens, so however slowly this client reads, every
    stream is still mid-flight afterwards."""
    await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
    results = [StreamResult() for _ in requests]
    tasks = [
        asyncio.create_task(consume(stub, request, result))
        for request, result in zip(requests, results, strict=True)
    ]
    while True:
        response = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        if sum(load.num_running + load.num_waiting for load in response.loads) == len(requests):
            break
        await asyncio.sleep(0.05)
    if paused_service is None:
        await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
    else:
        every_first = functools.partial(_all_within, [r.first_message for r in results], 0.2)
        await asyncio.to_thread(paused_service.step_until, every_first)
    await asyncio.gather(*(r.first_message.wait() for r in results))
    return results, tasks


def _all_within(events: list[asyncio.Event], timeout_s: float) -> bool:
    """From another thread: whether every event is set within `timeout_s` (what a step
    produced takes a moment to reach the client)."""
    deadline = time.monotonic() + timeout_s
    while not all(event.is_set() for event in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _refuses_new_calls(service: ServiceProcess) -> bool:
    """Whether the service turns new calls away: NOT_SERVING, or already gone (a drain can
    end, and the server with it, before a loaded client's next health check)."""
    try:
        return service.health() == NOT_SERVING
    except grpc.RpcError as error:
        return error.code() == grpc.StatusCode.UNAVAILABLE


def _assert_fails_fast_and_exits_nonzero(
    service: ServiceProcess, trigger: Callable[[], None] | None, num_streams: int = 8
) -> list[StreamResult]:
    """Start streams, pull the trigger (or let the failure come), then check the ending."""

    async def body() -> list[StreamResult]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            doomed = _long_requests(num_streams, 900, "doomed")
            # Paused mid-stream where a trigger follows: none can finish before it.
            paused = service if trigger is not None else None
            results, tasks = await _start_streams(stub, doomed, paused)
            if trigger is not None:
                trigger()
            # The streams end from the failure alone: the engine is paused (or dead), so none
            # can finish or be served; were the failure never seen, this would wait until the
            # test's timeout.
            await asyncio.gather(*tasks)
            return results

    results = run_async(body)
    assert [r.code for r in results] == [grpc.StatusCode.UNAVAILABLE] * num_streams
    assert service.health() == NOT_SERVING
    assert service.wait_exit(timeout_s=20) != 0
    return results


def test_kill_9_of_the_engine_fails_every_stream_and_the_service(launch: ServiceFactory) -> None:
    service = launch()
    (engine_pid,) = service.engine_pids()
    _assert_fails_fast_and_exits_nonzero(service, lambda: os.kill(engine_pid, signal.SIGKILL))


def test_kill_9_of_the_service_process_leaves_no_engine_core(launch: ServiceFactory) -> None:
    """The engine core watches the service process that spawned it: killed with -9, the
    service cannot stop its children, and the core ends itself (it aborts its requests and
    exits once it sees its parent's sentinel close)."""
    service = launch()
    (engine_pid,) = service.engine_pids()
    assert engine_pid in descendants(service.process.pid)
    os.kill(service.process.pid, signal.SIGKILL)  # the service alone, not its session
    service.process.wait(timeout=30)
    deadline = time.monotonic() + 60  # generous: the core acts as soon as it is scheduled
    while is_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(engine_pid), "the engine core outlived its service process"


def test_a_forward_error_fails_every_stream_and_the_service(launch: ServiceFactory) -> None:
    service = launch("--fail-after-steps", "40")
    results = _assert_fails_fast_and_exits_nonzero(service, trigger=None)
    assert all("Executor failed" in r.details for r in results), results[0].details


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(
    launch: ServiceFactory,
) -> None:
    service = launch("--shutdown-timeout", "60")

    async def body() -> tuple[list[StreamResult], StreamResult]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            # Paused until the signal (a draining engine resumes itself): every request is
            # mid-flight when it lands, with its ~400 steps still to drain.
            requests = _long_requests(4, 400, "drain")
            results, tasks = await _start_streams(stub, requests, service)
            service.process.send_signal(signal.SIGTERM)
            while not _refuses_new_calls(service):
                await asyncio.sleep(0.02)
            late = await consume(stub, generate_request("late", [1, 2, 3], 4), StreamResult())
            await asyncio.gather(*tasks)
            return results, late

    results, late = run_async(body)
    assert late.code == grpc.StatusCode.UNAVAILABLE
    assert [(r.code, r.finish_reason, len(r.token_ids)) for r in results] == [
        (None, pb.FINISH_REASON_LENGTH, 400)
    ] * 4
    assert service.wait_exit(timeout_s=20) == 0


def test_sigterm_drains_a_generate_many_call_then_ends_it_unavailable(
    launch: ServiceFactory,
) -> None:
    """The call's requests run to their end and a late one gets its own UNAVAILABLE; then the
    engine ends the call itself (the server's stop would cancel it, after its grace). The
    engine is paused until the signal, a step at a time until the first response: the
    drain then has the requests' ~900 steps to run while the late one is sent, however
    slowly this client read that response (the drain itself cannot be held)."""
    service = launch("--shutdown-timeout", "60")

    async def body() -> tuple[list[pb.GenerateManyResponse], grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            call = stub.GenerateMany()
            requests = _long_requests(2, 900, "many")
            await call.write(pb.GenerateManyRequest(requests=requests))
            first = asyncio.ensure_future(call.read())
            got_first = threading.Event()
            first.add_done_callback(lambda _: got_first.set())
            await asyncio.to_thread(service.step_until, lambda: got_first.wait(0.2))
            responses = [await first]  # the requests are in the engine, paused
            service.process.send_signal(signal.SIGTERM)
            while service.health() != NOT_SERVING:
                await asyncio.sleep(0.02)
            late = generate_request("late", [1, 2, 3], 4)
            await call.write(pb.GenerateManyRequest(requests=[late]))
            with pytest.raises(grpc.aio.AioRpcError) as ended:  # read() raises the status
                while (response := await call.read()) != grpc.aio.EOF:
                    responses.append(response)
            return responses, ended.value.code(), ended.value.details() or ""

    responses, code, details = run_async(body)
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
    tokens = {"many-0": 0, "many-1": 0}
    for output in (o for r in responses for o in r.outputs):
        tokens[output.request_id] += len(output.token_ids)
    assert tokens == {"many-0": 900, "many-1": 900}
    [error] = [e for r in responses for e in r.errors]
    assert (error.request_id, error.code) == ("late", grpc.StatusCode.UNAVAILABLE.value[0])
    assert service.wait_exit(timeout_s=20) == 0


def test_kill_9_of_the_engine_fails_a_generate_many_calls_requests_then_the_call(
    launch: ServiceFactory,
) -> None:
    """Each request on the call gets its own UNAVAILABLE entry, and the call itself ends
    UNAVAILABLE at once rather than staying open, unanswered, until the server stops."""
    service = launch()

    async def body() -> tuple[list[pb.GenerateManyResponse], grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            call = stub.GenerateMany()
            requests = _long_requests(2, 900, "many")
            await call.write(pb.GenerateManyRequest(requests=requests))
            while service.num_requests() < 2:
                await asyncio.sleep(0.02)
            (engine_pid,) = service.engine_pids()
            os.kill(engine_pid, signal.SIGKILL)
            responses = []
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (response := await call.read()) != grpc.aio.EOF:
                    responses.append(response)
            return responses, ended.value.code(), ended.value.details() or ""

    responses, code, details = run_async(body)
    errors = sorted((e.request_id, e.code) for r in responses for e in r.errors)
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert errors == [("many-0", unavailable), ("many-1", unavailable)]
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
    assert service.wait_exit(timeout_s=20) != 0


def test_sigterm_with_timeout_0_aborts_in_flight_requests_and_exits_0(
    launch: ServiceFactory,
) -> None:
    service = launch("--shutdown-timeout", "0")

    async def body() -> list[StreamResult]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            results, tasks = await _start_streams(
                engine_stub(channel), _long_requests(4, 900, "abort"), service
            )
            service.process.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
            return results

    results = run_async(body)
    assert [(r.code, r.finish_reason) for r in results] == [(None, pb.FINISH_REASON_ABORT)] * 4
    assert all(len(r.token_ids) < 900 for r in results)
    assert service.wait_exit(timeout_s=20) == 0


def test_data_parallel_2_spreads_20_requests_over_both_ranks(
    launch: ServiceFactory, tiny_model_dir: Path
) -> None:
    service = launch("--data-parallel-size", "2")
    assert len(service.engine_pids()) == 2
    requests = _long_requests(20, 900, "dp")

    async def loads(stub: engine_pb2_grpc.EngineCoreServiceStub) -> list[int]:
        response = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        by_rank = {load.rank: load.num_running + load.num_waiting for load in response.loads}
        return [by_rank[rank] for rank in sorted(by_rank)]

    async def wait_loads(stub: engine_pb2_grpc.EngineCoreServiceStub, want: list[int]) -> None:
        deadline = time.monotonic() + 30  # generous: the ranks answer in milliseconds
        while (seen := await loads(stub)) != want:
            assert time.monotonic() < deadline, f"loads {seen}, not {want}, after 30 s"
            await asyncio.sleep(0.05)

    async def body() -> tuple[list[StreamResult], int]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            # Paused, the ranks hold every request they were given: each must hold its 10.
            await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
            results = [StreamResult() for _ in requests]
            pairs = zip(requests, results, strict=True)
            tasks = [asyncio.create_task(consume(stub, q, r)) for q, r in pairs]
            await wait_loads(stub, [10, 10])
            # Still paused, a step at a time until every stream has its first tokens: what
            # is in the engines stays there until cancelled.
            every_first = functools.partial(_all_within, [r.first_message for r in results], 0.2)
            await asyncio.to_thread(service.step_until, every_first)
            in_engines = sum(await loads(stub))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await wait_loads(stub, [0, 0])  # cancelled streams are aborted in the engines
            await stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            return results, in_engines

    results, in_engines = run_async(body)
    # Every request was still in the engines (a step is exactly one: a few of them cannot
    # make 900 tokens), so the cancels had 20 aborts to make.
    assert in_engines == 20
    received = [r.token_ids for r in results]
    assert all(0 < len(tokens) <= 900 for tokens in received)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=max(len(t) for t in received), ignore_eos=True
        )
        expected = [
            o.token_ids for o in llm.generate([list(r.prompt_token_ids) for r in requests], params)
        ]
    finally:
        llm.shutdown()
    assert received == [e[: len(r)] for r, e in zip(received, expected, strict=True)]
