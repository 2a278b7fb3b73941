"""Compile the kernels' C++ sources into one shared library against the installed torch,
without loading it: an image build makes libraries for CPU levels its own CPU may lack
(x86-64-v4 on an AVX2 builder), and loading one of those there could fault. The commands are
the ones torch.utils.cpp_extension writes (its public include and library paths); the
sources include only ATen and torch/library.h, so neither Python's headers nor pybind11."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

COMPILE_TIMEOUT_S = 900.0
PRECOMPILED_HEADER = Path(__file__).parent / "csrc" / "precompiled.h"
# Sources from which compiling PRECOMPILED_HEADER first pays (it costs about one source).
PRECOMPILE_FROM = 3


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
            objects = compile_objects(sources, Path(scratch), compiler(), compile_flags(arch))
            partial = Path(scratch) / library.name
            _run([compiler(), *map(str, objects), *link_flags(), "-o", str(partial)])
            os.replace(partial, library)


def compile_objects(
    sources: Sequence[Path], scratch: Path, cxx: str, flags: Sequence[str]
) -> list[Path]:
    """Compile `sources` into objects in `scratch`, as many at a time as there are CPUs. From
    PRECOMPILE_FROM sources on, PRECOMPILED_HEADER (the ATen and torch headers every kernel
    includes) is compiled once first (gcc's precompiled headers) and each source starts from
    it: parsing those headers took 10-15 s of each kernel's 13-21 s compile, and the native
    build of the kernels went from 93 s to ~60 s on the AMD EPYC Zen 1 (2 cores). A compiler
    that cannot use the precompiled header parses the headers itself: same objects, slower."""
    flags = [*flags, f"-I{PRECOMPILED_HEADER.parent}"]
    if len(sources) >= PRECOMPILE_FROM:
        header = scratch / PRECOMPILED_HEADER.name
        shutil.copyfile(PRECOMPILED_HEADER, header)
        _compile_each([[cxx, *flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"]],
                      [header])  # fmt: skip
        flags = [*flags, "-include", str(header)]
    objects = [scratch / f"{source.stem}.o" for source in sources]
    commands = [
        [cxx, *flags, "-c", str(source), "-o", str(target)]
        for source, target in zip(sources, objects, strict=True)
    ]
    _compile_each(commands, sources)
    return objects


def _compile_each(commands: Sequence[list[str]], sources: Sequence[Path]) -> None:
    """Run the compiler commands, os.cpu_count() at a time; every failure is reported."""
    failures = []

    def compile_one(command: list[str]) -> str | None:
        try:
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMPILE_TIMEOUT_S
            )
        except FileNotFoundError as error:
            raise KernelBuildError(f"no compiler: {error}") from error
        return None if done.returncode == 0 else done.stdout.decode(errors="replace")[-3000:]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for source, output in zip(sources, pool.map(compile_one, commands), strict=True):
            if output is not None:
                failures.append(f"{source.name}:\n{output}")
    if failures:
        raise KernelBuildError("compiling the CPU kernels failed: " + "\n".join(failures))


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
