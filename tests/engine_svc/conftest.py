"""Fixtures: a maker of fake-runner engines that must all drain (the scheduler tests), and
one engine service with the tiny model for a module's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine_svc.scheduler_harness import FakeEngine, assert_drained, make_config
from tests.service_processes import ServiceProcess, start_service


@pytest.fixture(scope="module")
def service(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The engine service (tiny model, default options), started once per module."""
    log_path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "service.log"
    running = start_service(tiny_model_dir, log_path)
    yield running
    running.stop()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., FakeEngine]]:
    """Engines made here must end with every request finished and every block free."""
    engines: list[FakeEngine] = []

    def make(**overrides: Any) -> FakeEngine:
        engines.append(FakeEngine(make_config(**overrides)))
        return engines[-1]

    yield make
    for engine in engines:
        assert_drained(engine.scheduler)
