"""A machine of a multi-node engine other than node 0: it runs its worker ranks only.

Node 0 runs the scheduler, the executor and the gRPC service; here `python -m engine_svc
--nnodes N --node-rank R ...` (the same flags as node 0) starts this machine's ranks, which
join the others over torch.distributed and take their calls from node 0's executor over TCP.
The node exits when its workers do: 0 once node 0 shut them down, 1 if one failed (the
others are then stopped), so that an orchestrator restarts the group.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading

from engine_svc.config import EngineConfig
from engine_svc.executor.worker_spawn import remote_addresses, spawn_workers
from shared.parent_watch import stop_with_parent

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2


def run_worker_node(config: EngineConfig) -> int:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop_with_parent()
    calls, replies = remote_addresses(config)
    logger.info(
        "node %d of %d: ranks %s, calls from %s",
        config.node_rank,
        config.nnodes,
        list(config.node_ranks(config.node_rank)),
        calls,
    )
    processes = spawn_workers(config, config.master_port, calls, replies)
    try:
        return _wait(processes, stop)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _wait(processes: list[subprocess.Popen[bytes]], stop: threading.Event) -> int:
    while not stop.wait(POLL_INTERVAL_S):
        codes = [process.poll() for process in processes]
        if any(code not in (None, 0) for code in codes):
            logger.error("a worker failed (exit codes %s): stopping this node", codes)
            return 1
        if all(code == 0 for code in codes):
            logger.info("the workers are done")
            return 0
    logger.info("stopping this node's workers")
    return 0
