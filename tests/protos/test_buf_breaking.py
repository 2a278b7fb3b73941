"""`buf breaking`: the protos in the work tree stay wire- and source-compatible (buf.yaml's
FILE rules) with those of the previous commit, as CI checks every push to main.

Skipped only where there is nothing to compare with: no previous commit (a single-commit or
shallow clone) or one without protos. An intended break takes a new package version
(engine.v2), or an entry under `breaking:` in buf.yaml, in the same commit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"
PREVIOUS = "HEAD~1"


def _git(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def _breaking(against: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUF), "breaking", "--against", against],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def against_previous_commit(cwd: Path) -> str | None:
    """buf's input for the previous commit, or None when there is nothing to compare."""
    if _git("rev-parse", "--verify", "--quiet", f"{PREVIOUS}^{{commit}}", cwd=cwd).returncode:
        return None
    files = _git("ls-tree", "-r", "--name-only", PREVIOUS, cwd=cwd).stdout.splitlines()
    if not any(name.startswith("protos/") and name.endswith(".proto") for name in files):
        return None
    # Before buf.yaml existed, protos/ itself was the module root.
    subdir = "" if "buf.yaml" in files else ",subdir=protos"
    return f".git#ref={PREVIOUS}{subdir}"


def test_protos_are_compatible_with_the_previous_commit() -> None:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    against = against_previous_commit(REPO_ROOT)
    if against is None:
        pytest.skip(f"{PREVIOUS} does not exist or has no protos: nothing to compare with")
    result = _breaking(against, REPO_ROOT)
    assert result.returncode == 0, (
        f"buf breaking --against {against}:\n{result.stdout}{result.stderr}"
    )


def test_buf_breaking_catches_a_deleted_field(tmp_path: Path) -> None:
    """The same check in a scratch repository whose last commit deletes a field."""
    (tmp_path / "protos" / "demo" / "v1").mkdir(parents=True)
    (tmp_path / "buf.yaml").write_text((REPO_ROOT / "buf.yaml").read_text())
    proto = tmp_path / "protos" / "demo" / "v1" / "demo.proto"
    message = 'syntax = "proto3";\npackage demo.v1;\nmessage PingRequest {\n%s}\n'
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    assert _git("init", "-q", cwd=tmp_path).returncode == 0
    for fields in ("  string name = 1;\n  int32 count = 2;\n", "  string name = 1;\n"):
        proto.write_text(message % fields)
        _git("add", ".", cwd=tmp_path)
        assert _git(*identity, "commit", "-q", "-m", "step", cwd=tmp_path).returncode == 0
    against = against_previous_commit(tmp_path)
    assert against == ".git#ref=HEAD~1"
    result = _breaking(against, tmp_path)
    assert result.returncode != 0 and "count" in result.stdout, result.stdout + result.stderr
