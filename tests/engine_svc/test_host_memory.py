"""Host memory for a CPU engine: the KV cache's zeroed, pre-faulted tensors, and glibc malloc
keeping freed activation blocks."""

from __future__ import annotations

import gc

import pytest
import torch

from engine_svc.worker.host_memory import keep_freed_activations, zeroed_host_tensor


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
