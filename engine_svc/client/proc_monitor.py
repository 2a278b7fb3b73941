"""A thread that sleeps on the engine processes' sentinels and reports each exit at once,
so a kill -9 of an engine fails its requests instead of leaving them waiting forever."""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import cast

ExitCallback = Callable[[int, int | None], None]  # (rank, exit code)


class ProcessMonitor:
    def __init__(self, processes: list[BaseProcess], on_exit: ExitCallback) -> None:
        self._processes = processes
        self._on_exit = on_exit
        # Writing to this pipe wakes the thread so that stop() need not wait for an exit.
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="engine-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._wake_write < 0:
            return
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5.0)
        os.close(self._wake_write)
        os.close(self._wake_read)
        self._wake_write = self._wake_read = -1

    def _run(self) -> None:
        pending = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while pending:
            ready = multiprocessing.connection.wait([*pending, self._wake_read])
            if self._wake_read in ready:
                return
            for sentinel in ready:
                rank = pending.pop(cast(int, sentinel))  # sentinels are file descriptors
                process = self._processes[rank]
                process.join(timeout=1.0)  # reap it, so its exit code is known
                self._on_exit(rank, process.exitcode)
