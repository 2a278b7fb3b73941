"""No `asyncio.wait_for` in the services: on Python 3.11 it returns the inner result when a
cancel lands in the loop iteration the inner wait completes in, dropping the cancel. The
frontend's wait for a tokenizer, set off by a health report every poll, thus ran past its
start-up timeout and every stop signal (tests/frontend_svc/test_startup.py); the services
use `async with asyncio.timeout(...)`, which keeps it. The benchmarks may (clients, not
servers)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_CODE = ("engine_svc", "frontend_svc", "shared")


def _wait_for_calls(path: Path) -> list[int]:
    """Lines that name asyncio's wait_for: `asyncio.wait_for` (or through another name for
    the module) and `from asyncio import wait_for`."""
    tree = ast.parse(path.read_text(), str(path))
    asyncio_names = {"asyncio"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "asyncio" and alias.asname
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr == "wait_for"
            and isinstance(node.value, ast.Name) and node.value.id in asyncio_names)
        or (isinstance(node, ast.ImportFrom) and node.module == "asyncio"
            and any(alias.name == "wait_for" for alias in node.names))
    ]  # fmt: skip


def test_the_services_wait_with_asyncio_timeout_not_wait_for() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in SERVICE_CODE
        for path in sorted((ROOT / package).rglob("*.py"))
        if "bench" not in path.relative_to(ROOT).parts
        for line in _wait_for_calls(path)
    ]
    assert found == []
