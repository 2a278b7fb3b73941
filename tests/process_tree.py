"""A process's children and descendants, and whether one still runs, from /proc: what the
tests that kill a launcher or a service check is left behind."""

from __future__ import annotations

import contextlib
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The children of every thread of `pid` (a child spawned from another thread than the
    main one is listed under that thread)."""
    children: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    for child in child_pids(pid):
        found += [child, *descendants(child)]
    return found


def is_alive(pid: int) -> bool:
    """Running, not merely a zombie its parent has yet to reap."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False
