"""Projections over packed weights (engine_svc/kernels/csrc/packed_linear.cpp) against a
float64 reference: as close as torch's own float32 matmul, over row counts that cross the
kernel's row tiles, column counts that leave a padded last block, biases and strided
inputs; and the model's switch between torch's layout and the packed one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_svc.kernels import (
    cpu_kernels_available,
    packed_block_size,
    packed_linear_available,
    torch_bf16_matmul_is_scalar,
)
from engine_svc.kernels.loader import _cpu_flags, loaded_build
from engine_svc.layers.linear import Projection


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


def _weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    return weight, bias


def _worst_error(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> float:
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return (result.double() - exact).abs().max().item()


def _lanes() -> int:
    build = loaded_build()
    assert build is not None
    return build.lanes


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 128, 129, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (100, 576), (960, 1536)])
# On AVX-512, blocks of 2, 3 and 4 vectors take the GEMV at 1-2 rows and the register tile up
# to 128 (on AVX2 the GEMV up to 8, then brgemm); 40 columns, a width neither has code for,
# take brgemm at every row count.
@pytest.mark.parametrize("vectors", [2, 3, 4, None])
def test_packed_linear_is_as_close_as_torch_to_float64(
    rows: int, out_features: int, in_features: int, vectors: int | None
) -> None:
    block = 40 if vectors is None else vectors * _lanes()
    weight, bias = _weights(out_features, in_features)
    # x as the model can have it: rows of a wider buffer (a stride, not contiguous).
    wide = torch.randn(rows, in_features + 7, generator=torch.Generator().manual_seed(1))
    x = wide[:, :in_features]
    packed = torch.ops.duoserve.pack_linear_weight(weight, block)
    assert packed.shape == (-(-out_features // block), in_features, block)
    for with_bias in (None, bias):
        result = torch.ops.duoserve.packed_linear(x, packed, out_features, with_bias)
        assert result.shape == (rows, out_features)
        torch_error = _worst_error(F.linear(x, weight, with_bias), x, weight, with_bias)
        # Another summation order than MKL's: within a few ulps of the sums, like it.
        assert _worst_error(result, x, weight, with_bias) <= max(4 * torch_error, 2e-5)


def test_no_rows_give_an_empty_output() -> None:
    weight, _ = _weights(100, 64)
    packed = torch.ops.duoserve.pack_linear_weight(weight, 48)
    assert torch.ops.duoserve.packed_linear(torch.empty(0, 64), packed, 100, None).shape == (0, 100)


def test_packing_cuts_the_weight_into_zero_padded_column_blocks() -> None:
    weight, _ = _weights(100, 96)  # 100 = two blocks of 48 and a padded one
    packed = torch.ops.duoserve.pack_linear_weight(weight, 48)
    assert not packed[2, :, 4:].any()  # the padding is zeros
    # Block b holds columns [48 b, 48 b + 48) of x @ weight.T, as K rows of 48.
    unpacked = packed.transpose(1, 2).reshape(-1, 96)[:100]
    assert torch.equal(unpacked, weight)


def test_bfloat16_is_packed_in_pairs_of_k() -> None:
    """Each panel row holds a pair of consecutive k for every column of the block, so one
    vector load widens into two k's worth of columns; an odd in_features gets a zero k."""
    weight = _weights(100, 95)[0].bfloat16()  # 100 = two blocks of 48 and a padded one
    packed = torch.ops.duoserve.pack_linear_weight(weight, 48)
    assert packed.shape == (3, 48, 48, 2)  # [blocks, ceil(95 / 2) pairs, block, pair]
    assert not packed[2, :, 4:].any() and not packed[:, -1, :, 1].any()  # the padding
    # Block b, pair row p, column j holds weight[48 b + j, 2 p] and weight[48 b + j, 2 p + 1].
    unpacked = packed.permute(0, 2, 1, 3).reshape(-1, 96)[:100, :95]
    assert torch.equal(unpacked, weight)
    x = torch.randn(3, 95).bfloat16()
    with pytest.raises(RuntimeError, match="the weight takes 95 or 96"):
        torch.ops.duoserve.packed_linear(torch.randn(3, 97).bfloat16(), packed, 100, None)
    assert torch.ops.duoserve.packed_linear(x, packed, 100, None).shape == (3, 100)


