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
