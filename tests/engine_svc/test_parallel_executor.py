"""Tensor and pipeline parallelism through the engine's gRPC service: worker processes
joined by torch.distributed (gloo on CPU), each rank holding its share of the tiny model.

Greedy tokens must equal the single-worker engine's, and logprobs (of the sampled tokens,
and of the prompts for the half of the requests that ask for them) agree within 1e-4: the
row-parallel all-reduce sums in another order, so they may differ in the last bits. Where
that parts the two at a near tie, the test shows the tie (top-2 gap under 1e-4) instead of
passing silently. On the 2-core machine the ranks share the cores, one thread each.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine_svc import LLM, SamplingParams
from engine_svc.distributed.layout import ParallelLayout
from engine_svc.models.model_spec import load_model_spec
from engine_svc.models.sharding import RankShards
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc
from tests.model_fixtures import TOKENIZER_FILES
from tests.service_processes import (
    NOT_SERVING,
    ServiceProcess,
    StreamResult,
    consume,
    engine_stub,
    generate_request,
    run_async,
    service_env,
    start_service,
    three_free_ports,
)

LAYOUTS = {
    "tp2": ("--tensor-parallel-size", "2"),
    "pp2": ("--pipeline-parallel-size", "2"),
    "tp2xpp2": ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"),
}
# Prompts up to 70 tokens in steps of 32: long ones are prefilled in chunks, each a batch
# of its own, so a pipeline has two batches in flight.
COMMON_ARGS = ("--max-num-batched-tokens", "32", "--num-kv-blocks", "256")
NUM_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4

Step = tuple[int, float, list[float]]  # token, its logprob, the top-2 logprobs
# A request that asks for prompt logprobs (every even one) has one step per prompt token
# after the first, ahead of its sampled tokens'.


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 49000 + 3 for j in range(4 + 11 * (i % 7))] for i in range(16)]


def _generate(service: ServiceProcess) -> list[list[Step]]:
    """The 16 prompts at once (so they batch), greedy, with the top-2 logprobs."""

    async def body() -> list[list[Step]]:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = engine_stub(channel)
            requests = [
                generate_request(
                    f"p{i}",
                    prompt,
                    NUM_TOKENS,
                    ignore_eos=True,
                    logprobs=2,
                    prompt_logprobs=None if i % 2 else 2,
                )
                for i, prompt in enumerate(_prompts())
            ]
            return await asyncio.gather(*(_steps(stub, r) for r in requests))

    result: list[list[Step]] = run_async(body, timeout_s=300)
    return result


async def _steps(
    stub: engine_pb2_grpc.EngineCoreServiceStub, request: pb.GenerateRequest
) -> list[Step]:
    steps: list[Step] = []
    async for response in stub.Generate(request):
        for logprobs in [*response.prompt_logprobs, *response.logprobs]:
            steps.append((logprobs.token_id, logprobs.logprob, list(logprobs.top_logprobs)))
    return steps


@pytest.fixture(scope="module")
def single_worker_steps(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[list[Step]]:
    log_path = tmp_path_factory.mktemp("single-worker") / "service.log"
    service = start_service(tiny_model_dir, log_path, *COMMON_ARGS)
    try:
        return _generate(service)
    finally:
        service.stop()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_parallel_layout_gives_the_single_workers_tokens_and_logprobs(
    layout: str, single_worker_steps: list[list[Step]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    service = start_service(tiny_model_dir, tmp_path / "service.log", *COMMON_ARGS,
                            *LAYOUTS[layout])  # fmt: skip
    try:
        assert len(_worker_pids(service)) == (4 if layout == "tp2xpp2" else 2)
        steps = _generate(service)
        loads = _loads(service)
    finally:
        service.stop()
    _assert_same_steps(single_worker_steps, steps, layout)
    if "--pipeline-parallel-size" in LAYOUTS[layout]:
        # The batch queue kept one batch per stage in flight.
        assert loads.max_batches_in_flight == 2
    else:
        assert loads.max_batches_in_flight == 1
    assert loads.num_batches_in_flight == 0


def _assert_same_steps(
    expected_steps: list[list[Step]], steps: list[list[Step]], name: str
) -> None:
    ties = []
    for prompt, (expected, got) in enumerate(zip(expected_steps, steps, strict=True)):
        prompt_steps = 0 if prompt % 2 else len(_prompts()[prompt]) - 1
        assert len(got) == len(expected) == prompt_steps + NUM_TOKENS
        for step, ((token, logprob, top), (their_token, their_logprob, _)) in enumerate(
            zip(expected, got, strict=True)
        ):
            if token != their_token:
                # Only a near tie may part them; after it, the sequences differ by right.
                gap = top[0] - top[1]
                assert gap < LOGPROB_TOLERANCE, (prompt, step, token, their_token, gap)
                ties.append((prompt, step, gap))
                break
            assert abs(logprob - their_logprob) < LOGPROB_TOLERANCE, (prompt, step)
    print(f"{name}: near ties that parted the outputs (prompt, step, top-2 gap): {ties}")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tensor_parallelism_splits_each_expert_of_a_mixture(
    family: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """TP=2 on a mixture (Mixtral's block_sparse_moe, Qwen3-MoE's experts beside a dense
    layer): each rank holds half of every expert's columns and reads only those from the
    checkpoint; the tokens and logprobs are the single worker's."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine_svc.family_configs import FAMILIES

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES[family]()).save_pretrained(tmp_path / "model")
    folder = tmp_path / "model"
    for file in TOKENIZER_FILES:
        if (default_model_dir / file).is_file():
            shutil.copy(default_model_dir / file, folder / file)
    shards = RankShards.of(load_model_spec(folder), ParallelLayout(2, 1))
    assert shards.moe_rows == (0, load_model_spec(folder).moe_intermediate_size // 2)
    steps = {}
    for name, layout in (("single", ()), ("tp2", LAYOUTS["tp2"])):
        service = start_service(folder, tmp_path / f"{name}.log", *COMMON_ARGS, *layout)
        try:
            steps[name] = _generate(service)
        finally:
            service.stop()
    _assert_same_steps(steps["single"], steps["tp2"], f"{family} tp2")


@pytest.mark.parametrize("victim", ["worker", "engine-core"])
def test_a_killed_process_ends_every_stream_unavailable_and_leaves_no_worker(
    victim: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of one worker: the executor's monitor reports it, the streams end UNAVAILABLE
    and the service exits non-zero. kill -9 of the engine-core process: its workers notice
    their parent is gone and leave. Either way no worker survives. The engine is paused
    with the streams inside, so none can end first."""
    service = start_service(tiny_model_dir, tmp_path / "service.log", *LAYOUTS["tp2"])
    try:
        workers = _worker_pids(service)
        (engine_core,) = service.engine_pids()
        target = workers[1] if victim == "worker" else engine_core

        async def body() -> list[StreamResult]:
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = engine_stub(channel)
                await stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=10)
                results = [StreamResult() for _ in range(4)]
                tasks = [
                    asyncio.create_task(
                        consume(stub, generate_request(f"k{i}", [5, 6, 7 + i], 500), result)
                    )
                    for i, result in enumerate(results)
                ]
                while service.num_requests() < len(results):
                    await asyncio.sleep(0.05)
                killed_at.append(time.monotonic())
                os.kill(target, signal.SIGKILL)
                await asyncio.gather(*tasks)
                return results

        killed_at: list[float] = []
        results = run_async(body, timeout_s=120)
        assert [r.code for r in results] == [grpc.StatusCode.UNAVAILABLE] * len(results)
        # Reported, not asserted (a loaded machine may be slower): the issue asks for 2 s.
        ended = max(r.ended_at or 0.0 for r in results) - killed_at[0]
        print(f"kill -9 of the {victim}: every stream ended UNAVAILABLE {ended:.2f} s later")
        assert service.health() == NOT_SERVING
        assert service.wait_exit(timeout_s=30) != 0
        _wait_gone([*workers, engine_core], timeout_s=30)
    finally:
        service.stop()


def _worker_pids(service: ServiceProcess) -> list[int]:
    """The worker processes under the service (children of its engine-core processes)."""
    pids = []
    for engine_core in service.engine_pids():
        task = Path(f"/proc/{engine_core}/task/{engine_core}/children")
        for child in task.read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"engine_svc.executor.worker_proc" in cmdline:
                pids.append(int(child))
    return sorted(pids)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive:
        alive = [pid for pid in alive if _running(pid)]
        assert time.monotonic() < deadline or not alive, f"still running: {alive}"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _loads(service: ServiceProcess) -> pb.RankLoad:
    with service.channel() as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        (load,) = stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads
    return load


def test_tp4_replicates_the_kv_heads_and_grammar_sampling_stays_exact(tiny_model_dir: Path) -> None:
    """4 ranks for 4 query heads and 2 K/V heads: ranks 0-1 keep K/V head 0, ranks 2-3 head 1.
    A regex-bound request samples after the grammar's bitmask reaches the rank that samples;
    `LLM` takes the same options as the flags."""
    spec = load_model_spec(tiny_model_dir)
    shards = [RankShards.of(spec, ParallelLayout(4, 1, rank, 0)) for rank in range(4)]
    head = spec.head_dim
    assert [s.kv_rows for s in shards] == [(0, head)] * 2 + [(head, 2 * head)] * 2
    assert [s.num_heads for s in shards] == [1, 1, 1, 1]
    prompts = ["Number:", "Hello there", "Answer:"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, regex="[0-9]{3}-[a-z]+"),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, choice=["yes", "no"]),
    ]
    outputs = []
    for tensor_parallel_size in (1, 4):
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=tensor_parallel_size, num_kv_blocks=64)
        try:
            outputs.append([(o.token_ids, o.text) for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    assert outputs[0][2][1] in ("yes", "no")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tensor-parallel-size", "3"), "--tensor-parallel-size: 3 does not divide"),
        (("--pipeline-parallel-size", "3"), "--pipeline-parallel-size: 3 exceeds the model's 2"),
        (("--tensor-parallel-size", "0"), "--tensor-parallel-size: must be >= 1"),
    ],
)
def test_a_layout_the_model_does_not_split_into_is_refused_at_start(
    flags: tuple[str, ...], message: str, tiny_model_dir: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine_svc", "--model", str(tiny_model_dir), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr, done.stderr[-2000:]


def test_two_nodes_on_loopback_give_the_single_workers_tokens(
    single_worker_steps: list[list[Step]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Tensor parallelism over two "machines": node 0 serves and runs rank 0, node 1
    (`--node-rank 1`, workers only) runs rank 1 and takes its calls over TCP. When node 0
    stops, node 1's worker is told to leave and node 1 exits 0."""
    port = three_free_ports()
    layout = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port))
    node1_log = (tmp_path / "node1.log").open("wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "engine_svc", "--model", str(tiny_model_dir), *COMMON_ARGS,
         *layout, "--node-rank", "1"],
        env=service_env(), stdout=node1_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        service = start_service(tiny_model_dir, tmp_path / "node0.log", *COMMON_ARGS, *layout)
        try:
            assert len(_worker_pids(service)) == 1  # the other rank is node 1's
            steps = _generate(service)
        finally:
            service.process.send_signal(signal.SIGTERM)
            service.wait_exit(timeout_s=60)
            service.stop()
        assert node1.wait(timeout=60) == 0
    finally:
        node1.kill()
        node1.wait()
        node1_log.close()
    _assert_same_steps(single_worker_steps, steps, "two nodes")