def test_bad_inputs_raise_errors_that_name_the_problem() -> None:
    weight, bias = _weights(96, 64)
    packed = torch.ops.duoserve.pack_linear_weight(weight, 48)
    x = torch.randn(3, 64)
    cases = [
        (lambda: torch.ops.duoserve.packed_linear(x.double(), packed, 96, None), "float32"),
        (lambda: torch.ops.duoserve.packed_linear(torch.randn(3, 65), packed, 96, None), "65"),
        (lambda: torch.ops.duoserve.packed_linear(x, packed, 200, None), "out_features"),
        (lambda: torch.ops.duoserve.packed_linear(x, packed, 96, bias[:5]), "bias"),
        (lambda: torch.ops.duoserve.pack_linear_weight(weight.half(), 48), "bfloat16"),
        (lambda: torch.ops.duoserve.packed_linear(x.bfloat16(), packed, 96, None), "float32"),
    ]
    for call, words in cases:
        with pytest.raises(RuntimeError, match=words):
            call()


def test_block_size_splits_the_columns_evenly_over_the_threads() -> None:
    def size(columns: int, threads: int, lanes: int, vectors: tuple[int, ...]) -> int:
        return packed_block_size(columns, threads, lanes, vectors)

    # AVX-512: 16 lanes, 4 vectors preferred; blocks of 64, 48 or 32 columns.
    avx512 = (16, (4, 3, 2))
    assert size(576, 2, *avx512) == 48  # 12 blocks, 6 each (64: 5 and 4)
    assert size(3072, 2, *avx512) == 64
    assert size(100, 2, *avx512) == 64  # 2 blocks, one each
    assert size(576, 1, *avx512) == 64
    # AVX2: 8 lanes, 3 vectors preferred (a 4 x 3 tile); blocks of 24, 16 or 32 columns.
    avx2 = (8, (3, 2, 4))
    assert size(576, 2, *avx2) == 24  # 24 blocks, 12 each; 16 and 32 split as evenly
    assert size(200, 2, *avx2) == 16  # 13 blocks, 7 and 6 (24: 5 and 4)
    build = loaded_build()
    assert build is not None and sorted(build.block_vectors) == [2, 3, 4]
    assert packed_block_size(576) % build.lanes == 0  # this build's own


def test_a_projection_packed_in_place_of_its_transposed_weight() -> None:
    weight, bias = _weights(300, 128)
    projection = Projection(128, 300, bias=True)
    projection.weight.data.copy_(weight)
    projection.bias.data.copy_(bias)  # type: ignore[union-attr]
    projection.transpose()
    x = torch.randn(9, 128)
    expected = projection(x)

    projection.pack()
    assert projection.weight_t is None and projection.weight_packed is not None
    assert (projection(x) - expected).abs().max().item() < 1e-5


def test_a_tied_projection_keeps_the_shared_weight() -> None:
    embedding = torch.nn.Embedding(300, 64)
    head = Projection(64, 300, bias=False)
    head.weight = embedding.weight  # type: ignore[assignment]  # as a tied LM head has it
    head.shared_weight = True
    x = torch.randn(4, 64)
    expected = head(x)
    head.pack()
    assert head.weight is embedding.weight
    assert (head(x) - expected).abs().max().item() < 1e-5


def test_bfloat16_is_packed_only_where_torch_has_no_bfloat16_arithmetic() -> None:
    build = loaded_build()
    assert build is not None
    assert packed_linear_available(torch.float32) == build.fast
    assert packed_linear_available(torch.bfloat16) == (build.fast and torch_bf16_matmul_is_scalar())
    if build.fast and "avx512f" not in _cpu_flags():  # oneDNN has no bfloat16 kernel there
        assert packed_linear_available(torch.bfloat16)
    assert not packed_linear_available(torch.float16)


