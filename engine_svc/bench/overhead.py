"""Overhead benchmark: the engine with no model (`--null-executor`: each token from a fixed
cycle, at no cost) behind the frontend, so that what is measured is the serving stack's own
cost: scheduling, the busy loop's IPC, gRPC both ways, detokenization, output assembly.

    python -m engine_svc.bench overhead --model DIR [serve's options]

Defaults: 256 prompts of 32 tokens (x [0.5, 1.5]) x 256 new tokens, 64 in flight. Besides
serve's figures it prints, from counters read before and after each run, the engine-core
process's CPU time per step (steps: the engine's vllm:iteration_tokens_total count) and the
CPU time per output token of the engine service's gRPC process and of the frontend; then
the engine core alone, in this process, stepped at the sweep's largest concurrency of
running requests (core_steps.py).
"""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from engine_svc.bench import core_steps, load
from engine_svc.bench.metrics import Summary
from engine_svc.bench.serve import FrontendClient, parse_args, reset_prefix_cache, services
from engine_svc.bench.services import Addresses, cpu_seconds, engine_core_pid
from shared.errors import InvalidRequestError

STEPS = "vllm:iteration_tokens_total"


def counters(addresses: Addresses, core_pid: int) -> dict[str, float]:
    assert addresses.engine_metrics_url and addresses.engine_pid and addresses.frontend_pid
    with urllib.request.urlopen(addresses.engine_metrics_url, timeout=30) as response:
        text = response.read().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in (f"{STEPS}_count", f"{STEPS}_sum")
    }
    return {
        "steps": samples.get(f"{STEPS}_count", 0.0),
        "step_tokens": samples.get(f"{STEPS}_sum", 0.0),
        "engine_core_cpu_s": cpu_seconds(core_pid),
        "engine_service_cpu_s": cpu_seconds(addresses.engine_pid),
        "frontend_cpu_s": cpu_seconds(addresses.frontend_pid),
    }


def per_step_figures(summary: Summary) -> Summary:
    steps = float(summary.get("delta_steps") or 0)
    tokens = float(summary.get("total_output_tokens") or 0)
    if not steps or not tokens:
        return {}
    return {
        "engine_core_cpu_ms_per_step": 1000 * float(summary["delta_engine_core_cpu_s"] or 0)
        / steps,
        "tokens_per_step": float(summary["delta_step_tokens"] or 0) / steps,
        "engine_service_cpu_us_per_token": 1e6 * float(summary["delta_engine_service_cpu_s"]
                                                       or 0) / tokens,
        "frontend_cpu_us_per_token": 1e6 * float(summary["delta_frontend_cpu_s"] or 0) / tokens,
    }  # fmt: skip


def report(summary: Summary) -> str:
    """Adds the per-step and per-token figures to the run's, and returns them as lines."""
    summary |= per_step_figures(summary)
    if "engine_core_cpu_ms_per_step" not in summary:
        return "no steps counted"
    return (
        f"engine core CPU per step: {summary['engine_core_cpu_ms_per_step']:.3f} ms "
        f"({summary['tokens_per_step']:.1f} tokens a step)\n"
        f"CPU per output token: engine service (gRPC) "
        f"{summary['engine_service_cpu_us_per_token']:.1f} us, frontend "
        f"{summary['frontend_cpu_us_per_token']:.1f} us"
    )


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
        assert addresses.engine_pid is not None
        core_pid = engine_core_pid(addresses.engine_pid)
        runs = load.sweep(
            args,
            requests,
            lambda in_flight: FrontendClient(addresses.frontend, in_flight),
            lambda: reset_prefix_cache(addresses.engine),
            None,
            counters=lambda: counters(addresses, core_pid),
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
