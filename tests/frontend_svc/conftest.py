"""Frontend test fixtures: the default model's tokenizer, loaded once (no weights needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend_svc.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


@pytest.fixture(scope="session")
def byte_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens that are parts of multi-byte UTF-8 characters (they decode alone to U+FFFD)."""
    vocab_size = tokenizer.vocab_size
    return [i for i in range(vocab_size) if "\ufffd" in tokenizer.decode([i], False)]


@pytest.fixture(params=[True, False], ids=["GenerateMany", "Generate"])
def engine_call_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Scripted engines with GenerateMany (the frontend's requests share one call to each),
    and without (an older engine: the frontend falls back to one Generate call a request)."""
    from tests.frontend_svc.fake_engine import FakeEngine

    monkeypatch.setattr(FakeEngine, "multiplexed", request.param)
    return bool(request.param)