# One row takes a kernel of its own (widening in registers, k split over two sums): every
# block width it is compiled for, and an odd in_features for its last step.
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (100, 1536), (70, 333)])
@pytest.mark.parametrize("vectors", [2, 3, 4])
def test_bfloat16_weights_multiply_in_float32_and_round_once(
    rows: int, out_features: int, in_features: int, vectors: int
) -> None:
    weight, bias = (t.bfloat16() for t in _weights(out_features, in_features))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    packed = torch.ops.duoserve.pack_linear_weight(weight, vectors * _lanes())
    assert packed.dtype == torch.bfloat16  # half the bytes of float32 stream per step
    for with_bias in (None, bias):
        result = torch.ops.duoserve.packed_linear(x, packed, out_features, with_bias)
        assert result.dtype == torch.bfloat16 and result.shape == (rows, out_features)
        # Products of bfloat16 values are exact in float32 and float64; float32 sums of them,
        # rounded to bfloat16 once, are within half a bfloat16 ulp (2^-8 relative) of the
        # exact value, plus the float32 sum's own rounding.
        exact = F.linear(x.double(), weight.double(), None if with_bias is None else bias.double())
        assert ((result.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
        # torch's bfloat16 matmul rounds the same float32 sums: equal but where the two
        # summation orders fall either side of a rounding boundary.
        same = (result == F.linear(x, weight, with_bias)).double().mean().item()
        assert same > 0.97, same


def test_a_bfloat16_projection_with_a_bias_packs_to_the_same_outputs() -> None:
    weight, bias = (t.bfloat16() for t in _weights(300, 128))
    projection = Projection(128, 300, bias=True).bfloat16()
    projection.weight.data.copy_(weight)
    projection.bias.data.copy_(bias)  # type: ignore[union-attr]
    projection.transpose()
    x = torch.randn(9, 128).bfloat16()
    expected = projection(x).double()
    projection.pack()
    assert projection.weight_packed is not None
    assert projection.weight_packed.dtype == torch.bfloat16
    got = projection(x).double()
    assert ((got - expected).abs() <= expected.abs() * 2**-7 + 1e-3).all()


def test_an_untied_head_in_nn_linear_layout_is_packed_in_place_of_its_weight() -> None:
    weight, _ = _weights(300, 64)
    head = Projection(64, 300, bias=False)
    head.weight.data.copy_(weight)
    x = torch.randn(4, 64)
    expected = head(x)  # F.linear, as Hugging Face computes it
    head.pack()
    assert not hasattr(head, "weight")  # one copy of the weights, not two
    assert (head(x) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("vectors", [2, 3, 4])
def test_one_row_alone_gets_the_bits_it_gets_in_a_batch(vectors: int) -> None:
    """A lone request's decode step (one row: a GEMV on AVX-512 and AVX2) sums in the order a
    batch's rows are summed in (the register tile, or brgemm), so a greedy request picks the
    same tokens alone as beside others."""
    weight, bias = _weights(200, 576)
    packed = torch.ops.duoserve.pack_linear_weight(weight, vectors * _lanes())
    batch = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    for with_bias in (None, bias):
        together = torch.ops.duoserve.packed_linear(batch, packed, 200, with_bias)
        for row in range(5):
            alone = torch.ops.duoserve.packed_linear(batch[row : row + 1], packed, 200, with_bias)
            assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("vectors", [2, 3, 4])
# 1,000 columns: 8 to 32 panels, so that each of two threads' GEMV takes whole groups of
# panels side by side, and the last panel partly padding.
@pytest.mark.parametrize("out_features", [200, 1000])
def test_rows_get_the_same_bits_through_the_gemv_the_tile_and_brgemm(
    vectors: int, out_features: int
) -> None:
    """140 rows go through brgemm (past the register tile's 128 on AVX-512, past the GEMV's 8
    on AVX2); their slices through the GEMV (1-2 rows on AVX-512) and the tile (3-128): each
    sums a row in k order from zero and adds the bias last, so a request's tokens do not
    depend on how many others share its step."""
    weight, bias = _weights(out_features, 576)
    packed = torch.ops.duoserve.pack_linear_weight(weight, vectors * _lanes())
    batch = torch.randn(140, 576, generator=torch.Generator().manual_seed(4))
    for with_bias in (None, bias):
        together = torch.ops.duoserve.packed_linear(batch, packed, out_features, with_bias)
        for rows in (1, 2, 3, 8, 9, 64, 128):
            part = torch.ops.duoserve.packed_linear(batch[:rows], packed, out_features, with_bias)
            assert torch.equal(part, together[:rows]), rows


@pytest.mark.parametrize("vectors", [2, 3, 4])
def test_a_few_rows_get_the_bits_they_get_in_a_bigger_batch(vectors: int) -> None:
    """A decode step of a few requests (the GEMV over 1-8 rows on AVX2 and 1-2 on AVX-512, two
    at a time; the register tile from 3 rows on AVX-512) sums each row as a bigger batch does,
    whatever the rows' count and stride."""
    weight, bias = _weights(200, 576)
    packed = torch.ops.duoserve.pack_linear_weight(weight, vectors * _lanes())
    wide = torch.randn(20, 600, generator=torch.Generator().manual_seed(3))
    batch = wide[:, 7:583]  # rows 600 apart: the kernels read them in place
    for with_bias in (None, bias):
        together = torch.ops.duoserve.packed_linear(batch, packed, 200, with_bias)
        for rows in range(1, 12):
            for first in (0, 20 - rows):
                part = torch.ops.duoserve.packed_linear(
                    batch[first : first + rows], packed, 200, with_bias
                )
                assert torch.equal(part, together[first : first + rows]), (rows, first)
