"""Clients that read their streams slowly or never, against both services as subprocesses.

The test clients turn off HTTP/2's window growth (grpc.http2.bdp_probe = 0), so the frontend
can hand a client at most 64 KB it has not read; the requests below stream several times that
(4 choices with 20 logprobs each). A slow reader must not hold back anyone else, and what the
frontend could not write yet is merged into fewer, larger responses (the frontend's memory
meanwhile within a fixed bound); a reader that takes nothing for --stream-write-timeout seconds
is dropped with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from tests.frontend_svc.frontend_helpers import greedy
from tests.service_processes import (
    FrontendProcess,
    ServiceProcess,
    tree_rss_bytes,
    wait_all_serving,
)

NUM_CHOICES = 4
NUM_TOKENS = 300  # x 4 choices x 20 logprobs: about 200 KB of responses, over the 64 KB window
WAIT_S = 60.0  # generous bound on conditions the services reach in well under a second
# What the frontend's resident memory may grow by while a slow reader's whole stream waits in
# it (measured once the engine has handed over every token). The stream itself is about 200 KB
# on the wire (a few MB as Python objects): the bound is far above that and the allocator's
# noise, yet below what the frontend would need if it kept a copy of everything pending for
# each engine step (a snapshot per step: about 300**2 / 2 x 4 tokens with 20 logprobs each,
# hundreds of MB). It cannot tell merged from separate deltas: the frontend queues the engine's
# outputs one by one until the writer takes them, and merges them then. The figures print
# with `pytest -s`.
MAX_PENDING_GROWTH_BYTES = 64 << 20


@pytest.fixture
def start(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[[float], tuple[ServiceProcess, FrontendProcess]]]:
    started: list[ServiceProcess] = []

    def start_services(stream_write_timeout_s: float) -> tuple[ServiceProcess, FrontendProcess]:
        engine = ServiceProcess(tiny_model_dir, tmp_path / "engine.log")
        frontend = FrontendProcess(
            [engine.address],
            tmp_path / "frontend.log",
            "--stream-write-timeout",
            str(stream_write_timeout_s),
        )
        started.extend([frontend, engine])
        wait_all_serving([engine, frontend])
        return engine, frontend

    yield start_services
    for process in started:
        process.stop()


def _small_window_stub(frontend: FrontendProcess) -> frontend_pb2_grpc.GenerationServiceStub:
    channel = grpc.insecure_channel(frontend.address, options=[("grpc.http2.bdp_probe", 0)])
    return frontend_pb2_grpc.GenerationServiceStub(channel)


def _heavy_request(name: str, num_tokens: int = NUM_TOKENS) -> fpb.GenerateRequest:
    params = greedy(num_tokens, ignore_eos=True, n=NUM_CHOICES, logprobs=20)
    return fpb.GenerateRequest(request_id=name, prompt="A slow reader", sampling_params=params)


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


def _choices(responses: list[fpb.GenerateResponse]) -> dict[int, tuple[list[int], str]]:
    merged: dict[int, tuple[list[int], str]] = {}
    for response in responses:
        for choice in response.choices:
            token_ids, text = merged.get(choice.index, ([], ""))
            merged[choice.index] = (token_ids + list(choice.token_ids), text + choice.text)
    return merged


def test_a_slow_reader_holds_back_no_one_and_gets_its_tokens_merged(start: Callable) -> None:
    engine, frontend = start(600.0)
    stub = _small_window_stub(frontend)
    # A first call: lazy imports and caches are in the frontend's memory before it is measured.
    warm = list(stub.GenerateStream(_heavy_request("warm", 8), timeout=WAIT_S))
    assert all(len(ids) == 8 for ids, _ in _choices(warm).values())
    before = tree_rss_bytes(frontend.process.pid)
    slow = stub.GenerateStream(_heavy_request("slow"), timeout=WAIT_S * 4)  # not read yet

    # Another request runs to its end while the slow stream sits unread.
    fast = list(stub.GenerateStream(_heavy_request("fast", 32), timeout=WAIT_S))
    assert all(len(ids) == 32 for ids, _ in _choices(fast).values())
    # The engine finished the slow request too: it is not held back by its reader.
    _wait_until(lambda: engine.num_requests() == 0, "the engine idle")
    assert engine.generation_tokens_total() == NUM_CHOICES * (8 + NUM_TOKENS + 32)
    # The frontend's requests share one GenerateMany call, whose responses keep the order in
    # which the engine produced the outputs: once a request sent after the engine went idle
    # has its answer, the slow stream's last output has reached the frontend too, and all of
    # the slow stream waits there now.
    probe = fpb.GenerateRequest(request_id="probe", prompt="p", sampling_params=greedy(1))
    assert len(list(stub.GenerateStream(probe, timeout=WAIT_S))) >= 1
    pending = tree_rss_bytes(frontend.process.pid)
    growth = pending - before
    print(f"frontend resident memory: {before >> 20} MiB before, {pending >> 20} MiB with a "
          f"slow reader's {NUM_CHOICES} x {NUM_TOKENS} tokens pending "
          f"({growth / (1 << 20):+.1f} MiB)")  # fmt: skip
    assert growth < MAX_PENDING_GROWTH_BYTES, (before, pending)

    responses = list(slow)
    choices = _choices(responses)
    assert sorted(choices) == list(range(NUM_CHOICES))
    assert all(len(ids) == NUM_TOKENS for ids, _ in choices.values())
    # Once 64 KB sat unread, the rest (about two thirds) waited in the frontend and went out
    # merged: a delta of many tokens, where an engine step gives one token per choice.
    assert max(len(c.token_ids) for r in responses for c in r.choices) >= NUM_TOKENS // 3
    # The same tokens and text as the same request read at once.
    again = list(stub.GenerateStream(_heavy_request("again"), timeout=WAIT_S))
    assert choices == _choices(again)
    assert responses[-1].usage.completion_tokens == NUM_CHOICES * NUM_TOKENS


def test_a_client_that_never_reads_is_dropped(start: Callable) -> None:
    engine, frontend = start(1.0)
    stub = _small_window_stub(frontend)
    never = stub.GenerateStream(_heavy_request("never", 500), timeout=WAIT_S * 4)

    dropped = {"grpc_method": "GenerateStream", "grpc_code": "ResourceExhausted"}
    _wait_until(
        lambda: frontend.metric_total("grpc_server_handled_total", **dropped) == 1,
        "the frontend dropping the stream",
    )
    _wait_until(lambda: engine.num_requests() == 0, "the engine idle")

    with pytest.raises(grpc.RpcError) as raised:
        for _ in never:  # what was buffered, then the status
            pass
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read nothing of its stream for 1 s" in raised.value.details()
    # The frontend still serves.
    ok = list(stub.GenerateStream(_heavy_request("after", 8), timeout=WAIT_S))
    assert all(len(ids) == 8 for ids, _ in _choices(ok).values())
