"""What Python's garbage collector costs the engine core (shared/gc_heap.py): each round
starts the core in a fresh process twice, alternating, once with the collector as Python
leaves it and once as the engine's process runs it (no collections during start-up, then the
survivors frozen), and times the start (imports and the core's construction, with the
model's load and warm-up) and a full collection after it: the pause a running engine takes
whenever one falls due; and the process's peak resident memory by then (garbage that no
collection frees during start-up stays until the one at its end).

    python -m engine_svc.bench gc --model DIR [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Literal

MODES = ("python", "frozen")
Dtype = Literal["float32", "bfloat16"]
ANSWER_PREFIX = "gc-pause: "


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine_svc.bench gc", description=__doc__)
    parser.add_argument("--model", required=True, help="the model's directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.child is not None:
        print(ANSWER_PREFIX + json.dumps(_start_once(args.child, args.model, args.dtype)))
        return
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else reversed(MODES):
            runs[mode].append(_child(mode, args.model, args.dtype))
    for mode in MODES:
        print(_describe(mode, runs[mode]))
    print(json.dumps(runs))


def _child(mode: str, model: str, dtype: Dtype) -> dict[str, Any]:
    command = [sys.executable, "-m", "engine_svc.bench", "gc", "--child", mode]
    completed = subprocess.run(
        [*command, "--model", model, "--dtype", dtype], capture_output=True, text=True, timeout=600
    )
    answers = [line for line in completed.stdout.splitlines() if line.startswith(ANSWER_PREFIX)]
    if completed.returncode != 0 or not answers:
        raise RuntimeError(
            f"{command} exited {completed.returncode} with no answer: {completed.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(answers[-1][len(ANSWER_PREFIX) :])
    return result


def _start_once(mode: str, model: str, dtype: Dtype) -> dict[str, Any]:
    import contextlib
    import gc

    from shared.gc_heap import startup_heap

    began = time.perf_counter()
    heap = startup_heap("the engine core") if mode == "frozen" else contextlib.nullcontext()
    with heap:
        from engine_svc.config import EngineConfig
        from engine_svc.core.engine_core import EngineCore

        core = EngineCore(EngineConfig(model=model, dtype=dtype))
    start_s = time.perf_counter() - began
    collecting = time.perf_counter()
    gc.collect()
    pause_s = time.perf_counter() - collecting
    result = {
        "start_s": start_s,
        "full_collection_ms": 1000 * pause_s,
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
        # What no collection during start-up costs in memory: the process's peak so far.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    core.shutdown()
    return result


def _describe(mode: str, runs: list[dict[str, Any]]) -> str:
    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    label = "as Python leaves it" if mode == "python" else "as the engine runs it"
    return (
        f"collector {label}: start {median('start_s'):.2f} s, "
        f"then a full collection {median('full_collection_ms'):.1f} ms over "
        f"{median('tracked_objects'):.0f} objects ({median('frozen_objects'):.0f} frozen); "
        f"peak resident memory {median('peak_rss_mb'):.0f} MB; medians of {len(runs)}"
    )
