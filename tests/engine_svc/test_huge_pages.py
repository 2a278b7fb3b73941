"""The huge-page arena a CPU engine moves its decode weights into: tensors moved in place
(whoever holds them sees the new memory), only those that own their storage, each once; the
region advised to huge pages and its pages mapped before the copies."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from engine_svc.worker.huge_pages import HUGE_PAGE_BYTES, HugePageArena, huge_page_bytes

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _in_region(tensor: torch.Tensor, arena: HugePageArena) -> bool:
    region = arena.region
    assert region is not None
    start = region.data_ptr()
    return start <= tensor.data_ptr() < start + region.numel()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_pages(address: int, size: int) -> int:
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(address, size, vector) == 0
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_tensors_move_in_place_with_their_values(dtype: torch.dtype) -> None:
    tensors = [torch.arange(n * 7, dtype=torch.float32).view(n, 7).to(dtype) for n in (5, 300, 1)]
    expected = [t.clone() for t in tensors]
    held = list(tensors)  # as the C++ decode loop's argument lists hold them
    arena = HugePageArena(1 << 20)
    arena.take(tensors)
    arena.finish()
    for tensor, holder, values in zip(tensors, held, expected, strict=True):
        assert holder is tensor and _in_region(holder, arena)
        assert tensor.dtype == dtype and tensor.shape == values.shape
        assert torch.equal(tensor, values)
        assert tensor.data_ptr() % 64 == 0  # on a cache line, as torch's allocator puts them
    # One region, filled in the order given.
    pointers = [t.data_ptr() for t in tensors]
    assert pointers == sorted(pointers)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    tensors[1].add_(1)  # still a tensor of its own: writes land in its own bytes only
    assert torch.equal(tensors[0], expected[0]) and torch.equal(tensors[2], expected[2])


def test_only_tensors_that_own_their_storage_move() -> None:
    base = torch.randn(64, 64)
    view = base[8:16]  # a slice: moving it would leave `base` behind
    transposed = torch.randn(64, 32).t()
    mkldnn = torch.randn(16, 16).to_mkldnn() if torch.backends.mkldnn.is_available() else None
    kept = {id(t): t.data_ptr() for t in (base, view, transposed)}
    arena = HugePageArena(1 << 20)
    arena.take([view, transposed] + ([mkldnn] if mkldnn is not None else []))
    for tensor in (view, transposed):
        assert tensor.data_ptr() == kept[id(tensor)]
    assert base.data_ptr() == kept[id(base)]


def test_a_tensor_met_twice_moves_once() -> None:
    tied = torch.randn(100, 10)
    values = tied.clone()
    arena = HugePageArena(1 << 20)
    arena.take([tied])
    first = tied.data_ptr()
    arena.take([tied])  # the LM head tied to the embeddings comes again
    assert tied.data_ptr() == first and torch.equal(tied, values)


def test_a_tensor_past_the_room_left_stays_and_smaller_ones_still_move() -> None:
    arena = HugePageArena(4096)
    big, small = torch.randn(2048), torch.randn(16)  # 8 KiB, then 64 bytes
    before = big.data_ptr()
    arena.take([big, small])
    assert big.data_ptr() == before
    assert _in_region(small, arena)


def test_no_region_leaves_every_tensor_where_it_is() -> None:
    arena = HugePageArena(1 << 52)  # 4 PiB: more than x86-64's or aarch64's address space
    assert arena.region is None
    tensor = torch.randn(32)
    before = tensor.data_ptr()
    arena.take([tensor])
    arena.finish()
    assert tensor.data_ptr() == before


@linux_only
def test_the_region_is_advised_to_huge_pages_on_a_huge_page_boundary() -> None:
    region = huge_page_bytes(3 * HUGE_PAGE_BYTES)
    assert region.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(region.data_ptr())  # MADV_HUGEPAGE taken for this mapping


@linux_only
def test_the_pages_a_copy_writes_are_mapped_before_it() -> None:
    arena = HugePageArena(8 * HUGE_PAGE_BYTES)
    region = arena.region
    assert region is not None
    assert _resident_pages(region.data_ptr(), region.numel()) == 0
    tensor = torch.ones(HUGE_PAGE_BYTES // 4 + 1)  # a little over one huge page
    arena.take([tensor])
    mapped = _resident_pages(region.data_ptr(), 2 * HUGE_PAGE_BYTES)
    assert mapped == 2 * HUGE_PAGE_BYTES // mmap.PAGESIZE  # both pages the tensor touches
    assert _resident_pages(region.data_ptr() + 2 * HUGE_PAGE_BYTES, HUGE_PAGE_BYTES) == 0
