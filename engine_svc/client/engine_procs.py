"""Spawns one EngineCoreProc per data-parallel rank, and owns the private folder that holds
their ipc:// sockets. Clients bind the sockets first; the engines connect to them."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from multiprocessing import get_context
from multiprocessing.process import BaseProcess

from engine_svc.config import EngineConfig
from engine_svc.proc.entrypoint import run_engine_core
from engine_svc.proc.wire import EngineProcArgs, encode_proc_args

logger = logging.getLogger(__name__)


class EngineProcesses:
    def __init__(
        self,
        config: EngineConfig,
        num_ranks: int = 1,
        shutdown_timeout_s: float = 0.0,
        log_level: str = "INFO",
    ) -> None:
        if num_ranks < 1:
            raise ValueError("num_ranks must be >= 1")
        self.config = _config_for_ranks(config, num_ranks)
        self.num_ranks = num_ranks
        self.shutdown_timeout_s = shutdown_timeout_s
        self.log_level = log_level
        # mkdtemp makes the folder 0700: only this user can reach the sockets.
        self.socket_dir = tempfile.mkdtemp(prefix="duoserve-engine-")
        self.input_addresses = [f"ipc://{self.socket_dir}/input-{r}" for r in range(num_ranks)]
        self.output_address = f"ipc://{self.socket_dir}/output"
        self.processes: list[BaseProcess] = []

    def start(self) -> None:
        # spawn, not fork: a forked child would inherit the parent's threads' locks
        # (gRPC's, torch's) in whatever state they were.
        context = get_context("spawn")
        for rank in range(self.num_ranks):
            args = EngineProcArgs(
                config=self.config,
                input_address=self.input_addresses[rank],
                output_address=self.output_address,
                engine_index=rank,
                shutdown_timeout_s=self.shutdown_timeout_s,
                log_level=self.log_level,
            )
            process = context.Process(
                target=run_engine_core,
                args=(encode_proc_args(args),),
                name=f"EngineCore_{rank}",
                daemon=True,
            )
            process.start()
            logger.info("engine core %d started (pid %s)", rank, process.pid)
            self.processes.append(process)

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes]

    def exit_code(self, rank: int) -> int | None:
        process = self.processes[rank]
        process.join(timeout=0)
        return process.exitcode

    def wait(self, timeout_s: float) -> bool:
        """Wait for every engine process to exit; True if they all did in time."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
        return all(p.exitcode is not None for p in self.processes)

    def close(self) -> None:
        """Kill what still runs and remove the socket folder. Safe to call twice."""
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
            process.join(timeout=5.0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _config_for_ranks(config: EngineConfig, num_ranks: int) -> EngineConfig:
    """Ranks sharing one machine's CPU split its cores, or they would fight over them."""
    if num_ranks == 1 or config.num_threads is not None:
        return config
    num_threads = max(1, (os.cpu_count() or 1) // num_ranks)
    return dataclasses.replace(config, num_threads=num_threads)
