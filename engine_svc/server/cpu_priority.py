"""The engine service's own threads at SCHED_IDLE (`--service-idle-priority`): on a CPU
engine sharing a few cores with its service, they then run only on a core the engine core
leaves idle, instead of preempting one of the model's threads when a step's outputs arrive.

The model's OpenMP threads advance together, so a thread preempted for the service's work
holds the other at its next barrier. On the 2-core Xeon with AMX, bfloat16, 64 streams at one
token a message (`python -m engine_svc.bench serve --dtype bfloat16 --max-concurrency 64
--against-offline`), alternating: serve/offline 0.92x and 0.93x with the service's threads
at SCHED_IDLE against 0.78x and 0.79x; SCHED_BATCH (no wakeup preemption, same weight)
0.77x-0.82x, the frontend at SCHED_IDLE 0.79x-0.80x, `renice 10` no change. The engine core
is started first and keeps the normal policy (a process inherits its parent's). The price:
under a machine kept busy by other work the service's threads wait for an idle core, so
this is off unless asked for."""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger(__name__)


def take_idle_priority() -> int:
    """Every thread of this process to SCHED_IDLE; threads started later inherit it from
    the thread that starts them, processes from their parent. How many threads changed; 0
    where the OS has no SCHED_IDLE (not Linux)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        logger.warning("--service-idle-priority: no SCHED_IDLE on this OS; priority unchanged")
        return 0
    changed = 0
    for entry in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setscheduler(int(entry), policy, os.sched_param(0))
            changed += 1
    logger.info("engine service: %d threads at SCHED_IDLE", changed)
    return changed
