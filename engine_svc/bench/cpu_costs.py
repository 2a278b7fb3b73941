"""What each process of a served run costs in CPU time, from counters read before and after
the run: the engine core's CPU time per step (steps: the engine's vllm:iteration_tokens_total
count), and per output token the engine service's gRPC process, the frontend and this
benchmark's own client. On a machine whose cores the model's threads fill, every other
process's CPU time is taken from the model: these figures say where a served run's gap to
offline goes, and what one streamed token costs each process."""

from __future__ import annotations

import os
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from engine_svc.bench.metrics import Summary
from engine_svc.bench.services import Addresses, cpu_seconds, engine_core_pid

STEPS = "vllm:iteration_tokens_total"


class CostCounters:
    """The counters of services this benchmark started (their processes are known)."""

    def __init__(self, addresses: Addresses) -> None:
        if not (addresses.engine_metrics_url and addresses.engine_pid and addresses.frontend_pid):
            raise ValueError("CPU costs need services started by the benchmark")
        self.metrics_url = addresses.engine_metrics_url
        self.engine_pid = addresses.engine_pid
        self.frontend_pid = addresses.frontend_pid
        self.core_pid = engine_core_pid(addresses.engine_pid)

    def __call__(self) -> dict[str, float]:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as response:
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
            "engine_core_cpu_s": cpu_seconds(self.core_pid),
            "engine_service_cpu_s": cpu_seconds(self.engine_pid),
            "frontend_cpu_s": cpu_seconds(self.frontend_pid),
            "bench_client_cpu_s": cpu_seconds(os.getpid()),
        }


def per_step_figures(summary: Summary) -> Summary:
    """From a run's counter deltas: the core's CPU per step, the others' per output token."""
    steps = float(summary.get("delta_steps") or 0)
    tokens = float(summary.get("total_output_tokens") or 0)
    if not steps or not tokens:
        return {}

    def per_token_us(name: str) -> float:
        return 1e6 * float(summary.get(f"delta_{name}_cpu_s") or 0) / tokens

    return {
        "engine_core_cpu_ms_per_step": 1000 * float(summary["delta_engine_core_cpu_s"] or 0)
        / steps,
        "tokens_per_step": float(summary["delta_step_tokens"] or 0) / steps,
        "engine_service_cpu_us_per_token": per_token_us("engine_service"),
        "frontend_cpu_us_per_token": per_token_us("frontend"),
        "bench_client_cpu_us_per_token": per_token_us("bench_client"),
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
        f"{summary['frontend_cpu_us_per_token']:.1f} us, this benchmark's client "
        f"{summary['bench_client_cpu_us_per_token']:.1f} us"
    )
