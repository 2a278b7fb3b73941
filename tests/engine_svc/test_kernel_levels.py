"""The CPU kernels at every vector level, not only the one this machine loads: one source
compiles to AVX-512, AVX2, plain C++ and NEON (engine_svc/kernels/csrc/vec.h), and each
level this CPU runs passes the kernel tests and the greedy exactness checks in a process
of its own (a process loads one build of the ops). A level this CPU cannot run is built
without being loaded (aarch64's NEON code: test_kernel_neon.py). So CI on an AVX-512
machine covers the AVX2 code, and an AVX2 machine the AVX-512 code's compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.kernels import build, loader

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/engine_svc/test_cpu_kernels.py",
    "tests/engine_svc/test_packed_linear.py",
    "tests/engine_svc/test_row_gemv.py",
    "tests/engine_svc/test_argmax_kernel.py",
    "tests/engine_svc/test_random_sampling.py",
    "tests/engine_svc/test_seeded_sampling.py",
    "tests/engine_svc/test_logprobs_kernel.py",
    "tests/engine_svc/test_degenerate_sampling.py",
    "tests/engine_svc/test_decode_layers.py",
    "tests/engine_svc/test_panel_stealing.py",
]
# Greedy outputs against Hugging Face with the level's kernels: the tiny model (packed
# projections, no vectorized attention at head_dim 16) and the default model (all paths).
EXACTNESS_TESTS = [
    "tests/engine_svc/test_greedy_matches_hf.py::test_tiny_model_greedy_matches_hf[all_at_once-cpu]",
    "tests/engine_svc/test_greedy_matches_hf.py::test_tiny_model_greedy_matches_hf[chunked_prefill-cpu]",
    "tests/engine_svc/test_greedy_matches_hf.py::test_default_model_greedy_matches_hf[all_at_once]",
]
X86_LEVELS = loader.X86_LEVELS

pytestmark = pytest.mark.skipif(
    loader.platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels"
)


def _native_capability() -> str:
    built = loader.loaded_build()
    assert built is not None, "the CPU kernels did not build: see the warning logged"
    return built.capability


def _level_env(level: str) -> dict[str, str]:
    return {**os.environ, loader.ARCH_ENV: level, "PYTHONPATH": str(ROOT)}


def _run_here(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("level", list(X86_LEVELS))
def test_each_level_this_cpu_runs_passes_the_kernel_and_exactness_tests(level: str) -> None:
    capability = X86_LEVELS[level]
    if capability == _native_capability():
        pytest.skip(f"{level} compiles {capability}, the native build's level: tested already")
    missing = sorted(loader._ARCH_REQUIRES.get(level, set()) - loader._cpu_flags())
    if missing:
        pytest.skip(f"this CPU cannot run {level} (lacks {', '.join(missing)}): built only")
    env = _level_env(level)
    probe = _run_here(
        [sys.executable, "-c", "from engine_svc.kernels.loader import loaded_build as b; "
         "print(b().capability)"],
        env,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split()[-1] == capability
    # The plain-C++ level serves no fast path in the engine (loader.FAST_CAPABILITIES): its
    # kernels are checked, the models' outputs with them are not.
    tests = [*KERNEL_TESTS, *(EXACTNESS_TESTS if capability in loader.FAST_CAPABILITIES else [])]
    # Tests of torch's code alone (marked torch_path) ran in this process already: 31 of the
    # x86-64 level's 78 s of tests on an AMD EPYC Zen 3.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
               "not torch_path", *tests]  # fmt: skip
    done = _run_here(command, env)
    assert done.returncode == 0, done.stdout[-6000:]
    assert " failed" not in done.stdout and " passed" in done.stdout


@pytest.mark.parametrize("level", list(X86_LEVELS))
def test_a_level_this_cpu_cannot_run_still_builds(level: str, tmp_path: Path) -> None:
    missing = loader._ARCH_REQUIRES.get(level, set()) - loader._cpu_flags()
    if not missing:
        pytest.skip(f"this CPU runs {level}: its build is loaded and tested")
    library = tmp_path / "kernels.so"
    build.build_library(loader.SOURCES, library, level)
    assert library.stat().st_size > 0


AVX512_FLAGS = frozenset({"avx2", "fma", "bmi2", "avx512f", "avx512bw"})
AVX2_FLAGS = frozenset({"avx2", "fma", "bmi2"})


@pytest.mark.parametrize(
    ("flags", "native", "others"),
    [
        (AVX512_FLAGS, "avx512", ["x86-64-v3", "x86-64"]),
        (AVX512_FLAGS, "avx2", ["x86-64-v4", "x86-64"]),  # DUOSERVE_CPU_ARCH=x86-64-v3
        (AVX2_FLAGS, "avx2", ["x86-64"]),
        (frozenset({"sse4_2"}), "default", []),
    ],
)
def test_make_kernels_builds_the_levels_tested_beside_the_native_one(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], native: str, others: list[str]
) -> None:
    """`make kernels` (python -m engine_svc.kernels --other-levels) builds what
    test_each_level_this_cpu_runs_... loads, so the tests build nothing: every level this
    CPU runs whose vector code is not the native build's."""
    monkeypatch.setattr(loader, "_cpu_flags", lambda: flags)
    assert loader.other_levels(native) == others
    for level in others:
        assert X86_LEVELS[level] != native
