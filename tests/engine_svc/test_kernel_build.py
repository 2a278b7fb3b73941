"""Building and choosing the CPU kernels' library: the build makes a library it does not load
(an image builds levels its own CPU may lack), builders of one library wait for each other
and it appears whole, a compiler's refusal is an error with its words; of the levels asked
for, a machine loads the first its CPU runs. A small source stands in for the kernels: the
real build is exercised by every test that runs them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine_svc.kernels import build, loader

SOURCE = """
#include <torch/library.h>

at::Tensor twice(const at::Tensor& x) { return x.mul(2); }

TORCH_LIBRARY(duoserve_build_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""
V3_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "bmi2"})
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small library, built once for the module and loaded here."""
    folder = tmp_path_factory.mktemp("build")
    source = folder / "twice.cpp"
    source.write_text(SOURCE)
    library = folder / "out" / "twice.so"
    build.build_library([source], library, "native")
    torch.ops.load_library(str(library))
    return library


def test_the_built_library_registers_its_ops(built: Path) -> None:
    x = torch.arange(4.0)
    assert torch.equal(torch.ops.duoserve_build_test.twice(x), x * 2)


def test_a_library_is_built_once_whoever_asks(built: Path, tmp_path: Path) -> None:
    before = built.stat().st_mtime_ns
    build.build_library([tmp_path / "never-read.cpp"], built, "native")  # exists: no compile
    assert built.stat().st_mtime_ns == before
    assert [p.name for p in built.parent.iterdir() if p.name.startswith("build-")] == []


def test_concurrent_builders_make_one_library(tmp_path: Path) -> None:
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE.replace("duoserve_build_test", "duoserve_build_test_2"))
    library = tmp_path / "out" / "twice.so"
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            build.build_library([source], library, "x86-64-v3")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and library.exists()
    assert sorted(p.name for p in library.parent.iterdir()) == ["twice.lock", "twice.so"]


def test_a_compile_error_names_the_source_and_the_compilers_words(tmp_path: Path) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("int main( { return 0; }\n")
    library = tmp_path / "broken.so"
    with pytest.raises(build.KernelBuildError, match=r"broken\.cpp") as caught:
        build.build_library([source], library, "native")
    assert "error" in str(caught.value)
    assert not library.exists()


def test_a_missing_compiler_is_a_build_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    with pytest.raises(build.KernelBuildError, match="no compiler"):
        build.build_library([source], tmp_path / "twice.so", "native")


@pytest.mark.parametrize(
    ("asked", "flags", "chosen"),
    [
        (None, V3_FLAGS, "native"),
        ("x86-64-v4,x86-64-v3", V4_FLAGS, "x86-64-v4"),
        ("x86-64-v4, x86-64-v3", V3_FLAGS, "x86-64-v3"),
        ("x86-64-v4,x86-64-v3", frozenset({"sse4_2"}), None),
        ("x86-64-v3", V4_FLAGS, "x86-64-v3"),
        ("skylake-avx512", frozenset(), "skylake-avx512"),  # no flags known for it: trusted
    ],
)
def test_a_machine_loads_the_first_level_its_cpu_runs(
    monkeypatch: pytest.MonkeyPatch, asked: str | None, flags: frozenset[str], chosen: str | None
) -> None:
    if asked is None:
        monkeypatch.delenv(loader.ARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(loader.ARCH_ENV, asked)
    monkeypatch.setattr(loader, "_cpu_flags", lambda: flags)
    assert loader.load_level() == chosen


def test_each_level_builds_into_a_folder_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(loader.CACHE_ENV, "/cache")
    folders = {loader.build_dir(level) for level in ("native", "x86-64-v3", "x86-64-v4")}
    assert len(folders) == 3 and all(f.parent == Path("/cache") for f in folders)
