"""The accepted-token set: file and environment, rotation by rewriting the file, and what a
missing or emptied file does; and the bearer metadata both sides agree on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.grpc_auth import (
    AuthConfigError,
    ClientToken,
    TokenSet,
    bearer_token,
    call_metadata,
    read_client_token,
)


def _rewrite(path: Path, text: str) -> None:
    """Replace the file as Kubernetes rotates a mounted Secret: a new file moved in."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    fresh.replace(path)


def test_tokens_from_a_file_are_re_read_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("alpha\n\n  beta  \n")
    tokens = TokenSet(path)
    assert tokens.accepts("alpha") and tokens.accepts("beta")
    assert not tokens.accepts("") and not tokens.accepts("alph") and not tokens.accepts("gamma")
    _rewrite(path, "beta\ngamma\n")  # rotation: alpha retired, gamma added
    assert not tokens.accepts("alpha")
    assert tokens.accepts("beta") and tokens.accepts("gamma")


def test_a_missing_or_emptied_file_keeps_the_last_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("alpha\n")
    tokens = TokenSet(path)
    path.unlink()
    assert tokens.accepts("alpha")
    path.write_text("\n")
    assert tokens.accepts("alpha")


def test_tokens_from_the_environment_and_off_without_either(tmp_path: Path) -> None:
    env = {"TOKENS": "one, two,,"}
    from_env = TokenSet.from_options(None, env, "TOKENS")
    assert from_env is not None and from_env.accepts("one") and from_env.accepts("two")
    assert not from_env.accepts("")
    assert TokenSet.from_options(None, {}, "TOKENS") is None
    assert TokenSet.from_options(None, {"TOKENS": " , "}, "TOKENS") is None
    path = tmp_path / "tokens"
    path.write_text("three\n")
    both = TokenSet.from_options(path, env, "TOKENS")
    assert both is not None and both.accepts("one") and both.accepts("three")


def test_a_token_file_without_tokens_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("\n  \n")
    with pytest.raises(AuthConfigError):
        TokenSet(path)
    with pytest.raises(OSError):
        TokenSet(tmp_path / "absent")


def test_client_and_server_agree_on_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\nignored\n")
    token = read_client_token(path, {}, "TOKEN")
    assert token == "s3cret"
    assert read_client_token(None, {"TOKEN": " from-env "}, "TOKEN") == "from-env"
    assert read_client_token(None, dict(os.environ) | {"TOKEN": ""}, "TOKEN") == ""
    assert call_metadata("") == ()
    assert bearer_token(call_metadata(token)) == "s3cret"
    assert bearer_token([("authorization", "Basic s3cret")]) == ""
    for scheme in ("bearer", "BEARER", "beARer"):  # a scheme's name is case-insensitive
        assert bearer_token([("authorization", f"{scheme} s3cret")]) == "s3cret"
    assert bearer_token(None) == ""


def test_a_client_token_file_is_re_read_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\nsecond\n")
    token = ClientToken(path)
    assert token.current() == "first"
    _rewrite(path, "new\nfirst\n")  # rotation: the new token first
    assert token.current() == "new"
    path.unlink()  # mid-rotation
    assert token.current() == "new"
    path.write_text("\n")
    assert token.current() == "new"
    assert ClientToken.from_options(None, {}, "TOKEN") is None
    from_env = ClientToken.from_options(None, {"TOKEN": " env "}, "TOKEN")
    assert from_env is not None and from_env.current() == "env"
    path.write_text(" \n")
    with pytest.raises(AuthConfigError):
        ClientToken(path)


def test_a_token_file_rewritten_with_bytes_that_are_not_text_keeps_its_last_tokens(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tokens"
    path.write_text("alpha\n")
    tokens, token = TokenSet(path), ClientToken(path)
    path.write_bytes(b"\xff\xfe\n")
    assert tokens.accepts("alpha") and token.current() == "alpha"
