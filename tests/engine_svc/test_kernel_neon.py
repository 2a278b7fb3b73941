"""The NEON level of the CPU kernels (engine_svc/kernels/csrc/vec.h) compiled for aarch64
with a cross compiler, so an x86 machine checks that the ARM build still compiles. A file of
its own: `make test`'s workers take a file at a time, and this one runs as long as a level's
tests in test_kernel_levels.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from engine_svc.kernels import build, loader

CROSS_COMPILER = "aarch64-linux-gnu-g++"

# On an ARM machine the native build is the NEON one, loaded and tested by the other files.
pytestmark = pytest.mark.skipif(
    loader.platform.machine() not in ("x86_64", "AMD64"), reason="cross-compiles from x86-64"
)

# Compiled with the sources: fails unless vec.h took its NEON branch, not the generic one.
NEON_PROBE = """
#include "vec.h"
#include <string_view>
static_assert(std::string_view(DUOSERVE_CAPABILITY) == "neon");
static_assert(duoserve::kLanes == 4 && duoserve::kVectorRegisters == 32);
"""


def test_the_neon_code_compiles_for_aarch64(tmp_path: Path) -> None:
    """Compile-only: no aarch64 machine or torch libraries here to link and run it."""
    compiler = shutil.which(CROSS_COMPILER)
    assert compiler, f"{CROSS_COMPILER} is missing: make test installs it (make cross-compiler)"
    probe = tmp_path / "neon_probe.cpp"
    probe.write_text(NEON_PROBE)
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    abi = int(torch.compiled_with_cxx11_abi())
    flags = [*includes, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += ["-std=c++20", "-O2", "-fPIC", "-march=armv8.2-a", "-fopenmp"]
    objects = build.compile_objects([probe, *loader.SOURCES], tmp_path, compiler, flags)
    assert all(path.stat().st_size > 0 for path in objects)
