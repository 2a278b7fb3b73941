"""Faults with both services as subprocesses and the tiny model, each test on services of its
own: a frontend killed mid-stream, a hundred streams cancelled at random points, SIGTERM to
the engine or to the frontend while 32 streams run, a 200 ms deadline, and a burst of ten
times the queue limit (refused at once with a retry hint, memory bounded). Afterwards the
engine holds no request and every KV block is free; every stream ended with all its tokens or
with a clear status, none silently. Where a race with the tiny model's speed would decide the
outcome, the engine is paused (PauseGeneration) so the fault lands while requests are in it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as epb
from shared.protos import engine_pb2_grpc
from tests.frontend_svc.frontend_helpers import frontend_stub, greedy
from tests.service_processes import (
    FrontendProcess,
    ServiceProcess,
    run_async,
    tree_rss_bytes,
    wait_all_serving,
)

CLEAR_ENDS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


@dataclasses.dataclass
class Services:
    engine: ServiceProcess
    frontend: FrontendProcess


@dataclasses.dataclass
class Outcome:
    code: grpc.StatusCode | None = None  # None: the stream ended normally
    finish_reason: int = 0
    num_tokens: int = 0


@pytest.fixture
def start(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Services]]:
    started: list[ServiceProcess] = []

    def start_services(*frontend_args: str) -> Services:
        # A drain on SIGTERM gets far longer than the tiny model needs (30 s by default),
        # so that a busy machine cannot turn a complete stream into an aborted one.
        engine = ServiceProcess(
            tiny_model_dir, tmp_path / "engine.log", "--shutdown-timeout", "300"
        )
        frontend = FrontendProcess([engine.address], tmp_path / "frontend.log", *frontend_args)
        started.extend([frontend, engine])
        wait_all_serving([engine, frontend])
        return Services(engine, frontend)

    yield start_services
    for process in started:
        process.stop()


def _kv_usage(engine: ServiceProcess) -> list[float]:
    with engine.channel() as channel:
        loads = engine_pb2_grpc.EngineCoreServiceStub(channel).GetLoads(
            epb.GetLoadsRequest(), timeout=5
        )
    return [load.kv_cache_usage for load in loads.loads]


def _request(num_tokens: int, name: str) -> fpb.GenerateRequest:
    params = greedy(num_tokens, ignore_eos=True)
    return fpb.GenerateRequest(request_id=name, prompt=f"Fault {name}", sampling_params=params)


async def _consume(call: grpc.aio.UnaryStreamCall, outcome: Outcome, stop_after: int = -1) -> None:
    """Read a stream into `outcome`; cancel it after `stop_after` messages (-1: never)."""
    received = 0
    try:
        async for response in call:
            for choice in response.choices:
                outcome.num_tokens += len(choice.token_ids)
                outcome.finish_reason = choice.finish_reason or outcome.finish_reason
            received += 1
            if received == stop_after:
                call.cancel()
                outcome.code = grpc.StatusCode.CANCELLED
                return
    except grpc.aio.AioRpcError as error:
        outcome.code = error.code()
    except asyncio.CancelledError:
        outcome.code = grpc.StatusCode.CANCELLED


async def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _streams_paused_in_the_engine(
    channel: grpc.aio.Channel, engine: ServiceProcess, count: int, num_tokens: int
) -> tuple[list[Outcome], list[asyncio.Task[None]]]:
    """`count` streams through the frontend, read into outcomes by tasks; returns once all
    are running in the engine (their KV blocks allocated) and it is paused, so none can
    finish until it resumes. The engine is paused while they arrive, then runs exactly
    the steps that schedule them all (one, for short prompts)."""
    assert not await asyncio.to_thread(engine.pause)
    stub = frontend_stub(channel)
    outcomes = [Outcome() for _ in range(count)]
    tasks = [
        asyncio.create_task(_consume(stub.GenerateStream(_request(num_tokens, f"s{i}")), o))
        for i, o in enumerate(outcomes)
    ]
    await _wait_for(lambda: engine.num_requests() == count, f"all {count} in the engine")
    await asyncio.to_thread(engine.step_until, lambda: engine.num_running() == count, 10)
    assert await asyncio.to_thread(engine.num_requests) == count
    return outcomes, tasks


def test_a_frontend_killed_mid_stream_leaves_the_engine_nothing(
    start: Callable[..., Services],
) -> None:
    services = start()
    engine = services.engine

    async def body() -> list[Outcome]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            outcomes, tasks = await _streams_paused_in_the_engine(channel, engine, 8, 1000)
            try:
                services.frontend.stop()  # SIGKILL
                await _wait_for(lambda: engine.num_requests() == 0, "the engine aborted all 8")
            finally:
                await asyncio.to_thread(engine.resume)
            await asyncio.gather(*tasks)
            return outcomes

    outcomes = run_async(body, timeout_s=120)
    assert {o.code for o in outcomes} == {grpc.StatusCode.UNAVAILABLE}
    assert _kv_usage(engine) == [0.0]


NUM_CANCELLED = 100
CANCEL_STEPS = 12  # each stream is cancelled after 0 (before its first token) to 12 of them
# As long as the model allows (1024 positions): no stream can end by itself in the few
# engine steps the test lets run.
LONG_STREAM_TOKENS = 1000


def test_a_hundred_streams_cancelled_at_random_points_free_everything(
    start: Callable[..., Services],
) -> None:
    """Streams far longer than the test lets the engine run, cancelled by their clients at
    random points: while their requests wait for a first step, or after a random number of
    engine steps. The engine only generates in the steps the test lets through, so nothing
    but the cancels can end the requests: after each round of cancels the paused engine
    must hold exactly the streams still open, and its own counters must show all 100 ended
    as aborts, none complete."""
    services = start()
    engine = services.engine
    rng = random.Random(1234)
    cancel_at = [rng.randint(0, CANCEL_STEPS) for _ in range(NUM_CANCELLED)]

    async def body() -> list[Outcome]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            stub = frontend_stub(channel)
            assert not await asyncio.to_thread(engine.pause)
            outcomes = [Outcome() for _ in cancel_at]
            calls = [
                stub.GenerateStream(_request(LONG_STREAM_TOKENS, f"c{i}"))
                for i in range(NUM_CANCELLED)
            ]
            tasks = [
                asyncio.create_task(_consume(call, outcome))
                for call, outcome in zip(calls, outcomes, strict=True)
            ]
            live = NUM_CANCELLED
            await _wait_for(lambda: engine.num_requests() == live, f"all {live} in the engine")
            for step in range(CANCEL_STEPS + 1):
                if step:
                    await asyncio.to_thread(engine.step)
                    assert await asyncio.to_thread(engine.num_requests) == live, (
                        f"a request ended by itself in engine step round {step}"
                    )
                cancelled = [c for c, at in zip(calls, cancel_at, strict=True) if at == step]
                for call in cancelled:
                    call.cancel()
                live -= len(cancelled)
                # Paused, the engine holds exactly the requests whose streams are still open.
                await _wait_for(
                    lambda n=live: engine.num_requests() == n,
                    f"the engine down to {live} after {len(cancelled)} cancels at step {step}",
                )
            await asyncio.gather(*tasks)
            return outcomes

    try:
        outcomes = run_async(body, timeout_s=240)
    finally:
        engine.resume()
    assert [o.code for o in outcomes] == [grpc.StatusCode.CANCELLED] * NUM_CANCELLED
    assert engine.num_requests() == 0 and _kv_usage(engine) == [0.0]
    # The engine's own view: every request ended as an abort (the counts arrive with the
    # engine's outputs, a moment after its scheduler let go), none ran to its length.
    run_async(
        lambda: _wait_for(
            lambda: (
                engine.metric_total("vllm:request_success_total", finished_reason="abort")
                == NUM_CANCELLED
            ),
            f"the engine counting {NUM_CANCELLED} aborts",
        )
    )
    # Nothing else ended: no request ran to its length.
    assert engine.metric_total("vllm:request_success_total") == NUM_CANCELLED
    # The engine ran exactly the steps the test let through: the first prefilled all 100
    # short prompts, each step gave each live request one token, so a stream cancelled
    # after k steps cost k tokens.
    assert engine.settled_generation_tokens() == sum(cancel_at)


@pytest.mark.parametrize("target", ["engine", "frontend"])
def test_sigterm_while_32_streams_run_ends_each_with_its_tokens_or_a_status(
    start: Callable[..., Services], target: str
) -> None:
    services = start("--shutdown-grace", "60")
    engine = services.engine
    stopped = engine if target == "engine" else services.frontend

    async def body() -> list[Outcome]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            # Paused, none can finish before the signal: all 32 are in flight when it lands.
            outcomes, tasks = await _streams_paused_in_the_engine(channel, engine, 32, 200)
            stopped.process.send_signal(signal.SIGTERM)
            if stopped is not engine:  # a draining engine resumes by itself
                await asyncio.to_thread(engine.resume)
            await asyncio.gather(*tasks)
            return outcomes

    outcomes = run_async(body, timeout_s=180)
    for outcome in outcomes:
        if outcome.code is None:
            assert (outcome.finish_reason, outcome.num_tokens) == (fpb.FINISH_REASON_LENGTH, 200)
        else:
            assert outcome.code in CLEAR_ENDS
    # Both drain: the engine up to --shutdown-timeout (30 s), the frontend up to its grace.
    assert [o.code for o in outcomes] == [None] * 32
    assert stopped.wait_exit(timeout_s=60) == 0


DEADLINE_ATTEMPTS = 5


def test_a_200_ms_deadline_ends_deadline_exceeded_and_aborts_the_request(
    start: Callable[..., Services],
) -> None:
    """The engine is paused, so the request sits in it without a token until the deadline
    ends the call: the test sees the engine hold it before the call ends, then sees it
    taken out (a paused engine ends a request only by abort) and counted as an abort. A
    busy machine may take the 200 ms to forward the request at all: such a try proves
    nothing, and is tried again."""
    services = start()
    engine = services.engine
    with services.frontend.channel() as channel:  # a first call: lazy imports and caches
        frontend_pb2_grpc.GenerationServiceStub(channel).Generate(_request(4, "warm"), timeout=60)

    async def body() -> tuple[grpc.StatusCode | None, bool]:
        """The call's status, and whether the engine held the request before it ended."""
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            call = frontend_stub(channel).Generate(_request(900, "deadline"), timeout=0.2)
            task = asyncio.ensure_future(call)
            held = False
            while not (held or task.done()):
                held = await asyncio.to_thread(engine.num_requests) == 1
            try:
                await task
            except grpc.aio.AioRpcError as error:
                return error.code(), held
            return None, held

    engine.pause()  # the request cannot finish within its deadline, however fast
    try:
        for _ in range(DEADLINE_ATTEMPTS):
            code, held = run_async(body)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            engine.wait_idle(30)  # paused: only the abort can have taken it out
            if held:
                break
        else:
            raise AssertionError(
                f"the request never reached the engine within 200 ms in {DEADLINE_ATTEMPTS} tries"
            )
        assert _kv_usage(engine) == [0.0]
        # The engine's own count (it arrives with the engine's outputs, a moment after its
        # scheduler let go): the request it held ended as an abort, and nothing completed.
        run_async(
            lambda: _wait_for(
                lambda: (
                    engine.metric_total("vllm:request_success_total", finished_reason="abort") >= 1
                ),
                "the engine counting the abort",
            )
        )
    finally:
        engine.resume()
    aborted = engine.metric_total("vllm:request_success_total", finished_reason="abort")
    assert engine.metric_total("vllm:request_success_total") == aborted + 1  # the warm-up
    assert engine.generation_tokens_total() == 4  # the warm-up's: none for the request


