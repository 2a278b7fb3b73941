"""Host memory for a CPU engine: the KV cache's zeroed tensors, their pages faulted in by a
background thread, lowest offsets first, and glibc malloc keeping freed activation blocks."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import threading

import pytest
import torch

from engine_svc.worker import host_memory
from engine_svc.worker.host_memory import (
    keep_freed_activations,
    populate,
    populate_in_background,
    wait_populated,
    zeroed_host_tensor,
)


def _resident_pages(tensor: torch.Tensor) -> int:
    """Pages of the tensor's storage mapped in memory now (mincore)."""
    size = tensor.untyped_storage().nbytes()
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(tensor.data_ptr(), size, vector) == 0
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_host_tensor_is_zero_writable_and_outlives_its_region(dtype: torch.dtype) -> None:
    shape = (37, 16, 3, 64)  # not a whole number of pages
    cache = zeroed_host_tensor(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    view = cache.view(-1, 3 * 64)
    del cache
    gc.collect()  # only the view holds the mmap now
    view[-1] = 1.5
    view[0, 0] = -2.0
    assert view.sum().item() == pytest.approx(1.5 * 3 * 64 - 2.0)


def test_tiny_tensor_still_gets_a_page() -> None:
    assert zeroed_host_tensor((1,), torch.float32).tolist() == [0.0]


def test_malloc_keeps_freed_activations_on_glibc() -> None:
    assert keep_freed_activations()  # this machine's Python runs on glibc
    # Allocations of activation size still work and are fresh and correct afterwards.
    x = torch.ones(2048, 3072)
    assert x.sum().item() == 2048 * 3072


def test_pages_are_mapped_when_populated_lowest_offsets_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_memory, "POPULATE_CHUNK_BYTES", 64 * mmap.PAGESIZE)
    tensors = [zeroed_host_tensor((256, mmap.PAGESIZE // 4), torch.float32) for _ in range(3)]
    assert [_resident_pages(t) for t in tensors] == [0, 0, 0]  # lazy until populated
    calls: list[tuple[int, int]] = []
    libc_madvise = host_memory.libc().madvise

    def recording(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        return int(libc_madvise(address, length, advice))

    monkeypatch.setattr(host_memory, "libc", lambda: type("L", (), {"madvise": recording}))
    assert populate(tensors)
    assert [_resident_pages(t) for t in tensors] == [256, 256, 256]
    # Round by round: the first 64 pages of every tensor, then the next 64, ...
    firsts = [t.data_ptr() for t in tensors]
    assert [address for address, _ in calls[:3]] == firsts
    assert calls[3][0] == firsts[0] + 64 * mmap.PAGESIZE and len(calls) == 12
    assert all(not t.any() for t in tensors)  # still zeros


def test_populating_in_the_background_maps_every_page_at_idle_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policies: list[int] = []
    populate_now = host_memory.populate

    def recording(tensors: list[torch.Tensor], stop: threading.Event | None = None) -> bool:
        policies.append(os.sched_getscheduler(0))  # this thread's
        return populate_now(tensors, stop)

    monkeypatch.setattr(host_memory, "populate", recording)
    tensors = [zeroed_host_tensor((100, 3, 1000), torch.float32) for _ in range(2)]
    populate_in_background(tensors).join(timeout=60)
    assert policies == [os.SCHED_IDLE]  # it runs only on a core the engine leaves idle
    assert all(_resident_pages(t) == -(-t.untyped_storage().nbytes() // mmap.PAGESIZE)
               for t in tensors)  # fmt: skip


def test_waiting_for_the_background_population_returns_once_every_page_is_mapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a benchmark does before its timed rounds. The population is held at its first
    chunk until the test lets it go, so the waits see it unfinished, then finished."""
    go = threading.Event()
    populate_now = host_memory.populate

    def held(tensors: list[torch.Tensor], stop: threading.Event | None = None) -> bool:
        assert go.wait(timeout=60)
        return populate_now(tensors, stop)

    monkeypatch.setattr(host_memory, "populate", held)
    tensors = [zeroed_host_tensor((100, 3, 1000), torch.float32) for _ in range(2)]
    thread = populate_in_background(tensors)
    assert wait_populated(0.0) is False  # held: still populating, the wait bounded
    assert _resident_pages(tensors[0]) == 0
    go.set()
    assert wait_populated(60.0) is True
    assert not thread.is_alive()
    assert all(_resident_pages(t) == -(-t.untyped_storage().nbytes() // mmap.PAGESIZE)
               for t in tensors)  # fmt: skip


def test_a_stopped_population_ends_between_chunks() -> None:
    """What an exiting process does (host_memory's atexit hook): set the event, and the
    thread ends after the chunk in progress, leaving the rest lazy."""
    stop = threading.Event()
    stop.set()
    tensors = [zeroed_host_tensor((100, 3, 1000), torch.float32)]
    assert populate(tensors, stop) is False
    assert _resident_pages(tensors[0]) == 0


def test_a_stop_during_a_round_ends_it_after_the_chunk_in_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round covers every tensor (two per layer): the flag is checked before each chunk,
    not each round, so a thread starved of CPU still stops within one madvise call."""
    stop = threading.Event()
    calls: list[int] = []
    madvise = host_memory.libc().madvise

    class StopsAfterOneChunk:
        def madvise(self, address: int, length: int, advice: int) -> int:
            calls.append(address)
            stop.set()
            return int(madvise(address, length, advice))

    monkeypatch.setattr(host_memory, "libc", StopsAfterOneChunk)
    tensors = [zeroed_host_tensor((4, 1000), torch.float32) for _ in range(48)]
    assert populate(tensors, stop) is False
    assert len(calls) == 1
    assert [_resident_pages(t) > 0 for t in tensors] == [True] + [False] * 47


def test_the_exit_hook_puts_a_starved_populating_thread_back_to_normal_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At exit, the idle-priority thread gets the CPU back so it reaches its stop check."""
    at_idle, release = threading.Event(), threading.Event()

    def run() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        at_idle.set()
        release.wait(60)

    monkeypatch.setattr(host_memory, "POPULATE_STOP_WAIT_S", 0.0)  # the thread is blocked
    thread = threading.Thread(target=run)
    monkeypatch.setattr(host_memory, "_populating", {thread})
    try:
        thread.start()
        assert at_idle.wait(60)
        assert os.sched_getscheduler(thread.native_id or 0) == os.SCHED_IDLE
        host_memory._stop_populating()
        assert os.sched_getscheduler(thread.native_id or 0) == os.SCHED_OTHER
    finally:
        host_memory._STOP_POPULATING.clear()
        release.set()
        thread.join(60)
