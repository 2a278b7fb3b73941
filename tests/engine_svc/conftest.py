"""The scheduler tests' fixture: a maker of fake-runner engines that must all drain."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.engine_svc.scheduler_harness import FakeEngine, assert_drained, make_config


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
