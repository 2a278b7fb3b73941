"""`python -m engine_svc.bench steps` on the tiny model: the steps it counts follow from the
workload (one prompt step, then one decode step per new token after the first), the parts
it times lie within the steps, and the runner gets its own methods back. On a CPU with AVX2
it runs held to AVX2 (`--isa avx2`). No figure is checked for speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.bench import machine as bench_machine
from engine_svc.bench import step_times
from engine_svc.bench.step_times import DECODE_PARTS, StepTimes, is_decode_step, timed_runner

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_step_is_a_decode_step_when_every_request_takes_one_token() -> None:
    class Step:
        def __init__(self, *lengths: int) -> None:
            self.scheduled = [type("Scheduled", (), {"token_ids": [0] * n})() for n in lengths]

    assert is_decode_step(Step(1, 1, 1))  # type: ignore[arg-type]
    assert not is_decode_step(Step(1, 5, 1))  # type: ignore[arg-type]


def test_the_runner_gets_its_methods_back() -> None:
    class Model:
        def forward(self) -> str:
            return "forward"

        def compute_logits(self) -> str:
            return "logits"

    class Runner:
        def __init__(self) -> None:
            self.model = Model()

        def execute_model(self, scheduler_output: object) -> str:
            return "executed"

        def sample_tokens(self) -> str:
            return "sampled"

    runner = Runner()
    with timed_runner(runner, StepTimes()):
        assert "execute_model" in vars(runner) and "forward" in vars(runner.model)
    assert "execute_model" not in vars(runner) and "sample_tokens" not in vars(runner)
    assert "forward" not in vars(runner.model) and "compute_logits" not in vars(runner.model)
    assert runner.execute_model(None) == "executed" and runner.model.forward() == "forward"


def test_steps_mode_counts_the_workloads_steps_and_times_their_parts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    result = tmp_path / "steps.json"
    output_len = 5
    command = [sys.executable, "-m", "engine_svc.bench", "steps", "--model", str(tiny_model_dir)]
    command += ["--num-prompts", "3", "--min-len", "4", "--max-len", "12", "--rounds", "2"]
    command += ["--output-len", str(output_len), "--result-file", str(result)]
    # On a CPU with AVX2, held to it (`--isa avx2`), as offline mode's test runs.
    capped = "avx2" in bench_machine.cpu_flags()
    if capped:
        command += ["--isa", "avx2"]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "machine:" in done.stdout and "round 2: batch" in done.stdout
    if capped:
        level = bench_machine.capped_kernel_level("avx2")
        assert "(capped: avx2)" in done.stdout and f"{level} build (avx2," in done.stdout
    rounds = json.loads(result.read_text())
    assert len(rounds) == 2
    for times in rounds:
        # Three short prompts fit one step; each then decodes its other tokens together.
        assert times["prompt_steps"] == 1
        assert times["decode_steps"] == output_len - 1
        parts = times["decode_parts_s"]
        assert set(parts) == set(DECODE_PARTS)
        assert all(seconds > 0 for seconds in parts.values())
        assert sum(parts.values()) <= times["decode_s"]
        assert times["prompt_s"] + times["decode_s"] <= times["batch_s"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--temperature", "0.8", "--top-p", "0"], "top_p: must be in (0, 1]"),
    ],
)
def test_bad_arguments_name_the_option(arguments: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine_svc.bench", "steps", "--model", "x", *arguments],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr


def test_sampling_options_make_every_request_sample() -> None:
    greedy = step_times.parse_args(["--model", "x"])
    assert step_times.sampling_params(greedy, max_tokens=4).is_greedy
    args = step_times.parse_args(
        ["--model", "x", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40"]
    )
    params = step_times.sampling_params(args, max_tokens=4)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.8, 0.9, 40, 0.0)
    assert params.seed is None and params.ignore_eos and params.max_tokens == 4
