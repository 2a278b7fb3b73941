"""The spawned engine process's main: build the core, run its loop, and on any failure send
ENGINE_CORE_DEAD so clients fail their requests instead of waiting forever. The process that
spawns it imports this module for the target's name only: the core, and torch with it, load
in the engine process."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from engine_svc.config import EngineConfig
from engine_svc.control_messages import EngineDead, ShutdownRequest
from engine_svc.proc.engine_io import EngineIO
from engine_svc.proc.wire import OutputType, RequestType, decode_proc_args
from shared.gc_heap import startup_heap

if TYPE_CHECKING:
    from engine_svc.proc.engine_core_proc import EngineCoreProc

logger = logging.getLogger(__name__)


def run_engine_core(encoded_args: bytes) -> None:
    """Process target. Exits 0 after a requested shutdown, 1 after a failure."""
    args = decode_proc_args(encoded_args)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s engine-core-{args.engine_index} %(name)s: %(message)s",
    )
    io = EngineIO(args.input_address, args.output_address, args.engine_index)
    _install_signal_handlers(io, args.shutdown_timeout_s)
    io.start()
    _watch_parent(io)
    engine: EngineCoreProc | None = None
    exit_code = 0
    try:
        with startup_heap(f"engine core {args.engine_index}"):
            from engine_svc.proc.engine_core_proc import EngineCoreProc

            engine = EngineCoreProc(_config_for_rank(args.config, args.engine_index), io)
        engine.run_busy_loop()
    except BaseException as error:
        logger.exception("engine core %d failed", args.engine_index)
        io.send(OutputType.ENGINE_CORE_DEAD, EngineDead(f"{type(error).__name__}: {error}"))
        exit_code = 1
    finally:
        io.close()
        if engine is not None:
            engine.shutdown()
    sys.exit(exit_code)


def _install_signal_handlers(io: EngineIO, shutdown_timeout_s: float) -> None:
    # Ctrl-C reaches the whole process group: the server process decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        io.input_queue.put((RequestType.SHUTDOWN, ShutdownRequest(shutdown_timeout_s)))

    signal.signal(signal.SIGTERM, on_sigterm)


def _watch_parent(io: EngineIO) -> None:
    """If the process that spawned us dies (kill -9), abort everything and exit."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        logger.warning("the engine client's process is gone: shutting down")
        io.input_queue.put((RequestType.SHUTDOWN, ShutdownRequest(0.0)))

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _config_for_rank(config: EngineConfig, engine_index: int) -> EngineConfig:
    """Data-parallel ranks on one machine each take their own accelerator."""
    if config.device != "auto" or engine_index == 0:
        return config
    import torch

    num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_devices > 1:
        return dataclasses.replace(config, device=f"cuda:{engine_index % num_devices}")
    return config
