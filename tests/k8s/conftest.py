"""Each overlay is rendered once per session (kubectl kustomize) and written to a folder the
external tools read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s.manifests import OVERLAYS, Manifest, load_all, render


@pytest.fixture(scope="session")
def rendered_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding <overlay>.yaml, the output of `kubectl kustomize`, for each overlay."""
    folder = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        (folder / f"{overlay}.yaml").write_text(render(overlay))
    return folder


@pytest.fixture(scope="session")
def rendered(rendered_dir: Path) -> dict[str, list[Manifest]]:
    """Each overlay's objects, parsed."""
    return {
        overlay: load_all((rendered_dir / f"{overlay}.yaml").read_text()) for overlay in OVERLAYS
    }
