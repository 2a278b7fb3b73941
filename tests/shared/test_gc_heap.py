"""shared/gc_heap.py, each case in a fresh Python: freezing changes the collector of the
whole process, which the test process must keep as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.service_processes import REPO_ROOT


def run_python(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def test_start_up_collects_nothing_then_its_survivors_are_frozen_and_its_garbage_gone() -> None:
    out = run_python(
        """
        import gc, weakref
        from shared.gc_heap import startup_heap

        class Node:
            pass

        with startup_heap("a test"):
            during = gc.isenabled()
            kept = [Node() for _ in range(5000)]
            cycle = Node()
            cycle.me = cycle  # garbage only a collection frees
            gone = weakref.ref(cycle)
            del cycle
            collections = gc.get_stats()[2]["collections"]
            for _ in range(200_000):
                loop = Node()
                loop.me = loop  # enough garbage to set off collections, were they on
            alive_at_end = gone() is not None
            during_full = gc.get_stats()[2]["collections"] - collections
        made_after = [Node() for _ in range(10)]
        tracked = {id(o) for o in gc.get_objects()}
        print(during, alive_at_end, during_full, gc.isenabled(), gone() is None,
              gc.get_freeze_count() > 5000, any(id(o) in tracked for o in kept),
              all(id(o) in tracked for o in made_after))
        """
    )
    assert out == "False True 0 True True True False True"


def test_a_start_up_that_fails_leaves_the_collector_on_and_freezes_nothing() -> None:
    out = run_python(
        """
        import gc
        from shared.gc_heap import startup_heap

        try:
            with startup_heap("a test"):
                raise RuntimeError("no model")
        except RuntimeError as error:
            print(error, gc.isenabled(), gc.get_freeze_count())
        """
    )
    assert out == "no model True 0"


def test_a_collector_turned_off_before_stays_off() -> None:
    out = run_python(
        """
        import gc
        from shared.gc_heap import freeze_heap, startup_heap

        gc.disable()
        with startup_heap("a test"):
            pass
        print(gc.isenabled(), gc.get_freeze_count() > 0, freeze_heap("again") > 0)
        """
    )
    assert out == "False True True"
