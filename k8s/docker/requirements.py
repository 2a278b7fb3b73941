"""Prints pinned requirements out of pyproject.toml, one a line, for the image builds: the
images install exactly the versions the tests ran with, without installing the package.

usage: python3 requirements.py PYPROJECT GROUP [GROUP ...] [--only NAME ...]
GROUP is `dependencies` or the name of an optional-dependencies extra (`convert`, `dev`).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string, normalized (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def pinned_requirements(
    pyproject: Path, groups: list[str], only: list[str] | None = None
) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    requirements: list[str] = []
    for group in groups:
        if group == "dependencies":
            requirements += project["dependencies"]
        elif group in extras:
            requirements += extras[group]
        else:
            raise KeyError(f"{pyproject} has no dependency group {group!r}")
    if only is not None:
        wanted = {requirement_name(name) for name in only}
        requirements = [r for r in requirements if requirement_name(r) in wanted]
        missing = wanted - {requirement_name(r) for r in requirements}
        if missing:
            raise KeyError(f"not in {groups}: {sorted(missing)}")
    unpinned = [r for r in requirements if "==" not in r]
    if unpinned:
        raise ValueError(f"images install pinned versions only; unpinned: {unpinned}")
    return requirements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("groups", nargs="+")
    parser.add_argument("--only", nargs="+", help="just these distributions")
    args = parser.parse_args(argv)
    try:
        requirements = pinned_requirements(args.pyproject, args.groups, args.only)
    except (KeyError, ValueError) as error:
        parser.error(str(error))
    print("\n".join(requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main())
