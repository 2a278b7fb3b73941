"""A service started by a launcher ends when the launcher ends, however it ends.

The launcher (`make run`) starts each service in a session of its own, so that Ctrl-C
reaches only the launcher; a launcher killed with -9, or a closed terminal, would then leave
both services running and holding their ports. The launcher names itself in the child's
environment (`DUOSERVE_PARENT_PID`); the service watches that process and, once it is gone,
sends itself SIGTERM: the same graceful stop as an operator's.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "DUOSERVE_PARENT_PID"
POLL_INTERVAL_S = 0.5  # where a process cannot be waited on (no pidfd): how often to look


def parent_environment() -> dict[str, str]:
    """The environment for a child that should end with this process."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


def stop_with_parent(signum: signal.Signals = signal.SIGTERM) -> None:
    """If a launcher named itself in the environment, send `signum` to this process once it
    is gone. Call after the signal's handler is installed. The variable is removed, so this
    process's own children do not watch the launcher."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value is None:
        return
    parent = int(value)
    threading.Thread(
        target=_signal_when_gone, args=(parent, signum), name="parent-watch", daemon=True
    ).start()


def _signal_when_gone(parent: int, signum: signal.Signals) -> None:
    wait_until_gone(parent)
    logger.warning("the launcher (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signum)


def wait_until_gone(parent: int) -> None:
    """Return once `parent`, this process's parent, has exited."""
    if os.getppid() != parent:
        return  # gone already: this process was handed to another parent
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        while os.getppid() == parent:
            time.sleep(POLL_INTERVAL_S)
        return
    try:
        select.select([pidfd], [], [])  # readable once the process has exited
    finally:
        os.close(pidfd)
