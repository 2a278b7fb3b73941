"""Compile the kernels' C++ sources into one shared library against the installed torch,
without loading it: an image build makes libraries for CPU levels its own CPU may lack
(x86-64-v4 on an AVX2 builder), and loading one of those there could fault. The commands are
the ones torch.utils.cpp_extension writes (its public include and library paths); the
sources include only ATen and torch/library.h, so neither Python's headers nor pybind11."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

COMPILE_TIMEOUT_S = 900.0


class KernelBuildError(RuntimeError):
    """The compiler is missing or refused the sources; the message holds its last words."""


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def compile_flags(arch: str) -> list[str]:
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    return [
        *includes,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-fPIC",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-std=c++20",
        "-O3",
        f"-march={arch}",
        "-fopenmp",
    ]


def link_flags() -> list[str]:
    paths = [f"-L{path}" for path in cpp_extension.library_paths()]
    return ["-shared", "-fopenmp", *paths, "-lc10", "-ltorch_cpu", "-ltorch"]


def build_library(sources: Sequence[Path], library: Path, arch: str) -> None:
    """Make `library` from `sources` for `-march=arch` unless it exists. Builders of one
    library wait on a lock beside it, and it appears whole (renamed into place), so a process
    that finds it can load it."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with _locked(library.with_suffix(".lock")):
        if library.exists():
            return
        with tempfile.TemporaryDirectory(dir=library.parent, prefix="build-") as scratch:
            objects = _compile_all(sources, Path(scratch), arch)
            partial = Path(scratch) / library.name
            _run([compiler(), *map(str, objects), *link_flags(), "-o", str(partial)])
            os.replace(partial, library)


def _compile_all(sources: Sequence[Path], scratch: Path, arch: str) -> list[Path]:
    """Every source at once, one compiler process each (a handful of sources)."""
    objects = [scratch / f"{source.stem}.o" for source in sources]
    flags = compile_flags(arch)
    try:
        processes = [
            (
                source,
                subprocess.Popen(
                    [compiler(), *flags, "-c", str(source), "-o", str(target)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                ),
            )
            for source, target in zip(sources, objects, strict=True)
        ]
    except FileNotFoundError as error:
        raise KernelBuildError(f"no compiler: {error}") from error
    failures = []
    for source, process in processes:
        output, _ = process.communicate(timeout=COMPILE_TIMEOUT_S)
        if process.returncode != 0:
            failures.append(f"{source.name}:\n{output.decode(errors='replace')[-3000:]}")
    if failures:
        raise KernelBuildError("compiling the CPU kernels failed: " + "\n".join(failures))
    return objects


def _run(command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except FileNotFoundError as error:
        raise KernelBuildError(f"no compiler: {error}") from error
    if done.returncode != 0:
        raise KernelBuildError(f"linking the CPU kernels failed:\n{done.stderr[-3000:]}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
