"""One engine (the tiny model), our frontend and smg in front of it, shared by the interop
tests: started once, stopped by process id at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.interop.processes import SmgProcess
from tests.service_processes import FrontendProcess, ServiceProcess, start_service


@pytest.fixture(scope="session")
def interop_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("interop-logs")


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path, interop_logs: Path) -> Iterator[ServiceProcess]:
    service = start_service(tiny_model_dir, interop_logs / "engine.log")
    yield service
    service.stop()


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name  # what the engine serves it as, by default


@pytest.fixture(scope="session")
def frontend(
    engine: ServiceProcess, tiny_model_dir: Path, interop_logs: Path
) -> Iterator[FrontendProcess]:
    service = FrontendProcess(
        [engine.address], interop_logs / "frontend.log", "--tokenizer", str(tiny_model_dir)
    )
    try:
        service.wait_serving()
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def smg(
    engine: ServiceProcess, tiny_model_dir: Path, model_name: str, interop_logs: Path
) -> Iterator[SmgProcess]:
    service = SmgProcess(engine.address, tiny_model_dir, model_name, interop_logs / "smg.log")
    try:
        service.wait_serving()
        yield service
    finally:
        service.stop()
