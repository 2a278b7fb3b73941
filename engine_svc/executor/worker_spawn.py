"""Starting worker processes, on the engine's machine (MultiprocExecutor) and on the other
machines of a multi-node engine (worker_node.py), and where they reach the executor."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from engine_svc.config import EngineConfig
from engine_svc.executor.worker_wire import WorkerProcArgs, encode_proc_args

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def executor_ports(config: EngineConfig) -> tuple[int, int]:
    """Node 0's ports for workers on other machines: the calls, then the replies."""
    return config.master_port + 1, config.master_port + 2


def tcp_bind_host(config: EngineConfig) -> str:
    """Loopback stays loopback; a rendezvous address other machines use means every
    interface (the address may be a DNS name, which ZMQ cannot bind)."""
    return config.master_addr if config.master_addr in LOOPBACK else "0.0.0.0"


def remote_addresses(config: EngineConfig) -> tuple[str, str]:
    """Where a worker on another machine connects: the call broadcast and the replies."""
    calls, replies = executor_ports(config)
    return f"tcp://{config.master_addr}:{calls}", f"tcp://{config.master_addr}:{replies}"


def spawn_workers(
    config: EngineConfig, master_port: int, call_address: str, reply_address: str
) -> list[subprocess.Popen[bytes]]:
    """This machine's worker ranks, each a fresh interpreter (not a fork, nor a
    multiprocessing child: the engine-core process may itself be a daemonic multiprocessing
    child, which may have none), its arguments msgpack on stdin."""
    ranks = config.node_ranks(config.node_rank)
    # Ranks on one machine's CPU split its cores, or they would fight over them.
    num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // len(ranks))
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    processes = []
    for rank in ranks:
        args = WorkerProcArgs(
            config=config,
            rank=rank,
            call_address=call_address,
            reply_address=reply_address,
            master_port=master_port,
            parent_pid=os.getpid(),
            num_threads=num_threads,
            log_level=log_level if isinstance(log_level, str) else "INFO",
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "engine_svc.executor.worker_proc"], stdin=subprocess.PIPE
        )
        assert process.stdin is not None
        process.stdin.write(encode_proc_args(args))
        process.stdin.close()
        logger.info("worker %d started (pid %d)", rank, process.pid)
        processes.append(process)
    return processes
