"""`python -m engine_svc.bench gc` on the tiny model: both ways of starting the engine core
run, and the core started as the engine's process starts it leaves nothing for a full
collection to walk but what came after. No figure is checked for speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine_svc.bench.gc_pause import MODES

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gc_mode_starts_the_core_both_ways_and_the_frozen_heap_leaves_little_to_walk(
    tiny_model_dir: Path,
) -> None:
    command = [sys.executable, "-m", "engine_svc.bench", "gc", "--model", str(tiny_model_dir)]
    completed = subprocess.run(
        [*command, "--rounds", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.strip().splitlines()
    assert lines[0].startswith("collector as Python leaves it: start ")
    assert lines[1].startswith("collector as the engine runs it: start ")
    runs = json.loads(lines[-1])
    assert set(runs) == set(MODES) and all(len(runs[mode]) == 1 for mode in MODES)
    python, frozen = runs["python"][0], runs["frozen"][0]
    assert python["frozen_objects"] == 0 and python["tracked_objects"] > 10_000
    assert frozen["frozen_objects"] > 10_000
    assert frozen["tracked_objects"] < python["tracked_objects"] / 100


def test_rounds_below_one_are_refused_naming_the_option() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "engine_svc.bench", "gc", "--model", "x", "--rounds", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2 and "--rounds must be at least 1" in completed.stderr
