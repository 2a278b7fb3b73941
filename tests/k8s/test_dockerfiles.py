"""The images (k8s/docker/): hadolint-clean, pinned base images, sources that exist and that
the build context admits, and ports, user and entry point that match the manifests.
No image is built here (no container engine runs on CI); checkov also scans both files."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests.k8s.manifests import (
    K8S_DIR,
    REPO_ROOT,
    Manifest,
    find,
    pod_spec,
    run,
    tool,
)

DOCKER_DIR = K8S_DIR / "docker"
# image -> (Dockerfile, Deployment, module the entry point runs)
IMAGES = {
    "engine": ("engine.Dockerfile", "duoserve-engine", "engine_svc"),
    "frontend": ("frontend.Dockerfile", "duoserve-frontend", "frontend_svc"),
}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def _of(dockerfile: Path, keyword: str) -> list[str]:
    return [rest for key, rest in instructions(dockerfile) if key == keyword]


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint(image: str) -> None:
    result = run([tool("hadolint"), str(DOCKER_DIR / IMAGES[image][0])], 60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path: Path) -> None:
    canary = tmp_path / "canary.Dockerfile"
    canary.write_text("FROM debian\nRUN apt-get install -y curl\n")
    assert run([tool("hadolint"), str(canary)], 60).returncode != 0


@pytest.mark.parametrize("image", IMAGES)
def test_base_image_is_pinned(image: str) -> None:
    """checkov cannot see through `FROM ${BASE_IMAGE}` (its CKV_DOCKER_7 is skipped for
    that): the ARG's default must name an explicit tag other than latest."""
    dockerfile = DOCKER_DIR / IMAGES[image][0]
    defaults = dict(arg.partition("=")[::2] for arg in _of(dockerfile, "ARG") if "=" in arg)
    base = defaults["BASE_IMAGE"]
    repository, _, tag = base.rpartition(":")
    assert repository and "/" not in tag and tag and tag != "latest", base
    assert all(line.startswith("${BASE_IMAGE}") for line in _of(dockerfile, "FROM"))


@pytest.mark.parametrize("image", IMAGES)
def test_build_context_admits_every_copied_path(image: str) -> None:
    dockerfile = DOCKER_DIR / IMAGES[image][0]
    ignore = (DOCKER_DIR / f"{IMAGES[image][0]}.dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for copy in _of(dockerfile, "COPY"):
        if copy.startswith("--from="):
            continue
        for source in copy.split()[:-1]:
            assert (REPO_ROOT / source).exists(), source
            assert source.rstrip("/") in admitted, f"{source} is not in the build context"


@pytest.mark.parametrize("image", IMAGES)
def test_image_matches_its_deployment(image: str, rendered: dict[str, list[Manifest]]) -> None:
    file_name, deployment_name, module = IMAGES[image]
    dockerfile = DOCKER_DIR / file_name
    exposed = {int(port) for line in _of(dockerfile, "EXPOSE") for port in line.split()}
    [entrypoint] = _of(dockerfile, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["python", "-m", module]
    [user] = _of(dockerfile, "USER")
    for manifests in rendered.values():
        deployment = find(manifests, "Deployment", deployment_name)
        container = pod_spec(deployment)["containers"][0]
        assert {port["containerPort"] for port in container["ports"]} == exposed
        assert container["image"].partition(":")[0] == f"duoserve-{image}"
        uid = container["securityContext"]["runAsUser"]
        assert user == f"{uid}:{container['securityContext']['runAsGroup']}"


def _requirements_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("requirements", DOCKER_DIR / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_images_install_the_pinned_requirements(tmp_path: Path) -> None:
    requirements = _requirements_module()
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = project["dependencies"] + project["optional-dependencies"]["convert"]
    pyproject = REPO_ROOT / "pyproject.toml"
    assert requirements.pinned_requirements(pyproject, ["dependencies", "convert"]) == runtime
    [protoc] = requirements.pinned_requirements(pyproject, ["dev"], only=["grpcio_tools"])
    assert protoc.startswith("grpcio-tools==")
    loose = tmp_path / "pyproject.toml"
    loose.write_text('[project]\nname = "x"\ndependencies = ["torch>=2"]\n')
    with pytest.raises(ValueError, match="unpinned"):
        requirements.pinned_requirements(loose, ["dependencies"])
