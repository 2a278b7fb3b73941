"""The projection weights a decode step streams, moved at load time into one region of
memory advised to transparent huge pages (MADV_HUGEPAGE).

One request's decode reads every weight once per token, so it runs at the memory's pace, and
each 4 KiB page it crosses costs a TLB miss; in a virtual machine a miss walks two page
tables (the guest's, then the host's for each of its entries). The packed weights came from
malloc's heap, a tensor here and one there, on 4 KiB pages. On the AMD EPYC Zen 1 VM (AVX2),
`python -m engine_svc.bench steps --num-prompts 1 --output-len 128 --rounds 1`, processes
alternating with the code before, three pairs: float32 decode steps 27.9, 26.7, 25.6 ms
against 28.3, 29.6, 28.4; bfloat16 16.2, 17.8, 16.0 against 18.3, 18.0, 17.3. A chain of
the 120 decoder projections from Python: 18.4 GB/s from separate tensors, 20.5 from one
region on 4 KiB pages, 22.3 on huge pages; one 512 MB weight ran at 22.7-23.0 on either.
Batches (compute-bound) were unchanged: 70.3 against 70.5 s for 64 prompts.

The region is an anonymous mmap, so the kernel gives it huge pages where transparent huge
pages are `madvise` or `always` (`never` leaves it on 4 KiB pages: the move then only costs
the copy). Each tensor is moved in place (`Tensor.set_`): whoever holds it (the C++ decode
loop's argument lists) sees the new memory. The cost is at load: mapping huge pages is slow
in a VM whose host backs them page by page (0.3-0.7 s for SmolLM2's 513 MiB in float32 on
two threads there).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from engine_svc.worker.host_memory import MADV_POPULATE_WRITE, libc

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and most aarch64 kernels' transparent huge page
ALIGNMENT = 64  # each tensor starts on a cache line, as torch's allocator starts them
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of uint8 on an anonymous mmap, starting on a huge page boundary and advised
    MADV_HUGEPAGE, its pages not yet mapped (the first write maps each 2 MiB). Where the
    advice is not taken (not Linux, an old kernel) the memory is the same, on small pages."""
    # No swap reserved for it (MAP_NORESERVE): an arena reserves more than it fills.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=flags)
    # frombuffer keeps `region` alive as long as the tensor and its views live.
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    aligned = whole[start : start + num_bytes]
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: small pages
            if libc().madvise(aligned.data_ptr(), num_bytes, MADV_HUGEPAGE) != 0:
                logger.debug("no huge pages: madvise errno %d", ctypes.get_errno())
    return aligned


def movable(tensor: torch.Tensor) -> bool:
    """A plain contiguous CPU tensor that owns all of its storage: moving its storage moves
    nothing another tensor views (oneDNN's opaque layout, views and slices stay)."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_mkldnn
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class HugePageArena:
    """Tensors moved one by one into a region on huge pages, reserved up front (address space
    only: pages are mapped as tensors land in them). Moved as each layout is made, the
    weights never need twice their memory at once; the pages they leave go back to the heap
    for the next layout. Only a movable tensor that fits the room left moves; where the
    region cannot be had (no address space), nothing moves."""

    def __init__(self, capacity_bytes: int) -> None:
        self._region: torch.Tensor | None = None
        try:
            self._region = huge_page_bytes(max(capacity_bytes, ALIGNMENT))
        except (OSError, ValueError) as error:
            logger.warning("weights stay on small pages: no region of %d bytes (%s)",
                           capacity_bytes, error)  # fmt: skip
        self._used = 0
        self._mapped = 0  # the region's bytes whose pages are mapped
        self._num_moved = 0
        self._began = time.perf_counter()

    @property
    def region(self) -> torch.Tensor | None:
        return self._region

    @property
    def used_bytes(self) -> int:
        return self._used

    def take(self, tensors: Iterable[torch.Tensor]) -> None:
        """Move each of `tensors` here, in place (Tensor.set_), in order."""
        region = self._region
        for tensor in tensors:
            num_bytes = tensor.numel() * tensor.element_size()
            # A tensor already here (a tied weight, met twice) is a view: not movable.
            if region is None or not movable(tensor) or num_bytes > region.numel() - self._used:
                continue
            self._map_pages(region, self._used + num_bytes)
            moved = region[self._used : self._used + num_bytes]
            moved = moved.view(tensor.dtype).view(tensor.shape)
            with torch.no_grad():
                moved.copy_(tensor)
                tensor.set_(
                    moved.untyped_storage(), moved.storage_offset(), moved.shape, moved.stride()
                )
            self._num_moved += 1
            self._used += -(-num_bytes // ALIGNMENT) * ALIGNMENT

    def _map_pages(self, region: torch.Tensor, end: int) -> None:
        """Map the region's pages up to `end` before a copy writes them, on as many threads
        as torch runs (MADV_POPULATE_WRITE): in the Zen 1 VM, faulting 512 MiB of huge pages
        took 0.9 s on one thread, 0.28 s on two, and torch's copy faulting them 0.6 s."""
        end = min(-(-end // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, region.numel())
        if end <= self._mapped:
            return
        start = region.data_ptr() + self._mapped
        num_pages = (end - self._mapped) // HUGE_PAGE_BYTES
        parts = max(1, min(torch.get_num_threads(), num_pages))
        bounds = [start + (num_pages * i // parts) * HUGE_PAGE_BYTES for i in range(parts + 1)]
        bounds[-1] = region.data_ptr() + end
        populate_ranges(list(itertools.pairwise(bounds)))
        self._mapped = end

    def finish(self) -> None:
        """Give the heap's freed copies back to the system and say what moved."""
        if self._num_moved == 0:
            return
        _release_freed()
        logger.info(
            "%d weights (%.1f MiB) on one region advised to huge pages, %.2f s "
            "(transparent huge pages: %s)",
            self._num_moved,
            self._used / (1 << 20),
            time.perf_counter() - self._began,
            thp_mode(),
        )


def populate_ranges(ranges: list[tuple[int, int]]) -> None:
    """Map the pages of each (start, end) address range, one thread each (ctypes lets go of
    the GIL). Where the advice is not taken, the pages come on first write instead."""
    if not sys.platform.startswith("linux"):
        return

    def populate(start: int, end: int) -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc().madvise(start, end - start, MADV_POPULATE_WRITE)

    threads = [threading.Thread(target=populate, args=bounds) for bounds in ranges[1:]]
    for thread in threads:
        thread.start()
    if ranges:
        populate(*ranges[0])
    for thread in threads:
        thread.join()


def thp_mode() -> str:
    """The system's transparent huge page mode (`always`, `madvise`, `never`), or `unknown`."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def _release_freed() -> None:
    """Give the pages of the freed copies back (glibc keeps up to its trim threshold, which
    the engine raises to 1 GiB for its activations)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        libc().malloc_trim(0)
