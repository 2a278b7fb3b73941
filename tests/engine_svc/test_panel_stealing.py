"""The projections hand their panels out as a static split would, and a thread that
finishes its own takes the rest of another's (engine_svc/kernels/csrc/stealing.h). Whichever
thread computes a panel, and however many threads there are, the output is the one a single
thread gives, bit for bit: every panel computed once, none left out (the outputs start as
uninitialised memory). More threads than cores make threads lose their core mid-region, so
the others take over their panels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from engine_svc.kernels import (
    bf16_pairs_available,
    cpu_kernels_available,
    packed_block_size,
    packed_linear_available,
)

CALLS = 20  # per thread count: threads lose their cores at other points each time


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _same_bits_over_thread_counts(compute: Callable[[], torch.Tensor]) -> None:
    torch.set_num_threads(1)
    alone = compute()
    for threads in (2, 3, 5):
        torch.set_num_threads(threads)
        for _ in range(CALLS):
            assert torch.equal(compute(), alone), f"{threads} threads"


def _operands(
    rows: int, out_features: int, in_features: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows + out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(dtype)
    return x, weight


@pytest.mark.skipif(
    not bf16_pairs_available(torch.bfloat16), reason="needs AVX512-BF16 and a build with it"
)
# 1 row: the dot products; 64: AMX's tiles where the build has them. 7 and 30 panels, an odd
# count and one that 3 and 5 threads do not divide evenly.
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("out_features", [224, 960])
@pytest.mark.usefixtures("restore_threads")
@torch.inference_mode()
def test_bfloat16_pairs_give_one_thread_s_bits_whoever_takes_a_panel(
    rows: int, out_features: int
) -> None:
    x, weight = _operands(rows, out_features, 576, torch.bfloat16)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    gate_up = torch.ops.duoserve.pack_bf16_gate_up_pairs(weight)
    _same_bits_over_thread_counts(
        lambda: torch.ops.duoserve.bf16_pairs_linear(x, packed, out_features, None)
    )
    _same_bits_over_thread_counts(
        lambda: torch.ops.duoserve.bf16_pairs_silu_mul(x, gate_up, out_features, None)
    )


@pytest.mark.skipif(
    not packed_linear_available(torch.float32), reason="needs the packed projections"
)
# 1 row: the one-row kernel where the build has it; 64: the register tile.
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("out_features", [100, 960])
@pytest.mark.usefixtures("restore_threads")
@torch.inference_mode()
def test_float32_panels_give_one_thread_s_bits_whoever_takes_a_panel(
    rows: int, out_features: int
) -> None:
    x, weight = _operands(rows, out_features, 576, torch.float32)
    packed = torch.ops.duoserve.pack_linear_weight(weight, packed_block_size(out_features))
    _same_bits_over_thread_counts(
        lambda: torch.ops.duoserve.packed_linear(x, packed, out_features, None)
    )


@pytest.mark.skipif(
    not packed_linear_available(torch.float32), reason="needs the packed projections"
)
# brgemm's path: 300 rows are two row tiles (256 and 44), and more than the register tile
# takes on any level. bfloat16 weights where they go through it too (torch's bfloat16 matmul
# scalar): each panel widened by whichever thread takes it. With a bias: C starts as it.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("restore_threads")
@torch.inference_mode()
def test_brgemm_row_tiles_give_one_thread_s_bits_whoever_takes_a_panel(
    dtype: torch.dtype,
) -> None:
    if not packed_linear_available(dtype):
        pytest.skip(f"{dtype} projections are not packed on this machine")
    out_features = 960
    x, weight = _operands(300, out_features, 576, dtype)
    bias = (torch.arange(out_features, dtype=torch.float32) / out_features).to(dtype)
    packed = torch.ops.duoserve.pack_linear_weight(weight, packed_block_size(out_features))
    _same_bits_over_thread_counts(
        lambda: torch.ops.duoserve.packed_linear(x, packed, out_features, bias)
    )
