"""Each overlay is rendered once per session (kubectl kustomize) and written to a folder the
external tools read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s.manifests import (
    MULTINODE,
    OVERLAYS,
    Manifest,
    load_all,
    render,
    with_group_pods,
)


@pytest.fixture(scope="session")
def rendered_dir(tmp_path_factory: pytest.TempPathFactory, multinode: list[Manifest]) -> Path:
    """A folder holding <overlay>.yaml, the output of `kubectl kustomize`, for each overlay;
    and multinode.yaml, that overlay's objects with its LeaderWorkerSet as Pods."""
    folder = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        (folder / f"{overlay}.yaml").write_text(render(overlay))
    (folder / f"{MULTINODE}.yaml").write_text(yaml.safe_dump_all(with_group_pods(multinode)))
    return folder


@pytest.fixture(scope="session")
def rendered(rendered_dir: Path) -> dict[str, list[Manifest]]:
    """Each overlay's objects, parsed."""
    return {
        overlay: load_all((rendered_dir / f"{overlay}.yaml").read_text()) for overlay in OVERLAYS
    }


@pytest.fixture(scope="session")
def multinode() -> list[Manifest]:
    """The multinode overlay's objects, parsed (`kubectl kustomize`, once per session)."""
    return load_all(render(MULTINODE))