QUEUE_LIMIT = 64
BURST = 10 * QUEUE_LIMIT
# What a burst may add to a service's resident memory (its processes together): the refused
# calls must not be held, the admitted ones are small. The figures print with `pytest -s`.
MAX_BURST_GROWTH_BYTES = 64 << 20


def test_a_burst_of_10x_the_queue_limit_is_refused_at_once_with_a_retry_hint(
    start: Callable[..., Services],
) -> None:
    services = start("--max-waiting-requests", str(QUEUE_LIMIT))
    engine = services.engine
    with services.frontend.channel() as channel:  # a first call: lazy imports and caches
        frontend_pb2_grpc.GenerationServiceStub(channel).Generate(_request(4, "warm"), timeout=60)
    pids = {"frontend": services.frontend.process.pid, "engine": engine.process.pid}
    before = {name: tree_rss_bytes(pid) for name, pid in pids.items()}
    engine.pause()  # no request gets a first token: the admitted ones wait until resumed

    async def body() -> tuple[list[grpc.aio.AioRpcError], list[fpb.GenerateResponse]]:
        async with grpc.aio.insecure_channel(services.frontend.address) as channel:
            stub = frontend_stub(channel)

            async def generate(i: int) -> fpb.GenerateResponse:
                return await stub.Generate(_request(16, f"b{i}"), timeout=300)

            calls = [asyncio.create_task(generate(i)) for i in range(BURST)]
            refusals = BURST - QUEUE_LIMIT
            await _wait_for(lambda: sum(c.done() for c in calls) == refusals, "the refusals")
            refused = [c.exception() for c in calls if c.done()]
            waiting = [c for c in calls if not c.done()]
            assert len(waiting) == QUEUE_LIMIT  # admitted, held by the paused engine
            await asyncio.to_thread(engine.resume)
            return [e for e in refused if isinstance(e, grpc.aio.AioRpcError)], list(
                await asyncio.gather(*waiting)
            )

    try:
        refused, completed = run_async(body, timeout_s=300)
    finally:
        engine.resume()
    assert len(refused) == BURST - QUEUE_LIMIT
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry in 1 s" in (error.details() or "")
        assert ("grpc-retry-pushback-ms", "1000") in tuple(error.trailing_metadata() or ())
    assert [len(r.choices[0].token_ids) for r in completed] == [16] * QUEUE_LIMIT
    after = {name: tree_rss_bytes(pid) for name, pid in pids.items()}
    for name in pids:
        growth = after[name] - before[name]
        print(f"{name} resident memory: {before[name] >> 20} MiB before a burst of {BURST} "
              f"calls, {after[name] >> 20} MiB after ({growth / (1 << 20):+.1f} MiB)")  # fmt: skip
        assert growth < MAX_BURST_GROWTH_BYTES, (name, before[name], after[name])
