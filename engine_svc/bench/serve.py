"""Serving benchmark: requests streamed through the frontend's public gRPC API
(frontend.v1.GenerationService), timed as a client sees them.

    python -m engine_svc.bench serve --model DIR [--dataset random|shared-prefix|jsonl]
        [--request-rate R[,R...]] [--burstiness B] [--max-concurrency C[,C...]]
        [--frontend-address HOST:PORT [--engine-address HOST:PORT]]
        [--result-file FILE.json] [--plot FILE.png] [--against-offline]

Starts both services on 127.0.0.1 (the engine with `--engine-arg`s), or uses running ones.
Each request asks for `ignore_eos`, so lengths are exact. Several rates or concurrencies
sweep: one run each, the prefix cache emptied between runs (when the engine's address is
known), a PNG of throughput against latency. Prints the machine and its ceilings, then each
run's figures (vLLM `bench serve`'s: request/s, tokens/s, TTFT, TPOT, ITL, E2E), and writes
them all as JSON. Where it started the services, each run also prints what each process
spent in CPU time (cpu_costs.py). `--against-offline` runs the same token ids through our
offline API after each run (offline_baseline.py) and prints serve/offline.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from engine_svc.bench import cpu_costs
from engine_svc.bench.hardware import DTYPES
from engine_svc.bench.load import (
    StreamError,
    add_load_arguments,
    check_load_arguments,
    finish,
    make_requests,
    measure_ceilings,
    sweep,
    vocab_size_of,
)
from engine_svc.bench.metrics import RequestRecord
from engine_svc.bench.offline import ALONE_SHARE, SHARED_SHARE
from engine_svc.bench.offline_baseline import OfflineBaseline, overall
from engine_svc.bench.services import Addresses, started, wait_kv_cache_faulted_in
from engine_svc.bench.workload import BenchRequest
from engine_svc.worker.model_runner import resolve_device
from shared.errors import InvalidRequestError
from shared.frontend_protos import frontend_pb2 as fpb
from shared.frontend_protos import frontend_pb2_grpc
from shared.protos import engine_pb2 as pb
from shared.protos import engine_pb2_grpc

STREAMS_PER_CHANNEL = 64  # below gRPC's default 100 concurrent streams per connection
# With --against-offline on one CUDA device, the served engine and the offline worker each
# take offline mode's SHARED_SHARE of its memory (the default 0.9 each would not fit both),
# the two together at most ALONE_SHARE, what one engine takes alone.
MIN_OFFLINE_SHARE = 0.05


def parse_args(
    argv: list[str], prog: str = "serve", description: str | None = None, **defaults: Any
) -> argparse.Namespace:
    """serve's options (`defaults` replacing some defaults, for modes built on it)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m engine_svc.bench {prog}",
        description=description or __doc__.splitlines()[0],
    )
    add = parser.add_argument
    add("--model", help="model directory: the started services', and its vocabulary")
    add("--frontend-address", help="a running frontend (else both services are started)")
    add("--engine-address", help="its engine, to empty the prefix cache between runs")
    add("--engine-arg", action="append", default=[], metavar="ARG",
        help="a flag for the started engine: --engine-arg=--max-num-seqs=128 (repeat)")  # fmt: skip
    add("--dtype", choices=sorted(DTYPES), default="float32",
        help="the started engine's, and the ceilings'")  # fmt: skip
    add("--skip-ceilings", action="store_true", help="no GEMM and copy ceilings (MFU, MBU)")
    add("--start-timeout", type=float, default=600.0)
    if prog == "serve":
        add("--against-offline", action="store_true",
            help="after each run, the same token ids through our offline API in a process of "
            "its own, with the engine's defaults (not --engine-arg): serve/offline (give one "
            "concurrency several times to alternate)")  # fmt: skip
    add_load_arguments(parser)
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    check_load_arguments(parser, args)
    if args.frontend_address is None and args.model is None:
        parser.error("give --model (the services are started) or --frontend-address")
    if getattr(args, "against_offline", False) and args.model is None:
        parser.error("--against-offline runs the offline API on --model: give it")
    if getattr(args, "against_offline", False):
        capped = [c for c in args.concurrencies if c is not None and c < args.num_prompts]
        if capped:
            # Where a step's cost hardly grows with its rows (a GPU launching kernels one by
            # one), 256 at once against 64 in flight measured 0.18x-0.32x: not serving's cost.
            print(f"note: the offline batch runs all {args.num_prompts} prompts at once, the "
                  f"served runs at most {max(capped)} in flight; give --num-prompts "
                  f"{max(capped)} to compare like with like")  # fmt: skip
    return args


