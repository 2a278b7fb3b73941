"""The one-row bfloat16 GEMV (engine_svc/kernels/csrc/row_gemv.cpp) against a float64
reference: in_features with and without a partial last vector, out_features that leave rows
past the last whole vector, biases; and the projection's switch to it where torch's
bfloat16 matmul is oneDNN's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_svc.kernels import (
    cpu_kernels_available,
    onednn_linear_available,
    row_gemv_available,
    torch_bf16_matmul_is_scalar,
)
from engine_svc.kernels.loader import loaded_build
from engine_svc.layers.linear import Projection


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


def _bf16_weights(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return weight.bfloat16(), torch.randn(out_features, generator=generator).bfloat16()


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # in_features: whole vectors in fours (576, 1536), and leftovers of 1-3 vectors and a
    # partial one on AVX-512 and AVX2 (80, 200, 1000, 333, 7).
    [(576, 576), (960, 576), (100, 1536), (64, 80), (48, 200), (40, 1000), (70, 333), (5, 7)],
)
def test_one_row_multiplies_in_float32_and_rounds_once(out_features: int, in_features: int) -> None:
    weight, bias = _bf16_weights(out_features, in_features)
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    for with_bias in (None, bias):
        result = torch.ops.duoserve.row_gemv(x, weight, with_bias)
        assert result.dtype == torch.bfloat16 and result.shape == (1, out_features)
        # Products of bfloat16 values are exact in float32; float32 sums of them, rounded to
        # bfloat16 once, are within half a bfloat16 ulp (2^-8 relative) of the exact value,
        # plus the float32 sum's own rounding.
        exact = F.linear(x.double(), weight.double(), None if with_bias is None else bias.double())
        assert ((result.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
        same = (result == F.linear(x, weight, with_bias)).double().mean().item()
        assert same > 0.97, same


def test_a_bad_shape_or_dtype_is_refused_naming_the_argument() -> None:
    weight, bias = _bf16_weights(8, 16)
    x = torch.randn(1, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.duoserve.row_gemv(torch.randn(2, 16).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.duoserve.row_gemv(x.float(), weight, None)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.duoserve.row_gemv(x, weight.float(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.duoserve.row_gemv(x, weight, bias[:4])


def test_it_serves_bfloat16_only_where_neither_packed_layout_does() -> None:
    build = loaded_build()
    assert build is not None
    expected = (
        build.fast
        and not torch_bf16_matmul_is_scalar()
        and not onednn_linear_available(torch.bfloat16)
    )
    assert row_gemv_available(torch.bfloat16) == expected
    assert not row_gemv_available(torch.float32)


def test_a_projection_takes_it_for_one_row_and_torch_for_more() -> None:
    weight, bias = _bf16_weights(300, 128)
    projection = Projection(128, 300, bias=True).bfloat16()
    projection.weight.data.copy_(weight)
    projection.bias.data.copy_(bias)  # type: ignore[union-attr]
    projection.transpose()
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    before = projection(x)
    projection.use_row_gemv()
    assert projection.weight_t is None and projection.weight.shape == (300, 128)
    assert torch.equal(projection(x), F.linear(x, weight, bias))  # torch's, [out, in]
    one_row = projection(x[:1])
    assert torch.equal(one_row, torch.ops.duoserve.row_gemv(x[:1], weight, bias))
    # Torch's and the GEMV's sums, each rounded once: a bfloat16 rounding apart at most.
    gap = (one_row.double() - before[:1].double()).abs()
    assert (gap <= before[:1].double().abs() * 2**-7 + 1e-3).all()
