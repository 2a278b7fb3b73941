"""Helpers for the k8s/ checks: where things are, rendering an overlay, finding objects and
running a tool with a time limit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "k8s"
# cpu-secure: the cpu overlay with the optional TLS (cert-manager) and token components.
OVERLAYS = ("cpu", "gpu", "cpu-secure")
VENV_BIN = Path(sys.executable).parent
TOOLS_BIN = REPO_ROOT / ".venv-tools" / "bin"

Manifest = dict[str, Any]


def tool(name: str, where: Path = VENV_BIN) -> str:
    """The path of a command-line tool; fails (never skips) when it is not installed."""
    candidate = where / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make install tools` (kubectl: on PATH)")
    return found


def run(
    args: list[str], timeout_s: float, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    """Runs a tool, capturing its output; a tool that hangs fails the test, named."""
    try:
        return subprocess.run(
            args, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{Path(args[0]).name} took more than {timeout_s} s: {args}")


def render(overlay: str) -> str:
    result = run([tool("kubectl"), "kustomize", str(K8S_DIR / "overlays" / overlay)], 60)
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/overlays/{overlay} failed:\n{result.stderr}")
    return result.stdout


def load_all(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    """The object of this kind whose name is `name` (generated ConfigMaps: `name-<hash>`)."""
    for manifest in manifests:
        actual = manifest["metadata"]["name"]
        if manifest["kind"] == kind and (actual == name or actual.rpartition("-")[0] == name):
            return manifest
    raise AssertionError(f"no {kind} named {name}")


def of_kind(manifests: list[Manifest], kind: str) -> Iterator[Manifest]:
    return (manifest for manifest in manifests if manifest["kind"] == kind)


def pod_spec(deployment: Manifest) -> Manifest:
    spec: Manifest = deployment["spec"]["template"]["spec"]
    return spec


def all_containers(deployment: Manifest) -> list[Manifest]:
    spec = pod_spec(deployment)
    return list(spec.get("initContainers", [])) + list(spec["containers"])
