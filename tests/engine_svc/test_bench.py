"""`make bench` end to end on the tiny model: each system a worker process of its own, the
systems alternated round after round, the figures and the exactness count in one JSON line.
Figures are not checked for speed (benchmarks measure speed; tests check that they run and
agree with HF). On a CPU with AVX2 it runs held to AVX2 (`--isa avx2`), as on an AVX2-only
machine. No vLLM build is installed here: a stand-in `vllm` package shows what the vLLM
worker is asked and that its figures and outputs reach the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.bench import machine as bench_machine

REPO_ROOT = Path(__file__).resolve().parents[2]


# vLLM's offline API as the vLLM worker uses it; each call is logged, one JSON line each.
# Its tokens are not the model's: the summary must count 0 of them equal to HF's.
FAKE_VLLM = """
import json, os

class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _RequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]

def _log(**entry):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\\n")

class LLM:
    def __init__(self, **kwargs):
        _log(init=kwargs)

    def reset_prefix_cache(self):
        _log(reset=True)

    def generate(self, requests, params, use_tqdm=True):
        _log(prompts=[r["prompt_token_ids"] for r in requests], params=params.kwargs)
        n = params.kwargs["max_tokens"]
        return [_RequestOutput([(r["prompt_token_ids"][-1] + k) % 7 for k in range(n)])
                for r in requests]
