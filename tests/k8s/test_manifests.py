"""The CI checks on k8s/: every overlay builds, validates strictly against the Kubernetes
schemas, passes checkov, and the YAML is lint-clean. Each check also runs on a deliberately
broken input, to show that it can fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from tests.k8s.cert_manager_schema import CERTIFICATE_SCHEMA, ISSUER_SCHEMA
from tests.k8s.manifests import (
    K8S_DIR,
    MULTINODE,
    OVERLAYS,
    TOOLS_BIN,
    Manifest,
    kubernetes_validate,
    of_kind,
    run,
    tool,
)
from tests.k8s.servicemonitor_schema import SERVICE_MONITOR_SCHEMA

# Kinds that kubernetes-validate has no schema for, and what checks them instead.
CRD_KINDS = {
    "ServiceMonitor": "test_service_monitor_matches_its_schema",
    "Certificate": "test_cert_manager_resources_match_their_schemas",
    "Issuer": "test_cert_manager_resources_match_their_schemas",
}

_UNKNOWN_FIELD = """\
apiVersion: v1
kind: Service
metadata:
  name: canary
spec:
  selector: {app: canary}
  ports:
    - port: 80
      targetPortt: 8080
"""
_INSECURE_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: canary
spec:
  containers:
    - name: canary
      image: busybox
"""
_ROOT_DOCKERFILE = "FROM busybox:1.36\nRUN echo hello\n"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds(overlay: str, rendered: dict[str, list[Manifest]]) -> None:
    kinds = {manifest["kind"] for manifest in rendered[overlay]}
    assert {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
        "NetworkPolicy",
        "ServiceMonitor",
    } <= kinds


def test_kubernetes_validate_strict(rendered_dir: Path) -> None:
    paths = [rendered_dir / f"{overlay}.yaml" for overlay in (*OVERLAYS, MULTINODE)]
    returncode, lines = kubernetes_validate(paths)
    errors = [line for line in lines if not line.startswith("WARN")]
    assert returncode == 0 and not errors, "\n".join(lines)
    # kubernetes-validate only warns about kinds it has no schema for (a misspelt apiVersion
    # included): each such warning must be a CRD kind that another test checks.
    unchecked = [line for line in lines if not any(f"kind {kind} " in line for kind in CRD_KINDS)]
    assert not unchecked, "\n".join(unchecked)


def test_kubernetes_validate_rejects_unknown_fields(tmp_path: Path) -> None:
    canary = tmp_path / "canary.yaml"
    canary.write_text(_UNKNOWN_FIELD)
    returncode, lines = kubernetes_validate([canary])
    assert returncode != 0 and any("targetPortt" in line for line in lines), lines


def test_service_monitor_matches_its_schema(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, manifests in rendered.items():
        monitors = list(of_kind(manifests, "ServiceMonitor"))
        assert monitors, overlay
        for monitor in monitors:
            jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**monitors[0], "spec": {**monitors[0]["spec"], "endpoint": []}},
            SERVICE_MONITOR_SCHEMA,
        )


def test_cert_manager_resources_match_their_schemas(rendered: dict[str, list[Manifest]]) -> None:
    schemas = {"Certificate": CERTIFICATE_SCHEMA, "Issuer": ISSUER_SCHEMA}
    found = {kind: list(of_kind(rendered["cpu-secure"], kind)) for kind in schemas}
    assert len(found["Certificate"]) == 3 and len(found["Issuer"]) == 2, found
    for kind, schema in schemas.items():
        for resource in found[kind]:
            jsonschema.validate(resource, schema)
    certificate = found["Certificate"][0]
    with pytest.raises(jsonschema.ValidationError):  # a misspelt field
        jsonschema.validate({**certificate, "spec": {**certificate["spec"], "dnsName": []}},
                            CERTIFICATE_SCHEMA)  # fmt: skip
    assert not any(of_kind(rendered["cpu"], "Certificate"))  # TLS is optional


def test_checkov(rendered_dir: Path, tmp_path: Path) -> None:
    """One checkov run over the rendered overlays (multinode's group as Pods), both
    Dockerfiles and two canaries."""
    scan = tmp_path / "scan"
    scan.mkdir()
    for overlay in (*OVERLAYS, MULTINODE):
        shutil.copy(rendered_dir / f"{overlay}.yaml", scan / f"{overlay}.yaml")
    for dockerfile in (K8S_DIR / "docker").glob("*.Dockerfile"):
        shutil.copy(dockerfile, scan / dockerfile.name)
    (scan / "canary").mkdir()
    (scan / "canary" / "canary.yaml").write_text(_INSECURE_POD)
    (scan / "canary" / "canary.Dockerfile").write_text(_ROOT_DOCKERFILE)
    config = K8S_DIR / ".checkov.yaml"
    result = run(
        [tool("checkov", TOOLS_BIN), "--config-file", str(config), "-d", str(scan), "-o", "json"],
        180,
    )
    try:
        reports = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov gave no JSON report (exit {result.returncode}):\n{result.stderr}")
    failed: dict[str, set[str]] = {}
    passed: set[str] = set()
    for report in reports:
        assert report["summary"]["parsing_errors"] == 0, report["check_type"]
        for check in report["results"]["failed_checks"]:
            failed.setdefault(Path(check["file_path"]).name, set()).add(check["check_id"])
        passed |= {Path(check["file_path"]).name for check in report["results"]["passed_checks"]}
    canaries = {name: failed.pop(name, set()) for name in ("canary.yaml", "canary.Dockerfile")}
    assert not failed, f"checkov failures (fix, or skip with a reason in {config}): {failed}"
    scanned = {f"{overlay}.yaml" for overlay in (*OVERLAYS, MULTINODE)} | {
        "engine.Dockerfile",
        "frontend.Dockerfile",
    }
    assert scanned <= passed, f"checkov did not scan {scanned - passed}"
    assert "CKV_K8S_20" in canaries["canary.yaml"], canaries  # allowPrivilegeEscalation
    assert "CKV_DOCKER_3" in canaries["canary.Dockerfile"], canaries  # no USER


def test_yamllint(tmp_path: Path) -> None:
    config = str(K8S_DIR / ".yamllint.yaml")
    yamllint = tool("yamllint")
    result = run([yamllint, "--strict", "-c", config, "-f", "parsable", str(K8S_DIR)], 60)
    assert result.returncode == 0, result.stdout + result.stderr
    canary = tmp_path / "canary.yaml"
    canary.write_text("a:   yes\n")
    result = run([yamllint, "--strict", "-c", config, str(canary)], 60)
    assert result.returncode != 0
