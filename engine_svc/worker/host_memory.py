"""Host memory for a CPU engine: the KV cache faulted in by an idle-priority thread from
start-up on rather than by the steps, and glibc malloc told to keep the big activation
buffers it frees, in one arena.

An anonymous mmap comes as zero pages the kernel maps on first write, one fault per 4 KiB:
left lazy, the requests pay for it (a 2,048-token prefill spent 4 ms per layer in page faults
writing its K/V). MADV_POPULATE_WRITE (Linux 5.14) maps pages in the kernel. Done at
start-up, before serving, it took 1.2 s for the default 3.2 GiB on a warm machine and 6-7 s
on two threads in a fresh VM, whose host backs the guest's memory page by page. So a thread
populates the cache lowest blocks first (the block pool hands those out first), in chunks,
at SCHED_IDLE: it runs only on a core the engine leaves idle, and a step that meets a page
not yet mapped faults it in itself. At normal priority the same thread competed with the
forward for the two cores and the first batch ran a sixth slower. Where the advice is not
supported, the memory stays lazy and correct.

The KV cache stays on 4 KiB pages. On transparent huge pages (the weights' arena's
huge_page_bytes) decode attention over 64 sequences whose blocks lie in random order ran
1.2-1.5x faster in a microbenchmark, but SmolLM2's float32 batch under `bench steps`, waiting
for the cache to be mapped in first, took 25.7-30.7 s against 26.6-28.1 (three alternating
pairs of two rounds, Zen 4 VM), and mapping it in took 8 s against 1. (Why the engine gains
nothing was not measured; its pool hands out the lowest free blocks first.)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for it on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30
POPULATE_CHUNK_BYTES = 2 << 20  # per madvise call: each tensor advances this far per round
# How long an exiting process waits for a populating thread to finish its current chunk.
POPULATE_STOP_WAIT_S = 5.0


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor on an anonymous mmap, its pages not yet mapped (see `populate`)."""
    element = torch.empty((), dtype=dtype).element_size()
    num_elements = 1
    for size in shape:
        num_elements *= size
    length = max(num_elements * element, mmap.PAGESIZE)
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `region` alive as long as the tensor and its views live.
    return torch.frombuffer(region, dtype=dtype, count=num_elements).view(shape)


def populate(tensors: Sequence[torch.Tensor], stop: threading.Event | None = None) -> bool:
    """Map the pages of mmap-backed tensors (zeroed_host_tensor's), the first
    POPULATE_CHUNK_BYTES of each, then the next, and so on: the low block ids of every layer
    come first. The GIL is released during each call (ctypes). False if the kernel does not
    take the advice (the pages then come on first write) or `stop` was set."""
    madvise = libc().madvise
    longest = max((t.untyped_storage().nbytes() for t in tensors), default=0)
    for offset in range(0, longest, POPULATE_CHUNK_BYTES):
        for tensor in tensors:
            if stop is not None and stop.is_set():
                return False
            size = tensor.untyped_storage().nbytes()
            if offset < size:
                length = min(POPULATE_CHUNK_BYTES, size - offset)
                if madvise(tensor.data_ptr() + offset, length, MADV_POPULATE_WRITE) != 0:
                    logger.debug("KV cache pages stay lazy: madvise errno %d", ctypes.get_errno())
                    return False
    return True


def populate_in_background(tensors: Sequence[torch.Tensor]) -> threading.Thread:
    """`populate` on a daemon thread at idle priority, which logs how long it took. A process
    that exits first stops it between chunks and waits for it: a thread still inside
    native code while the interpreter finalizes aborted the exit ("terminate called without
    an active exception", exit status 134)."""
    tensors = list(tensors)
    logger.info(
        "KV cache faulting in: %.2f GiB in the background",
        sum(t.untyped_storage().nbytes() for t in tensors) / (1 << 30),
    )

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: normal priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        began = time.perf_counter()
        if populate(tensors, _STOP_POPULATING):
            total = sum(t.untyped_storage().nbytes() for t in tensors)
            logger.info(
                "KV cache faulted in: %.2f GiB in %.1f s",
                total / (1 << 30),
                time.perf_counter() - began,
            )

    thread = threading.Thread(target=run, name="kv-cache-populate", daemon=True)
    _populating.add(thread)
    thread.start()
    return thread


_STOP_POPULATING = threading.Event()
_populating: set[threading.Thread] = set()


def wait_populated(timeout_s: float) -> bool:
    """Until the KV caches this process populates in the background are mapped in, at most
    `timeout_s`: for a measurement that must not run beside the faulting (a benchmark's
    timed rounds). The caller's waiting leaves the cores idle, so the idle-priority threads
    get them. True if none is left populating. Caches of engine cores in other processes
    are not seen here."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_populating):
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in _populating)


@atexit.register
def _stop_populating() -> None:
    """Stop the populating threads and wait for them. Each checks the stop flag before every
    chunk; back at normal priority, it reaches the check in a moment even on a CPU that
    other processes keep busy (at idle priority beside two busy loops, one round over a
    model's layers took longer than the wait)."""
    _STOP_POPULATING.set()
    for thread in _populating:
        if thread.native_id is not None and thread.is_alive():
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setscheduler(thread.native_id, os.SCHED_OTHER, os.sched_param(0))
    deadline = time.monotonic() + POPULATE_STOP_WAIT_S
    for thread in _populating:
        thread.join(max(0.0, deadline - time.monotonic()))


@functools.cache
def libc() -> ctypes.CDLL:
    handle = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    handle.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return handle


@functools.cache
def keep_freed_activations() -> bool:
    """Serve allocations up to 32 MiB from malloc's main heap and keep what is freed there.

    By default glibc gives every block over 128 KiB (up to its adaptive limit) its own mmap
    and unmaps it on free, so each step's activations ([2,048 x 3,072] floats in a prefill)
    come back as fresh pages that fault on first write: a prefill of 16 x 128 tokens took
    2.9 s against 2.5 s with the thresholds (median of six, alternating in one process).

    The thresholds alone do not reach the model runner's thread: a thread gets an arena of
    its own, made of 64 MiB heaps that a prefill's MLP ([2,048 x 3,072] plus two halves)
    outgrows, and they kept coming back as fresh pages (2,400 faults per MLP on a thread, in
    steady state; none in the main arena once warm). The 64-prompt bench's batch took 265k-318k
    page faults and 10.0 s of prefill steps; with one arena, 22k-28k and 7.9-8.8 s.
    Hence one arena for the process; call this before the runner's thread starts. vLLM's
    CPU backend asks for tcmalloc via LD_PRELOAD for the same reasons. Process-wide: call it
    only in a process that runs the engine. True if glibc took the settings.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl): leave the allocator alone
        return False
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    # Threads that have no arena yet (the runner's, started next) share the main one.
    done = mallopt(_M_ARENA_MAX, 1) == 1 and done
    logger.info(
        "malloc keeps freed blocks up to %d MiB in one arena: %s", MMAP_THRESHOLD_BYTES >> 20, done
    )
    return done
