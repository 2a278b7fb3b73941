"""Session fixtures: the default model's directory and a tiny random Llama built beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model_store import ensure_default_model
from tests.model_fixtures import build_tiny_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)
