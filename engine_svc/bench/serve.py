"""Serving benchmark: requests streamed through the frontend's public gRPC API
(frontend.v1.GenerationService), timed as a client sees them.

    python -m engine_svc.bench serve --model DIR [--dataset random|shared-prefix|jsonl]
        [--request-rate R[,R...]] [--burstiness B] [--max-concurrency C[,C...]]
        [--frontend-address HOST:PORT [--engine-address HOST:PORT]]
        [--result-file FILE.json] [--plot FILE.png]

Starts both services on 127.0.0.1 (the engine with `--engine-arg`s), or uses running ones.
Each request asks for `ignore_eos`, so lengths are exact. Several rates or concurrencies
sweep: one run each, the prefix cache emptied between runs (when the engine's address is
known), a PNG of throughput against latency. Prints the machine and its ceilings, then each
run's figures (vLLM `bench serve`'s: request/s, tokens/s, TTFT, TPOT, ITL, E2E), and writes
them all as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch
from tqdm import tqdm

from engine_svc.bench import ceiling, machine
from engine_svc.bench.metrics import RequestRecord, Summary, format_table, summarize
from engine_svc.bench.services import Addresses, started
from engine_svc.bench.workload import (
    BenchRequest,
    arrival_gaps,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from shared.errors import InvalidRequestError
from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc

STREAMS_PER_CHANNEL = 64  # below gRPC's default 100 concurrent streams per connection
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_svc.bench serve", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="model directory: the services', and its vocabulary")
    parser.add_argument("--frontend-address", help="a running frontend (else both are started)")
    parser.add_argument("--engine-address", help="its engine, to empty the prefix cache")
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG",
        help="a flag for the started engine, e.g. --engine-arg=--dtype=bfloat16 (repeat)",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="the started engine's, and the ceilings'")  # fmt: skip
    parser.add_argument("--dataset", choices=["random", "shared-prefix", "jsonl"],
                        default="random")  # fmt: skip
    parser.add_argument("--dataset-path", type=Path, help="the JSON-lines file (jsonl)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="random prompt lengths in input-len x [1 - r, 1 + r]")  # fmt: skip
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups")
    parser.add_argument("--prefix-len", type=int, default=960, help="shared-prefix: tokens")
    parser.add_argument("--suffix-len", type=int, default=40, help="shared-prefix: tokens")
    parser.add_argument(
        "--request-rate", default="inf",
        help="requests per second (inf: all at once); a comma list sweeps",
    )  # fmt: skip
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrivals: 1 Poisson, < 1 burstier")  # fmt: skip
    parser.add_argument(
        "--max-concurrency", default="",
        help="at most this many requests in flight; a comma list sweeps",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, help="write every figure as JSON here")
    parser.add_argument("--plot", type=Path, help="PNG of throughput against latency")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--skip-ceilings", action="store_true",
                        help="do not measure GEMM and copy ceilings (MFU, MBU)")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    try:
        args.request_rates = [float(r) for r in args.request_rate.split(",")]
        args.concurrencies = [int(c) for c in args.max_concurrency.split(",") if c] or [None]
    except ValueError as error:
        parser.error(f"--request-rate / --max-concurrency: {error}")
    if any(not r > 0 for r in args.request_rates):
        parser.error("--request-rate must be > 0 (inf: all at once)")
    if any(c is not None and c < 1 for c in args.concurrencies):
        parser.error("--max-concurrency must be >= 1")
    if args.frontend_address is None and args.model is None:
        parser.error("give --model (the services are started) or --frontend-address")
    if args.dataset == "jsonl" and args.dataset_path is None:
        parser.error("--dataset jsonl needs --dataset-path")
    if args.dataset != "jsonl" and args.model is None:
        parser.error(f"--dataset {args.dataset} needs --model (its vocabulary)")
    if min(args.num_prompts, args.output_len, args.input_len) < 1:
        parser.error("--num-prompts, --input-len and --output-len must be >= 1")
    return args


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "jsonl":
        return jsonl_requests(args.dataset_path, args.output_len, args.num_prompts)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.dataset == "shared-prefix":
        per_group = max(1, args.num_prompts // args.num_groups)
        return shared_prefix_requests(
            args.num_groups, per_group, args.prefix_len, args.suffix_len, args.output_len,
            vocab_size, args.seed,
        )  # fmt: skip
    return random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, args.seed
    )


async def run_load(
    address: str,
    requests: list[BenchRequest],
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool,
) -> list[RequestRecord]:
    """Send the requests at their arrival times, at most `max_concurrency` in flight; a
    record per request (its clock starts when it is sent, after waiting for a slot)."""
    num_channels = math.ceil(min(len(requests), max_concurrency or len(requests))
                             / STREAMS_PER_CHANNEL)  # fmt: skip
    channels = [grpc.aio.insecure_channel(address) for _ in range(num_channels)]
    stubs = [frontend_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)
    try:
        tasks = []
        gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
        for i, (request, gap) in enumerate(zip(requests, gaps, strict=True)):
            if gap > 0:
                await asyncio.sleep(gap)
            stub = stubs[i % len(stubs)]
            tasks.append(asyncio.create_task(_one(stub, request, slots, bar)))
        return list(await asyncio.gather(*tasks))
    finally:
        bar.close()
        for channel in channels:
            await channel.close()


async def _one(
    stub: frontend_pb2_grpc.GenerationServiceStub,
    request: BenchRequest,
    slots: asyncio.Semaphore | None,
    bar: tqdm,
) -> RequestRecord:
    async with slots if slots is not None else contextlib.nullcontext():
        record = RequestRecord(sent_at=time.perf_counter())
        try:
            async for response in stub.GenerateStream(_message(request)):
                now = time.perf_counter()
                tokens = sum(len(choice.token_ids) for choice in response.choices)
                if tokens:
                    record.chunk_times.append(now)
                    record.output_tokens += tokens
                if response.HasField("usage"):
                    record.prompt_tokens = response.usage.prompt_tokens
                    record.cached_tokens = response.usage.cached_tokens
        except grpc.aio.AioRpcError as error:
            record.error = f"{error.code().name}: {error.details()}"
        bar.update(1)
        return record


def _message(request: BenchRequest) -> fpb.GenerateRequest:
    params = fpb.SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
    if request.prompt_token_ids is not None:
        return fpb.GenerateRequest(prompt_token_ids=request.prompt_token_ids,
                                   sampling_params=params)  # fmt: skip
    return fpb.GenerateRequest(prompt=request.prompt, sampling_params=params)


def reset_prefix_cache(engine_address: str | None) -> None:
    if engine_address is None:
        return
    with grpc.insecure_channel(engine_address) as channel:
        stub = engine_pb2_grpc.EngineCoreServiceStub(channel)
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30)


@contextlib.contextmanager
def _services(args: argparse.Namespace) -> Iterator[Addresses]:
    if args.frontend_address is not None:
        yield Addresses(frontend=args.frontend_address, engine=args.engine_address)
        return
    engine_args = [f"--dtype={args.dtype}", *args.engine_arg]
    with tempfile.TemporaryDirectory(prefix="duoserve-bench-serve-") as logs:
        print(f"starting the engine and the frontend on 127.0.0.1 (logs in {logs})")
        began = time.perf_counter()
        with started(args.model, engine_args, Path(logs), args.start_timeout) as addresses:
            print(f"both SERVING after {time.perf_counter() - began:.1f} s")
            yield addresses


def _utilization(args: argparse.Namespace, ceilings: ceiling.Ceilings | None,
                 summary: Summary) -> Summary:  # fmt: skip
    """MFU of the run's total tokens/s; MBU of its median TPOT (a decode step's weight
    reads per output token: what it means at one request in flight)."""
    tpot_ms, total = summary.get("median_tpot_ms"), summary.get("total_token_throughput")
    if ceilings is None or args.model is None or not tpot_ms or not total:
        return {}
    bytes_per_param = torch.tensor([], dtype=_DTYPES[args.dtype]).element_size()
    figures = ceiling.utilization_figures(
        ceilings, ceiling.count_parameters(args.model), bytes_per_param, float(total),
        float(tpot_ms) / 1000,
    )  # fmt: skip
    return {"mfu": figures["mfu"], "mbu": figures["mbu"]}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        requests = make_requests(args)
    except (InvalidRequestError, OSError) as error:
        sys.exit(f"bench serve: {error}")
    print(machine.describe())
    ceilings = None
    if not args.skip_ceilings:  # before the services start: the machine is quiet then
        ceilings = ceiling.measure_ceilings(_DTYPES[args.dtype])
        print(f"ceilings: GEMM {ceilings.flops_per_s / 1e9:.1f} GFLOP/s ({args.dtype}), "
              f"copy {ceilings.bytes_per_s / 1e9:.1f} GB/s (read+write)")  # fmt: skip
    runs: list[Summary] = []
    with _services(args) as addresses:
        warm_up = [BenchRequest([1, 2, 3, 4], None, 4)] if requests[0].prompt is None else [
            BenchRequest(None, "Hello", 4)]  # fmt: skip
        asyncio.run(run_load(addresses.frontend, warm_up, math.inf, 1.0, None, 0, False))
        for rate, concurrency in itertools.product(args.request_rates, args.concurrencies):
            reset_prefix_cache(addresses.engine)
            load = run_load(addresses.frontend, requests, rate, args.burstiness, concurrency,
                            args.seed, not args.no_progress)  # fmt: skip
            records = asyncio.run(load)
            summary: Summary = {"request_rate": rate, "burstiness": args.burstiness,
                                "max_concurrency": concurrency, **summarize(records)}  # fmt: skip
            summary |= _utilization(args, ceilings, summary)
            errors = sorted({r.error for r in records if r.error})
            title = f"rate {rate} req/s, max concurrency {concurrency or 'unbounded'}"
            print(format_table(summary, title))
            if "mfu" in summary:
                print(f"MFU (total tokens/s): {100 * float(summary['mfu'] or 0):.1f}%   "
                      f"MBU (median TPOT): {100 * float(summary['mbu'] or 0):.1f}%")  # fmt: skip
            for message in errors[:5]:
                print(f"failed: {message}")
            runs.append(summary)
    result: dict[str, Any] = {
        "mode": "serve",
        **machine.identity(),
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "dtype": args.dtype,
        "engine_args": args.engine_arg,
        "gemm_gflops": None if ceilings is None else ceilings.flops_per_s / 1e9,
        "copy_gb_s": None if ceilings is None else ceilings.bytes_per_s / 1e9,
        "runs": runs,
    }
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=2))
        print(f"results: {args.result_file}")
    if args.plot is not None:
        from engine_svc.bench.plot import plot_sweep

        plot_sweep(runs, args.plot)
        print(f"plot: {args.plot}")
    if any(run["failed"] for run in runs):
        sys.exit("bench serve: some requests failed (above)")
