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
# The engine as a LeaderWorkerSet's pods instead of a Deployment: checked by test_multinode.py.
MULTINODE = "multinode"
# What the LeaderWorkerSet controller sets in every container of a group.
LWS_VARIABLES = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
# The oldest release the manifests claim (native gRPC probes are GA from 1.27) and the newest
# schemas kubernetes-validate ships; both offline.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
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


def kubernetes_validate(paths: list[Path]) -> tuple[int, list[str]]:
    """`kubernetes-validate --strict` for both releases: its exit status and its lines."""
    args = [tool("kubernetes-validate"), "--strict", "--quiet"]
    for version in KUBERNETES_VERSIONS:
        args += ["-k", version]
    result = run(args + [str(path) for path in paths], 120)
    return result.returncode, (result.stdout + result.stderr).splitlines()


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


def group_pods(leader_worker_set: Manifest) -> dict[str, Manifest]:
    """A LeaderWorkerSet's two templates as the Pods its controller makes of them ("leader",
    "worker"), for the checks that know Pods: kubernetes-validate, checkov, the contract."""
    template = leader_worker_set["spec"]["leaderWorkerTemplate"]
    metadata = leader_worker_set["metadata"]
    return {
        role: {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **template[f"{role}Template"]["metadata"],
                "name": f"{metadata['name']}-{role}",
                "namespace": metadata["namespace"],
            },
            "spec": template[f"{role}Template"]["spec"],
        }
        for role in ("leader", "worker")
    }


def with_group_pods(manifests: list[Manifest]) -> list[Manifest]:
    """The objects with each LeaderWorkerSet replaced by its Pods: what kubernetes-validate
    and checkov can check (they know no LeaderWorkerSet)."""
    out: list[Manifest] = []
    for manifest in manifests:
        if manifest["kind"] == "LeaderWorkerSet":
            out.extend(group_pods(manifest).values())
        else:
            out.append(manifest)
    return out


def assert_locked_down(spec: Manifest) -> None:
    """A pod spec runs as non-root with no privilege, a read-only root and bounded resources."""
    assert spec["automountServiceAccountToken"] is False
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] >= 10000
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    empty_dirs = {volume["name"] for volume in spec["volumes"] if "emptyDir" in volume}
    for container in list(spec.get("initContainers", [])) + list(spec["containers"]):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), container["name"]
        # A read-only root needs a writable /tmp, and HOME there for library caches.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts.get("/tmp") in empty_dirs, container["name"]
        assert {"name": "HOME", "value": "/tmp"} in container["env"], container["name"]