class FrontendClient:
    """Streams through frontend.v1.GenerationService, over enough channels that none
    carries more than STREAMS_PER_CHANNEL streams."""

    def __init__(self, address: str, max_in_flight: int) -> None:
        count = math.ceil(max_in_flight / STREAMS_PER_CHANNEL)
        self._channels = [grpc.aio.insecure_channel(address) for _ in range(count)]
        self._stubs = [frontend_pb2_grpc.GenerationServiceStub(c) for c in self._channels]
        self._next = 0

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        self._next += 1
        stub = self._stubs[self._next % len(self._stubs)]
        try:
            async for response in stub.GenerateStream(request_message(request)):
                now = time.perf_counter()
                tokens = sum(len(choice.token_ids) for choice in response.choices)
                if tokens:
                    record.chunk_times.append(now)
                    record.output_tokens += tokens
                if response.HasField("usage"):
                    record.prompt_tokens = response.usage.prompt_tokens
                    record.cached_tokens = response.usage.cached_tokens
        except grpc.aio.AioRpcError as error:
            raise StreamError(f"{error.code().name}: {error.details()}") from error

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def request_message(request: BenchRequest) -> fpb.GenerateRequest:
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
def services(args: argparse.Namespace) -> Iterator[Addresses]:
    """Those at --frontend-address, or both started with the engine's --engine-args."""
    if args.frontend_address is not None:
        yield Addresses(frontend=args.frontend_address, engine=args.engine_address)
        return
    engine_args = [f"--dtype={args.dtype}", *args.engine_arg]
    with tempfile.TemporaryDirectory(prefix="duoserve-bench-serve-") as logs:
        print(f"starting the engine and the frontend on 127.0.0.1 (logs in {logs})")
        began = time.perf_counter()
        with started(args.model, engine_args, Path(logs), args.start_timeout) as addresses:
            print(f"both SERVING after {time.perf_counter() - began:.1f} s")
            wait_kv_cache_faulted_in(Path(logs) / "engine.log", args.start_timeout)
            yield addresses


def _engine_flag(args: argparse.Namespace, flag: str) -> str | None:
    """A flag's value among the --engine-arg items: `--flag=value`, or `--flag` then `value`."""
    items = args.engine_arg
    for i, item in enumerate(items):
        if item.startswith(flag + "="):
            return str(item.split("=", 1)[1])
        if item == flag and i + 1 < len(items):
            return str(items[i + 1])
    return None


def _engine_device(args: argparse.Namespace) -> torch.device:
    """The started engine's device (its --device, else CUDA where torch sees one)."""
    return resolve_device(_engine_flag(args, "--device") or "auto")


def _offline_memory_share(
    args: argparse.Namespace, device: torch.device | None = None
) -> float | None:
    """The offline worker's share of a CUDA device it shares with the served engine (None on
    CPU, where the host's budget applies). The engine started here gets the same share unless
    --engine-arg sets one; the worker then takes what is left below ALONE_SHARE. `device`:
    the engine's, when already resolved."""
    if (device or _engine_device(args)).type != "cuda":
        return None
    given = _engine_flag(args, "--gpu-memory-utilization")
    if given is None:
        if args.frontend_address is None:
            args.engine_arg.append(f"--gpu-memory-utilization={SHARED_SHARE}")
        return SHARED_SHARE
    share = min(SHARED_SHARE, ALONE_SHARE - float(given))
    if share < MIN_OFFLINE_SHARE:
        raise InvalidRequestError(
            "engine_arg",
            f"--gpu-memory-utilization={given} leaves the offline worker under "
            f"{MIN_OFFLINE_SHARE} of the GPU beside it (--against-offline)",
        )
    return share


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        requests = make_requests(args, vocab_size_of(args.model))
    except (InvalidRequestError, OSError) as error:
        sys.exit(f"bench serve: {error}")
    engine_device = _engine_device(args)
    # Before the services start, while the machine is quiet; the engine's device's.
    ceilings = measure_ceilings(args, None if args.frontend_address else engine_device)
    with contextlib.ExitStack() as stack:
        baseline = None
        if args.against_offline:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            try:
                share = _offline_memory_share(args, engine_device)
                baseline = OfflineBaseline(
                    args.model, args.dtype, requests, folder, str(engine_device), share
                )
            except InvalidRequestError as error:
                sys.exit(f"bench serve: {error}")
            stack.callback(baseline.close)
        addresses = stack.enter_context(services(args))
        # Services started here: what each process spent, per step and per output token.
        counters = None if addresses.engine_pid is None else cpu_costs.CostCounters(addresses)
        reports = [cpu_costs.report] if counters else []
        reports += [baseline.report] if baseline else []
        runs = sweep(
            args,
            requests,
            lambda in_flight: FrontendClient(addresses.frontend, in_flight),
            lambda: reset_prefix_cache(addresses.engine),
            ceilings,
            counters=counters,
            report=(lambda summary: "\n".join(r(summary) for r in reports)) if reports else None,
        )
    result = {"mode": "serve", "num_prompts": len(requests), "engine_args": args.engine_arg}
    if baseline is not None:
        figures = overall(runs)
        result |= figures
        if figures:
            print(f"serve/offline output tokens/s: {figures['serve_over_offline']:.2f}x "
                  f"(median of {len(runs)} runs; {figures['serve_over_offline_min']:.2f}x-"
                  f"{figures['serve_over_offline_max']:.2f}x)")  # fmt: skip
    finish(args, result, runs)
