"""`python -m engine_svc.bench kernels` on the tiny model: each line times the work it names
(the bytes and FLOPs follow from the model's shapes and the workload's options), both sides
of a line computed the same values (the mode checks before timing), and bad options are
refused naming the option. No figure is checked for speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine_svc.bench import machine as bench_machine
from engine_svc.bench.kernel_times import context_lengths, parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_kernels(model_dir: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine_svc.bench", "kernels", "--model", str(model_dir), *options],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_kernels_mode_times_the_work_it_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = tmp_path / "kernels.json"
    options = ["--num-seqs", "3", "--min-context", "5", "--max-context", "40"]
    options += ["--prompt-rows", "50", "--min-prompt", "4", "--max-prompt", "20", "--trials", "2"]
    options += ["--result-file", str(result)]
    # On a CPU with AVX2, held to it (`--isa avx2`), as offline mode's test runs.
    capped = "avx2" in bench_machine.cpu_flags()
    done = run_kernels(tiny_model_dir, *options, *(["--isa", "avx2"] if capped else []))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "machine:" in done.stdout
    if capped:
        level = bench_machine.capped_kernel_level("avx2")
        assert "(capped: avx2)" in done.stdout and f"{level} build (avx2," in done.stdout
    kernels = {kernel["name"]: kernel for kernel in json.loads(result.read_text())}

    config = json.loads((tiny_model_dir / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = hidden // heads, config["intermediate_size"]
    lens = context_lengths(parse_args(["--model", "x", *options]))
    kv_bytes = 2 * sum(lens) * kv_heads * head_dim * 4  # float32
    assert kernels[f"decode attention, {layers} layers from memory"]["bytes"] == kv_bytes * layers
    assert kernels["decode attention, one layer in cache"]["bytes"] == kv_bytes
    weights = layers * (
        hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    )
    for rows in (3, 50):
        projections = kernels[f"projections, {4 * layers} at {rows} rows"]
        assert projections["flops"] == 2 * rows * weights
    assert kernels[f"projections, {4 * layers} at 3 rows"]["bytes"] == weights * 4
    # The prompt kernel serves head_dim 16 where its K/V panel is 16 floats (AVX2), not 64.
    prompt = [name for name in kernels if name.startswith("prompt attention")]
    if prompt:
        assert prompt[0].endswith("of 50 tokens")
    else:
        assert f"does not serve head_dim {head_dim} here; not timed" in done.stdout
    assert len(prompt) == 1 or not capped
    for kernel in kernels.values():
        assert kernel["ours_s"] > 0 and kernel["torch_s"] > 0, kernel


def test_bad_options_name_the_option(tiny_model_dir: Path) -> None:
    done = run_kernels(tiny_model_dir, "--num-seqs", "0")
    assert done.returncode == 2 and "--num-seqs must be at least 1" in done.stderr
    done = run_kernels(tiny_model_dir, "--min-context", "50", "--max-context", "10")
    assert done.returncode == 2 and "--max-context must be at least --min-context" in done.stderr
