"""Overhead benchmark: the engine with no model (`--null-executor`: each token from a fixed
cycle, at no cost) behind the frontend, so that what is measured is the serving stack's own
cost: scheduling, the busy loop's IPC, gRPC both ways, detokenization, output assembly.

    python -m engine_svc.bench overhead --model DIR [serve's options]

Defaults: 256 prompts of 32 tokens (x [0.5, 1.5]) x 256 new tokens, 64 in flight. Besides
serve's figures, among them what each process spent in CPU time (cpu_costs.py), it prints
the engine core alone, in this process, stepped at the sweep's largest concurrency of
running requests (core_steps.py).
"""

from __future__ import annotations

import sys

from engine_svc.bench import core_steps, load
from engine_svc.bench.cpu_costs import CostCounters, report
from engine_svc.bench.serve import FrontendClient, parse_args, reset_prefix_cache, services
from shared.errors import InvalidRequestError


def main(argv: list[str]) -> None:
    args = parse_args(
        argv, prog="overhead", description=__doc__.splitlines()[0], num_prompts=256,
        input_len=32, output_len=256, max_concurrency="64", skip_ceilings=True,
    )  # fmt: skip
    if args.frontend_address is not None:
        sys.exit("bench overhead: starts its own services (their CPU time is measured)")
    args.engine_arg = ["--null-executor", *args.engine_arg]
    try:
        requests = load.make_requests(args, load.vocab_size_of(args.model))
    except (InvalidRequestError, OSError) as error:
        sys.exit(f"bench overhead: {error}")
    load.measure_ceilings(args)
    with services(args) as addresses:
        runs = load.sweep(
            args,
            requests,
            lambda in_flight: FrontendClient(addresses.frontend, in_flight),
            lambda: reset_prefix_cache(addresses.engine),
            None,
            counters=CostCounters(addresses),
            report=report,
        )
    # The engine core alone at the sweep's largest concurrency: the frontend's pace decides
    # how many run at once above, this measures the core's own cost at that many.
    running = max(min(c or len(requests), len(requests)) for c in args.concurrencies)
    core_ms = core_steps.cpu_ms_per_step(args.model, running)
    print(f"engine core alone (in process, no model): {core_ms:.3f} ms CPU a step "
          f"at {running} running")  # fmt: skip
    load.finish(
        args,
        {"mode": "overhead", "num_prompts": len(requests), "core_running": running,
         "core_cpu_ms_per_step": round(core_ms, 4)},
        runs,
    )  # fmt: skip
