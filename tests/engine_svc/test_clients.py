"""The synchronous multi-process client: the in-process client's interface with the engine in
its own process. Same tokens, per-request errors, utility calls, an idle loop that sleeps, and
ENGINE_CORE_DEAD when the forward fails or the engine cannot start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_svc.client.inproc import InprocClient
from engine_svc.client.interface import EngineCoreClient
from engine_svc.client.mp_client import SyncMPClient
from engine_svc.config import EngineConfig
from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine_svc.sampling_params import SamplingParams
from shared.errors import EngineDeadError, InvalidRequestError

PROMPTS = [[5, 6, 7], list(range(100, 160)), [42] * 20, [3, 1, 4, 1, 5, 9, 2, 6]]


def _config(model_dir: Path, **options: object) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=256, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[SyncMPClient]:
    running = SyncMPClient(_config(tiny_model_dir), startup_timeout_s=60)
    yield running
    running.shutdown()


def _request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)


def _run(client: EngineCoreClient, max_tokens: int) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        client.add_request(_request(str(i), prompt, max_tokens))
    return _collect(client)


def _collect(client: EngineCoreClient) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for output in client.get_output().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_same_tokens_as_the_in_process_client(client: SyncMPClient, tiny_model_dir: Path) -> None:
    inproc = InprocClient(_config(tiny_model_dir))
    assert isinstance(inproc, EngineCoreClient) and isinstance(client, EngineCoreClient)
    try:
        expected = _run(inproc, max_tokens=12)
    finally:
        inproc.shutdown()
    assert _run(client, max_tokens=12) == expected
    assert client.get_load().num_free_kv_blocks == 256


def test_a_bad_request_is_refused_at_admission_and_the_others_go_on(
    client: SyncMPClient,
) -> None:
    with pytest.raises(InvalidRequestError, match=r"^prompt_token_ids:"):
        client.add_request(_request("bad", [5, 10**6], 4))  # never sent to the engine
    client.add_request(_request("good", [5, 6], 4))
    outputs: dict[str, EngineCoreOutput] = {}
    while client.has_unfinished_requests():
        for output in client.get_output().outputs:
            outputs[output.request_id] = output
    assert list(outputs) == ["good"]
    assert outputs["good"].finish_reason == FinishReason.LENGTH


def test_abort_and_utility_calls(client: SyncMPClient) -> None:
    # Paused before it arrives, the request runs only the step it is given: mid-flight from
    # its first token on, however slowly this test runs (paused after that token instead,
    # it could run to its end between the test's get_output() and pause()).
    client.pause()
    try:
        client.add_request(_request("long", [7, 8], 500))
        assert client.resume_for_steps(1) == 1  # its first token, then paused again
        assert client.get_load().num_running == 1
        assert client.reset_prefix_cache() is False  # refused while blocks are in use
        client.abort_requests(["long", "unknown"])  # a paused engine still takes aborts
        outputs: list[EngineCoreOutput] = []
        for _ in range(50):  # the step's output, perhaps stats alone, then the abort
            if not client.has_unfinished_requests():
                break
            outputs += client.get_output().outputs
        assert outputs[0].request_id == "long"
        assert outputs[-1].finish_reason == FinishReason.ABORT
        assert sum(len(o.new_token_ids) for o in outputs) == 1
        load = client.get_load()
        assert (load.num_running, load.num_free_kv_blocks) == (0, 256)
        assert client.reset_prefix_cache() is True
    finally:
        client.resume()


def test_a_bounded_resume_returns_with_its_steps_outputs_buffered(client: SyncMPClient) -> None:
    client.pause()
    try:
        client.add_request(_request("stepped", [7, 8], 30))
        assert client.resume_for_steps(4) == 4  # returns once the steps' outputs are in
        assert client.get_load().num_running == 1  # paused again, mid-request
        client.abort_requests(["stepped"])
        outputs = []
        for _ in range(20):  # the four steps' outputs, perhaps stats alone, then the abort
            if not client.has_unfinished_requests():
                break
            outputs += client.get_output().outputs
        assert outputs[-1].finish_reason == FinishReason.ABORT
        assert sum(len(o.new_token_ids) for o in outputs) == 4
    finally:
        client.resume()


def test_the_idle_busy_loop_sleeps_instead_of_spinning(client: SyncMPClient) -> None:
    (process,) = client._procs.processes
    before = _cpu_seconds(process.pid)
    time.sleep(1.0)
    assert _cpu_seconds(process.pid) - before < 0.1


def _cpu_seconds(pid: int | None) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def test_a_forward_error_kills_the_engine_with_executor_failed(tiny_model_dir: Path) -> None:
    failing = SyncMPClient(_config(tiny_model_dir, fail_after_steps=3), startup_timeout_s=60)
    try:
        failing.add_request(_request("r", [5, 6, 7], 50))
        with pytest.raises(EngineDeadError, match="Executor failed"):
            for _ in range(50):
                failing.get_output()
    finally:
        failing.shutdown()


def test_an_engine_that_cannot_start_says_why(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineDeadError, match="KVCacheTooSmallError"):
        SyncMPClient(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=4), startup_timeout_s=60)
