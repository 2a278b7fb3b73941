"""`--service-idle-priority` (engine_svc/server/cpu_priority.py): every thread of the
process at SCHED_IDLE, threads started afterwards too; the flag reaches the service's
options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_svc.__main__ import build_parser

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
    reason="SCHED_IDLE is Linux's",
)

# In a process of its own (the policy would stay on the test runner's threads): a thread
# started before the call, the call, a thread started after it; every thread's policy.
_CHILD = """
import json, os, threading
from engine_svc.server.cpu_priority import take_idle_priority
before_go, after_go = threading.Event(), threading.Event()
before = threading.Thread(target=before_go.wait)
before.start()
changed = take_idle_priority()
after = threading.Thread(target=after_go.wait)
after.start()
policies = {t: os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
before_go.set(); after_go.set(); before.join(); after.join()
print(json.dumps({"changed": changed, "policies": list(policies.values())}))
"""


def test_every_thread_takes_sched_idle_and_new_threads_inherit_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["changed"] >= 2  # the main thread and the one started before
    assert len(result["policies"]) >= 3
    assert set(result["policies"]) == {os.SCHED_IDLE}


def test_the_flag_is_off_unless_asked_for() -> None:
    parser = build_parser()
    assert parser.parse_args([]).service_idle_priority is False
    assert parser.parse_args(["--service-idle-priority"]).service_idle_priority is True