"""


def test_bench_runs_every_system_and_reports_every_figure(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "vllm-calls.jsonl"
    command = [
        sys.executable, "-m", "engine_svc.bench", "--model", str(tiny_model_dir),
        "--num-prompts", "3", "--output-len", "4", "--min-len", "4", "--max-len", "9",
        "--skip-structured", "--rounds", "2", "--vllm-python", sys.executable,
    ]  # fmt: skip
    capped = "avx2" in bench_machine.cpu_flags()
    if capped:
        command += ["--isa", "avx2"]
    environment = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_VLLM_LOG": str(log)}
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_prompts"] == 3 and summary["output_len"] == 4 and summary["rounds"] == 2
    assert summary["outputs_equal_hf"] == 3  # greedy, the same tokens as Hugging Face
    for key in ("ours_tok_s", "hf_tok_s", "throughput_ratio", "latency_ratio", "mfu", "hf_mfu"):
        assert summary[key] > 0, key
    # the baselines' fractions of the same ceilings, and the ratio ours at the ceiling bounds
    assert "HF: MFU of the batch" in done.stdout and "vLLM: MFU of the batch" in done.stdout
    assert "ours/HF with ours at the GEMM ceiling" in done.stdout
    # 4 tokens: on a loaded machine the noise can exceed the decode time after the first
    # token, and then there is no MBU to report (never a negative one).
    assert summary["mbu"] is None or summary["mbu"] > 0
    low, high = summary["throughput_ratio_min"], summary["throughput_ratio_max"]
    assert low <= summary["throughput_ratio"] <= high
    assert "throughput ours/HF" in done.stdout
    assert summary["cpu_model"] == bench_machine.cpu_model()
    assert f"machine: {bench_machine.cpu_model()}" in done.stdout
    if capped:  # every system ran held to AVX2: torch, and our kernels' build
        assert "(capped: avx2)" in done.stdout
        assert summary["kernel_level"] == f"{bench_machine.capped_kernel_level('avx2')} (avx2)"
    calls = [json.loads(line) for line in log.open()]
    _check_the_vllm_system(summary, done.stdout, calls, tiny_model_dir)


def _check_the_vllm_system(summary: dict, stdout: str, calls: list[dict], model: Path) -> None:
    init = {"model": str(model), "dtype": "float32", "seed": 0, "gpu_memory_utilization": 0.45}
    assert calls[0] == {"init": init}
    generations = [call for call in calls if "prompts" in call]
    # warm-up; per round the batch then the single request; then 3 times to one token
    assert [len(call["prompts"]) for call in generations] == [1, 3, 1, 3, 1, 1, 1, 1]
    batches = [call["prompts"] for call in generations if len(call["prompts"]) == 3]
    assert batches[0] == batches[1] and all(4 <= len(p) <= 9 for p in batches[0])
    assert sum(len(p) for p in batches[0]) == summary["prompt_tokens"]
    assert [call["params"]["max_tokens"] for call in generations] == [4, 4, 4, 4, 4, 1, 1, 1]
    assert all(call["params"]["temperature"] == 0 and call["params"]["ignore_eos"]
               for call in generations)  # fmt: skip
    # every run starts with an empty prefix cache, as ours does
    assert all("reset" in calls[i - 1] for i, call in enumerate(calls) if "prompts" in call)
    for key in ("vllm_tok_s", "vllm_throughput_ratio", "vllm_latency_ratio", "ours_over_vllm"):
        assert summary[key] > 0, key
    assert summary["vllm_outputs_equal_hf"] == 0
    assert "throughput vLLM/HF:" in stdout and "throughput ours/vLLM:" in stdout


def test_bench_serve_sweeps_through_the_started_services(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`bench serve` starts both services, streams the shared-prefix workload through the
    frontend at two concurrencies, and reports every figure: exact token counts, the prefix
    cache emptied between runs and hit within one, a JSON file and a PNG."""
    result, plot = tmp_path / "result.json", tmp_path / "sweep.png"
    command = [
        sys.executable, "-m", "engine_svc.bench", "serve", "--model", str(tiny_model_dir),
        "--dataset", "shared-prefix", "--num-groups", "2", "--num-prompts", "6",
        "--prefix-len", "32", "--suffix-len", "8", "--output-len", "5",
        "--max-concurrency", "6,1", "--engine-arg=--num-kv-blocks=256", "--skip-ceilings",
        "--no-progress", "--result-file", str(result), "--plot", str(plot), "--num-warmups", "3",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary["mode"] == "serve" and summary["cpu_model"] == bench_machine.cpu_model()
    concurrent, sequential = summary["runs"]
    assert (concurrent["max_concurrency"], sequential["max_concurrency"]) == (6, 1)
    for run in (sequential, concurrent):
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 6 * 5 and run["total_input_tokens"] == 6 * 40
        assert 0 < run["median_ttft_ms"] <= run["median_e2el_ms"]
        assert run["output_throughput"] > 0
        # The frontend merges outputs that queued while a stream was busy, so a quick engine
        # may answer every request in one chunk (timing): ITL then has no gap to measure, and
        # TPOT ((E2E - TTFT) / 4, the first chunk's time being the last's) is 0. Neither is
        # positive as a fact; TPOT is defined (5 tokens) and within the request's E2E.
        assert 0 <= run["mean_tpot_ms"] < run["mean_e2el_ms"]
        assert run["mean_itl_ms"] is None or run["mean_itl_ms"] > 0
        # What each process spent, from counters read around the run: the engine counted
        # every prompt token it computed (not those the prefix cache held) and every output
        # token in its steps. CPU time is read in clock ticks, which a run this short may
        # not advance: each process's figure is there, never negative.
        computed = run["total_input_tokens"] - run["cached_input_tokens"]
        assert run["delta_step_tokens"] == computed + run["total_output_tokens"]
        assert run["engine_core_cpu_ms_per_step"] >= 0
        for process in ("engine_service", "frontend", "bench_client"):
            assert run[f"{process}_cpu_us_per_token"] >= 0
    assert done.stdout.count("CPU per output token: engine service (gRPC)") == 2
    # One at a time, each group's later requests find its two 16-token prefix blocks cached
    # (2 groups x 2 later requests x 32 tokens), its first does not: the cache was emptied
    # after the concurrent run, which had cached both prefixes.
    assert sequential["cached_input_tokens"] == 2 * 2 * 32
    # The warm-up's requests ran before the first run and were counted in none.
    assert "warming up: 3 requests at the first run's concurrency, untimed" in done.stdout
    assert "Successful requests:" in done.stdout and f"machine: {bench_machine.cpu_model()}" in (
        done.stdout
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_overhead_runs_the_stack_without_a_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`bench overhead`: the engine with --null-executor behind the frontend. Every request
    streams to its length, and the engine's own step counter accounts for every token:
    vllm:iteration_tokens_total counts a step's prompt tokens and the tokens it generated."""
    result = tmp_path / "result.json"
    command = [
        sys.executable, "-m", "engine_svc.bench", "overhead", "--model", str(tiny_model_dir),
        "--num-prompts", "8", "--input-len", "12", "--output-len", "16",
        "--max-concurrency", "4", "--engine-arg=--num-kv-blocks=256", "--no-progress",
        "--result-file", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = json.loads(result.read_text())["runs"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (8, 0, 8 * 16)
    assert run["delta_step_tokens"] == run["total_input_tokens"] + run["total_output_tokens"]
    assert run["delta_steps"] >= 16
    assert run["engine_core_cpu_ms_per_step"] >= 0 and run["frontend_cpu_us_per_token"] >= 0
    assert run["bench_client_cpu_us_per_token"] >= 0
    assert "engine core CPU per step:" in done.stdout
    # The core alone, stepped in process with every request of the sweep's concurrency.
    summary = json.loads(result.read_text())
    assert summary["core_running"] == 4 and summary["core_cpu_ms_per_step"] > 0
    assert "ms CPU a step at 4 running" in done.stdout


def test_bench_serve_against_offline_runs_the_offline_batch_after_each_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`bench serve --against-offline`: after each serve run, the offline API runs the same
    token ids in its own process; each run has both throughputs and their ratio, and the
    summary their median within the runs' range."""
    result = tmp_path / "result.json"
    command = [
        sys.executable, "-m", "engine_svc.bench", "serve", "--model", str(tiny_model_dir),
        "--num-prompts", "4", "--input-len", "12", "--output-len", "6",
        "--max-concurrency", "4,4", "--against-offline", "--engine-arg=--num-kv-blocks=256",
        "--skip-ceilings", "--no-progress", "--result-file", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert len(summary["runs"]) == 2
    for run in summary["runs"]:
        assert (run["completed"], run["total_output_tokens"]) == (4, 4 * 6)
        assert run["offline_output_throughput"] > 0
        ratio = run["output_throughput"] / run["offline_output_throughput"]
        assert run["serve_over_offline"] == ratio
    ratios = [run["serve_over_offline"] for run in summary["runs"]]
    assert summary["serve_over_offline_min"] == min(ratios)
    assert summary["serve_over_offline"] == sum(ratios) / 2  # the median of two
    assert done.stdout.count("offline (LLM.generate, the same token ids") == 2
    assert "serve/offline output tokens/s:" in done.stdout


def test_against_offline_refuses_text_prompts_before_starting_anything(tmp_path: Path) -> None:
    from engine_svc.bench.offline_baseline import OfflineBaseline
    from engine_svc.bench.workload import BenchRequest
    from shared.errors import InvalidRequestError

    text = [BenchRequest(None, "Hello", 4)]
    with pytest.raises(InvalidRequestError, match="against_offline"):
        OfflineBaseline("unused", "float32", text, tmp_path)
    uneven = [BenchRequest([1, 2], None, 4), BenchRequest([3], None, 5)]
    with pytest.raises(InvalidRequestError, match="one output length"):
        OfflineBaseline("unused", "float32", uneven, tmp_path)
    assert not list(tmp_path.iterdir())


def test_bench_prefix_finds_the_shared_prefix_in_whole_blocks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`bench prefix`: each pair's second prompt shares 36 tokens with its first; the engine
    serves the two whole 16-token blocks of them (32) from its cache, in every pair (the
    cache is emptied before each)."""
    result = tmp_path / "result.json"
    command = [
        sys.executable, "-m", "engine_svc.bench", "prefix", "--model", str(tiny_model_dir),
        "--input-len", "48", "--prefix-len", "36", "--pairs", "2",
        "--engine-arg=--num-kv-blocks=256", "--result-file", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(result.read_text())
    assert figures["mode"] == "prefix" and figures["pairs"] == 2
    assert (figures["cached_tokens_min"], figures["cached_tokens_max"]) == (32, 32)
    assert figures["median_uncached_ttft_ms"] > 0 and figures["median_cached_ttft_ms"] > 0
    low, high = figures["cached_over_uncached_min"], figures["cached_over_uncached_max"]
    assert 0 < low <= figures["cached_over_uncached"] <= high
    assert "prompt tokens from the prefix cache: 32-32 of 36 shared" in done.stdout
