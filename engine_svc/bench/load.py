"""A workload sent to a streaming API at its arrival times, a record per request (each chunk
timed as it arrives), and the sweep over rates and concurrencies that `serve` (our
frontend's gRPC API) and `openai` (any OpenAI-compatible HTTP server) share. A client
streams one request into its record; the rest is here."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from engine_svc.bench import ceiling, hardware, machine
from engine_svc.bench.hardware import DTYPES
from engine_svc.bench.metrics import RequestRecord, Summary, format_table, summarize
from engine_svc.bench.workload import (
    BenchRequest,
    arrival_gaps,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from shared.errors import InvalidRequestError


class StreamError(Exception):
    """A request the server ended with an error; the message says which."""


class StreamClient(Protocol):
    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        """Send `request`; append each chunk's arrival time and count its tokens in
        `record`, and the usage when the server reports it. StreamError on failure."""

    async def close(self) -> None: ...


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--dataset", choices=["random", "shared-prefix", "jsonl"], default="random")
    add("--dataset-path", type=Path, help="the JSON-lines file (jsonl)")
    add("--num-prompts", type=int, default=64)
    add("--input-len", type=int, default=128)
    add("--range-ratio", type=float, default=0.5,
        help="random prompt lengths in input-len x [1 - r, 1 + r]")  # fmt: skip
    add("--output-len", type=int, default=128)
    add("--num-groups", type=int, default=8, help="shared-prefix: groups")
    add("--prefix-len", type=int, default=960, help="shared-prefix: tokens")
    add("--suffix-len", type=int, default=40, help="shared-prefix: tokens")
    add("--request-rate", default="inf",
        help="requests per second (inf: all at once); a comma list sweeps")  # fmt: skip
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of the arrivals: 1 Poisson, < 1 burstier")  # fmt: skip
    add("--max-concurrency", default="",
        help="at most this many requests in flight; a comma list sweeps")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--num-warmups", type=int, default=0,
        help="the workload's first N requests run once, untimed, at the first run's "
        "concurrency, before the runs (vLLM bench serve's option): a fresh engine's first "
        "batch of that size touches new KV pages and allocator memory")  # fmt: skip
    add("--result-file", type=Path, help="write every figure as JSON here")
    add("--plot", type=Path, help="PNG of throughput against latency")
    add("--no-progress", action="store_true", help="no progress bar")


def check_load_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.request_rates = [float(r) for r in args.request_rate.split(",")]
        args.concurrencies = [int(c) for c in args.max_concurrency.split(",") if c] or [None]
    except ValueError as error:
        parser.error(f"--request-rate / --max-concurrency: {error}")
    if any(not r > 0 for r in args.request_rates):
        parser.error("--request-rate must be > 0 (inf: all at once)")
    if any(c is not None and c < 1 for c in args.concurrencies):
        parser.error("--max-concurrency must be >= 1")
    if args.dataset == "jsonl" and args.dataset_path is None:
        parser.error("--dataset jsonl needs --dataset-path")
    if min(args.num_prompts, args.output_len, args.input_len) < 1:
        parser.error("--num-prompts, --input-len and --output-len must be >= 1")
    if args.num_warmups < 0:
        parser.error("--num-warmups must be >= 0")


def make_requests(args: argparse.Namespace, vocab_size: int | None) -> list[BenchRequest]:
    if args.dataset == "jsonl":
        return jsonl_requests(args.dataset_path, args.output_len, args.num_prompts)
    if vocab_size is None:
        raise InvalidRequestError("dataset", f"{args.dataset} needs --model (its vocabulary)")
    if args.dataset == "shared-prefix":
        per_group = max(1, args.num_prompts // args.num_groups)
        return shared_prefix_requests(
            args.num_groups, per_group, args.prefix_len, args.suffix_len, args.output_len,
            vocab_size, args.seed,
        )  # fmt: skip
    return random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, args.seed
    )


def vocab_size_of(model: str | None) -> int | None:
    if model is None:
        return None
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


async def run_load(
    client: StreamClient,
    requests: list[BenchRequest],
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool,
) -> tuple[list[RequestRecord], float]:
    """Send the requests at their arrival times, at most `max_concurrency` in flight; a
    record per request (its clock starts when it is sent, after waiting for a slot), and
    the run's duration: from its start until every request ended, as vLLM counts it."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)

    async def one(request: BenchRequest) -> RequestRecord:
        async with slots if slots is not None else contextlib.nullcontext():
            record = RequestRecord(sent_at=time.perf_counter())
            try:
                await client.stream(request, record)
            except StreamError as error:
                record.error = str(error)
            bar.update(1)
            return record

    try:
        began = time.perf_counter()
        tasks = []
        gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
        for request, gap in zip(requests, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - began
    finally:
        bar.close()


def measure_ceilings(
    args: argparse.Namespace, device: torch.device | None = None
) -> ceiling.Ceilings | None:
    """The machine, and its ceilings unless --skip-ceilings: before any load, while quiet;
    a CUDA `device`'s where the engine runs on one."""
    device = torch.device("cpu") if device is None else device
    print(hardware.describe(device, DTYPES[args.dtype]))
    if args.skip_ceilings:
        return None
    ceilings = hardware.measure_ceilings(device, DTYPES[args.dtype])
    print(f"ceilings: GEMM {ceilings.flops_per_s / 1e9:.1f} GFLOP/s ({args.dtype}, "
          f"{ceilings.gemm}), memory {ceilings.bytes_per_s / 1e9:.1f} GB/s "
          f"({ceilings.memory})")  # fmt: skip
    return ceilings


def sweep(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    connect: Callable[[int], StreamClient],
    before_run: Callable[[], None],
    ceilings: ceiling.Ceilings | None,
    counters: Callable[[], dict[str, float]] | None = None,
    report: Callable[[Summary], str] | None = None,
) -> list[Summary]:
    """One run per (rate, concurrency), after a warm-up request; each run's figures are
    printed as it ends. `connect(n)` makes a client for n requests in flight at most;
    `counters()`, read before and after each run, adds each counter's growth to the run's
    figures as `delta_<name>`; `report(figures)` adds lines to its table."""

    async def load(rate: float, concurrency: int | None, batch: list[BenchRequest],
                   progress: bool) -> tuple[list[RequestRecord], float]:  # fmt: skip
        client = connect(concurrency or len(batch))
        try:
            return await run_load(client, batch, rate, args.burstiness, concurrency,
                                  args.seed, progress)  # fmt: skip
        finally:
            await client.close()

    warm_up = short_request(requests[0], 4)
    asyncio.run(load(math.inf, None, [warm_up], False))
    if args.num_warmups:
        print(f"warming up: {args.num_warmups} requests at the first run's concurrency, untimed")
        asyncio.run(load(math.inf, args.concurrencies[0], requests[: args.num_warmups], False))
    runs: list[Summary] = []
    for rate, concurrency in itertools.product(args.request_rates, args.concurrencies):
        before_run()
        before = counters() if counters else {}
        records, duration = asyncio.run(load(rate, concurrency, requests, not args.no_progress))
        after = counters() if counters else {}
        # An infinite rate is written "inf": JSON has no infinity.
        shown_rate = rate if math.isfinite(rate) else "inf"
        summary: Summary = {
            "request_rate": shown_rate,
            "burstiness": args.burstiness,
            "max_concurrency": concurrency,
            **summarize(records, duration),
        }
        summary |= {f"delta_{name}": after[name] - before[name] for name in after}
        summary |= _utilization(args, ceilings, summary)
        print(format_table(summary, f"rate {rate} req/s, max concurrency "
                                    f"{concurrency or 'unbounded'}"))  # fmt: skip
        if "mfu" in summary:
            print(f"MFU (total tokens/s): {100 * float(summary['mfu'] or 0):.1f}%   "
                  f"MBU (median TPOT): {100 * float(summary['mbu'] or 0):.1f}%")  # fmt: skip
        if report is not None:
            print(report(summary))
        for message in sorted({r.error for r in records if r.error})[:5]:
            print(f"failed: {message}")
        runs.append(summary)
    return runs


def short_request(request: BenchRequest, output_len: int) -> BenchRequest:
    """A short request of the workload's kind (ids or text): the warm-up."""
    ids = None if request.prompt_token_ids is None else request.prompt_token_ids[:8]
    text = None if request.prompt is None else request.prompt[:32]
    return BenchRequest(ids, text, output_len)


def _utilization(args: argparse.Namespace, ceilings: ceiling.Ceilings | None,
                 summary: Summary) -> Summary:  # fmt: skip
    """MFU of the run's total tokens/s; MBU of its median TPOT (a decode step's weight
    reads per output token: what it means at one request in flight)."""
    tpot_ms, total = summary.get("median_tpot_ms"), summary.get("total_token_throughput")
    if ceilings is None or args.model is None or not tpot_ms or not total:
        return {}
    bytes_per_param = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    figures = ceiling.utilization_figures(
        ceilings, ceiling.count_parameters(args.model), bytes_per_param, float(total),
        float(tpot_ms) / 1000,
    )  # fmt: skip
    return {"mfu": figures["mfu"], "mbu": figures["mbu"]}


def finish(args: argparse.Namespace, result: dict[str, Any], runs: list[Summary]) -> None:
    """The JSON file and the PNG when asked; exit 1 when a request failed."""
    result |= {**machine.identity(), "dataset": args.dataset, "dtype": args.dtype, "runs": runs}
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=2, allow_nan=False))
        print(f"results: {args.result_file}")
    if args.plot is not None:
        from engine_svc.bench.plot import plot_sweep

        plot_sweep(runs, args.plot)
        print(f"plot: {args.plot}")
    if any(run["failed"] for run in runs):
        sys.exit("some requests failed (above)")
