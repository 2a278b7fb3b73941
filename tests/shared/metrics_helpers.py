"""Helpers for metrics tests: promtool's verdict on a /metrics text, minus the findings that
vLLM's own metric names cause (dashboards depend on those names, so they stay)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

# promtool lints names with ':' (meant for recording rules) and a histogram named *_total;
# vLLM's names do both, and its own /metrics draws the same findings.
_VLLM_NAME_FINDINGS = (
    re.compile(r"vllm:\w+ metric names should not contain ':'"),
    re.compile(r'vllm:iteration_tokens_total(_created)? non-counter metrics should not have '
               r'"_total" suffix'),
)  # fmt: skip


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: `make test` installs it (Debian's prometheus)")
    return path


def promtool_problems(exposition: str) -> list[str]:
    """What `promtool check metrics` objects to, beyond vLLM's names; [] when it is clean."""
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = (result.stdout + result.stderr).splitlines()
    problems = [
        line
        for line in findings
        if line.strip() and not any(p.fullmatch(line.strip()) for p in _VLLM_NAME_FINDINGS)
    ]
    if result.returncode not in (0, 3):  # 3: lint findings only; anything else: unparsable
        problems.append(f"promtool exited {result.returncode}")
    return problems
