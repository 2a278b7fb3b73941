"""Serving against offline, alternated (`python -m engine_svc.bench serve --against-offline`):
after each serve run, our engine's offline API (`LLM.generate`, in a worker process of its
own, worker.py) runs the same token ids to the same lengths. The machine's speed drifts
within minutes, so each run's serve/offline ratio compares the two under the same
conditions, and the figure is their median."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from engine_svc.bench.metrics import Summary
from engine_svc.bench.worker import Worker, write_workload
from engine_svc.bench.workload import BenchRequest
from shared.errors import InvalidRequestError


class OfflineBaseline:
    """The offline worker, started on the workload's token ids (written under `folder`)."""

    def __init__(
        self,
        model: str,
        dtype: str,
        requests: list[BenchRequest],
        folder: Path,
        device: str = "auto",
        gpu_memory_utilization: float | None = None,
    ):
        prompts = [r.prompt_token_ids for r in requests]
        lengths = {r.output_len for r in requests}
        if any(p is None for p in prompts) or len(lengths) != 1:
            raise InvalidRequestError(
                "against_offline",
                "needs token-id prompts of one output length (the random or shared-prefix dataset)",
            )
        ids = [p for p in prompts if p is not None]
        (output_len,) = lengths
        path = folder / "offline-workload.json"
        write_workload(path, ids, ids[0], output_len)
        self.output_tokens = len(ids) * output_len
        command = [sys.executable, "-m", "engine_svc.bench", "offline", "--model", model,
                   "--dtype", dtype, "--device", device, "--system", "ours",
                   "--workload-file", str(path)]  # fmt: skip
        if gpu_memory_utilization is not None:
            command.append(f"--gpu-memory-utilization={gpu_memory_utilization}")
        self.worker = Worker(command)
        # One batch untimed, before the services start: a first batch runs slower (its KV
        # pages and allocator arenas are new), which in runs of 3 rounds made the first
        # serve/offline ratio the highest every time (0.89x against 0.75x-0.80x).
        self.worker.ask("batch")

    def report(self, summary: Summary) -> str:
        """Runs the offline batch now, right after the serve run `summary` describes; adds
        its output tokens/s and serve/offline to the run's figures, and returns them."""
        offline = self.output_tokens / self.worker.ask("batch")["seconds"]
        served = summary.get("output_throughput")
        ratio = float(served) / offline if served else None
        summary |= {"offline_output_throughput": offline, "serve_over_offline": ratio}
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        return (
            f"offline (LLM.generate, the same token ids, right after): {offline:.1f} output "
            f"tokens/s; serve/offline {shown}"
        )

    def close(self) -> None:
        self.worker.close()


def overall(runs: list[Summary]) -> Summary:
    """The runs' serve/offline ratios: median, lowest and highest."""
    ratios = [float(r) for run in runs if (r := run.get("serve_over_offline")) is not None]
    if not ratios:
        return {}
    return {
        "serve_over_offline": float(np.median(ratios)),
        "serve_over_offline_min": min(ratios),
        "serve_over_offline_max": max(ratios),
    }
