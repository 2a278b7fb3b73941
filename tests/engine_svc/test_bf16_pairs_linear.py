"""bfloat16 projections over weights packed in pairs of k (engine_svc/kernels/csrc/
bf16_pairs_linear.cpp), on AVX512-BF16 and, from 4 rows, AMX's tiles: float32 sums rounded
once, so each output is the float64 product's bfloat16 rounding or a unit beside it, and
nearly all of them are F.linear's (oneDNN's) bit for bit; and the engine takes the path
exactly where the CPU has those dot products, on an AMX CPU only in a build with its tiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_svc.kernels import bf16_pairs_available, cpu_kernels_available
from engine_svc.kernels.loader import _cpu_flags, loaded_build
from engine_svc.layers.linear import PAIRS_MAX_ROWS, PAIRS_PATH, PAIRS_SILU_PATH, Projection

needs_pairs = pytest.mark.skipif(
    not bf16_pairs_available(torch.bfloat16),
    reason="the pairs kernel needs AVX512-BF16, a build with its dot products and, on a CPU "
    "with AMX, with AMX's tiles",
)


def _operands(
    rows: int, out_features: int, in_features: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).bfloat16()
    bias_value = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    return x, weight, bias_value


@needs_pairs
# 1-3 rows: the dot products; from 4, AMX's tiles where the build has them (whole tiles of 16
# rows, a partial one, two row tiles a pass and a lone one).
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 16, 33, 64, 130])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
# The last two: a last panel of 6 and of 26 columns (under and over a half of 16) where k
# is in whole AMX tiles.
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(960, 576), (576, 1536), (70, 334), (70, 352), (90, 320)]
)
@torch.inference_mode()
def test_outputs_are_the_rounded_float32_sums(
    rows: int, bias: bool, out_features: int, in_features: int
) -> None:
    x, weight, bias_value = _operands(rows, out_features, in_features, bias)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    got = torch.ops.duoserve.bf16_pairs_linear(x, packed, out_features, bias_value)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = x.double() @ weight.double().T
    if bias_value is not None:
        exact = exact + bias_value.double()
    rounded = exact.bfloat16()
    # Within the final rounding (half a unit: 2^-8 relative) and the float32 sums' error
    # (at most in_features units of 2^-24 of the summed magnitudes).
    magnitudes = x.double().abs() @ weight.double().abs().T
    bound = exact.abs() * 2**-8 + magnitudes * in_features * 2**-24
    assert ((got.double() - exact).abs() <= bound).all()
    assert (got == rounded).double().mean().item() > 0.99
    # oneDNN sums in another order now and then: nearly every output is its bit for bit.
    assert (got == F.linear(x, weight, bias_value)).double().mean().item() > 0.999
    # Rows of a wider buffer (a strided view) read as the same values.
    wide = torch.zeros(rows, in_features * 2, dtype=torch.bfloat16)
    wide[:, :in_features] = x
    strided = torch.ops.duoserve.bf16_pairs_linear(
        wide[:, :in_features], packed, out_features, bias_value
    )
    assert torch.equal(strided, got)


@needs_pairs
@torch.inference_mode()
def test_bad_operands_are_refused() -> None:
    x, weight, _ = _operands(3, 40, 64, bias=False)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    with pytest.raises(RuntimeError, match="in_features must be even"):
        torch.ops.duoserve.pack_bf16_pairs(torch.zeros(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.duoserve.bf16_pairs_linear(x[:, :62], packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.duoserve.bf16_pairs_linear(x, packed, 80, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.duoserve.bf16_pairs_linear(x.float(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.duoserve.bf16_pairs_linear(x, packed, 40, torch.zeros(39, dtype=torch.bfloat16))
    empty = torch.ops.duoserve.bf16_pairs_linear(x[:0], packed, 40, None)
    assert empty.shape == (0, 40)


@needs_pairs
@torch.inference_mode()
def test_a_projection_packs_once_and_keeps_a_tied_weight() -> None:
    x, weight, bias_value = _operands(7, 96, 64, bias=True)
    projection = Projection(64, 96, bias=True).bfloat16()
    projection.weight.data.copy_(weight)
    assert projection.bias is not None
    projection.bias.data.copy_(bias_value)
    projection.transpose()  # as the model stores it after loading
    projection.use_bf16_pairs()
    assert projection.weight_pairs is not None and projection.weight_t is None
    assert not hasattr(projection, "weight")
    assert projection.kernel_args()[1] == [PAIRS_PATH, 96]
    expected = torch.ops.duoserve.bf16_pairs_linear(
        x, torch.ops.duoserve.pack_bf16_pairs(weight), 96, bias_value
    )
    assert torch.equal(projection(x), expected)

    tied = Projection(64, 96, bias=False).bfloat16()
    tied.weight.data.copy_(weight)
    tied.shared_weight = True
    tied.use_bf16_pairs()
    assert torch.equal(tied.weight, weight)  # the embeddings stay
    assert (tied(x) == F.linear(x, weight)).double().mean().item() > 0.99


@needs_pairs
# Rows as above: the dot products' epilogue, AMX's, partial row tiles; widths of one panel,
# three, and an MLP's.
@pytest.mark.parametrize("rows", [1, 3, 4, 13, 33, 64, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("width", "in_features"), [(16, 64), (48, 96), (1536, 576)])
@torch.inference_mode()
def test_gate_up_pairs_store_silu_of_gate_times_up_bit_for_bit(
    rows: int, bias: bool, width: int, in_features: int
) -> None:
    x, weight, bias_value = _operands(rows, 2 * width, in_features, bias)
    x = x * 4  # gate values out to where silu is ~0 and ~identity
    plain = torch.ops.duoserve.bf16_pairs_linear(
        x, torch.ops.duoserve.pack_bf16_pairs(weight), 2 * width, bias_value
    )
    fused = torch.ops.duoserve.pack_bf16_gate_up_pairs(weight)
    got = torch.ops.duoserve.bf16_pairs_silu_mul(x, fused, 2 * width, bias_value)
    expected = torch.ops.duoserve.silu_and_mul(plain)
    assert got.shape == (rows, width)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # -0 too


@needs_pairs
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
# Panels a thread takes four at a time and the rest one by one: 3, 16, 30 and 48 panels, the
# last of 6 columns in the first two (in the second, inside a group of four with 2 threads).
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(70, 334), (486, 576), (960, 576), (1536, 90)]
)
@torch.inference_mode()
def test_one_row_alone_gets_the_bits_it_gets_in_a_batch(
    bias: bool, out_features: int, in_features: int
) -> None:
    """A lone request's decode step (one row: four panels side by side) sums each output
    as the dot-product tile does a batch's rows (under 4 rows on AMX), so a greedy request
    picks the same tokens alone as beside others; silu(gate) * up's pairs too."""
    x, weight, bias_value = _operands(3, out_features, in_features, bias)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    together = torch.ops.duoserve.bf16_pairs_linear(x, packed, out_features, bias_value)
    fused = torch.ops.duoserve.pack_bf16_gate_up_pairs(weight) if out_features % 32 == 0 else None
    for row in range(3):
        alone = torch.ops.duoserve.bf16_pairs_linear(
            x[row : row + 1], packed, out_features, bias_value
        )
        assert torch.equal(alone.view(torch.int16), together[row : row + 1].view(torch.int16))
        if fused is not None:
            gate_up = torch.ops.duoserve.bf16_pairs_silu_mul(
                x[row : row + 1], fused, out_features, bias_value
            )
            expected = torch.ops.duoserve.bf16_pairs_silu_mul(x, fused, out_features, bias_value)
            assert torch.equal(gate_up.view(torch.int16), expected[row : row + 1].view(torch.int16))


@needs_pairs
@torch.inference_mode()
def test_gate_up_pairs_refuse_halves_of_a_partial_panel() -> None:
    x, weight, _ = _operands(3, 40, 64, bias=False)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.duoserve.pack_bf16_gate_up_pairs(weight)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.duoserve.bf16_pairs_silu_mul(x, packed, 40, None)


@needs_pairs
@torch.inference_mode()
def test_an_mlp_s_gate_up_on_silu_pairs_computes_silu_and_mul_only() -> None:
    x, weight, _ = _operands(PAIRS_MAX_ROWS + 44, 64, 96, bias=False)
    expected = torch.ops.duoserve.silu_and_mul(F.linear(x, weight))
    for onednn_copy in (False, True):
        projection = Projection(96, 64, bias=False).bfloat16()
        projection.weight.data.copy_(weight)
        projection.transpose()
        projection.use_bf16_pairs(onednn_copy=onednn_copy, silu_halves=True)
        assert projection.silu_pairs
        assert projection.kernel_args()[1] == [PAIRS_SILU_PATH, 64]
        decode = x[:PAIRS_MAX_ROWS]
        got = projection.silu_and_mul(decode)
        assert (got == expected[:PAIRS_MAX_ROWS]).double().mean().item() > 0.99
        with pytest.raises(RuntimeError, match="silu_and_mul"):
            projection(decode)  # its output would be gate and up interleaved
        if onednn_copy:  # prompts: oneDNN's copy, then the separate pass
            assert torch.equal(
                projection.silu_and_mul(x)[PAIRS_MAX_ROWS:], expected[PAIRS_MAX_ROWS:]
            )
    odd = Projection(96, 40, bias=False).bfloat16()  # halves of 20: plain pairs
    odd.weight.data.copy_(weight[:40])
    odd.transpose()
    odd.use_bf16_pairs(silu_halves=True)
    assert not odd.silu_pairs and odd.kernel_args()[1] == [PAIRS_PATH, 40]
    assert torch.equal(odd.silu_and_mul(x[:8]), torch.ops.duoserve.silu_and_mul(odd(x[:8])))


def test_the_path_is_taken_where_the_cpu_has_bf16_dot_products_and_on_amx_its_tiles() -> None:
    build = loaded_build() if cpu_kernels_available() else None
    amx = torch.cpu._is_amx_tile_supported()
    expected = (
        build is not None
        and build.fast
        and build.bf16_dot_products
        and "avx512_bf16" in _cpu_flags()
        and (build.amx_tiles or not amx)
    )
    assert bf16_pairs_available(torch.bfloat16) == expected
    assert not bf16_pairs_available(torch.float32)
    if build is not None and build.level == "native" and build.bf16_dot_products:
        # -march=native on an AMX CPU compiles the tiles in (gcc 11 and later).
        assert build.amx_tiles == ({"amx_tile", "amx_bf16"} <= _cpu_flags())


@needs_pairs
@pytest.mark.skipif(
    loaded_build() is None or not loaded_build().amx_tiles,  # type: ignore[union-attr]
    reason="AMX's tiles need an AMX CPU and a build with them",
)
@torch.inference_mode()
def test_amx_rows_are_the_dot_products_rows_but_for_a_unit_here_and_there() -> None:
    # Both sum the pairs in float32 in k order; AMX rounds inside a pair otherwise now and then.
    x, weight, bias_value = _operands(64, 960, 576, bias=True)
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    tiles = torch.ops.duoserve.bf16_pairs_linear(x, packed, 960, bias_value)
    rows = torch.cat(
        [
            torch.ops.duoserve.bf16_pairs_linear(x[i : i + 1], packed, 960, bias_value)
            for i in range(64)
        ]
    )
    differ = tiles != rows
    assert differ.double().mean().item() < 1e-3
    units = (tiles.float() - rows.float()).abs() / rows.float().abs().clamp_min(2**-100)
    assert (units[differ] <= 2**-7).all()  # one bfloat16 unit apart


@needs_pairs
@torch.inference_mode()
def test_with_onednn_s_copy_prompts_take_onednn_and_decode_rows_the_pairs() -> None:
    x, weight, bias_value = _operands(PAIRS_MAX_ROWS + 44, 96, 64, bias=True)
    projection = Projection(64, 96, bias=True).bfloat16()
    projection.weight.data.copy_(weight)
    assert projection.bias is not None
    projection.bias.data.copy_(bias_value)
    projection.transpose()
    projection.use_bf16_pairs(onednn_copy=True)
    assert projection.weight_pairs is not None and projection.weight_onednn is not None
    assert projection.kernel_args()[1] == [PAIRS_PATH, 96]  # the decode loop's
    packed = torch.ops.duoserve.pack_bf16_pairs(weight)
    decode = x[:PAIRS_MAX_ROWS]
    expected = torch.ops.duoserve.bf16_pairs_linear(decode, packed, 96, bias_value)
    assert torch.equal(projection(decode), expected)
    assert torch.equal(projection(x), F.linear(x, weight, bias_value))  # oneDNN's, bit for bit


@needs_pairs
@pytest.mark.parametrize("limit", [0, 1 << 30], ids=["over-the-limit", "within"])
def test_a_model_keeps_onednn_s_copy_for_prompts_only_within_the_limit(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    from engine_svc import LLM, SamplingParams
    from engine_svc.models import fast_paths

    monkeypatch.setattr(fast_paths, "ONE_ROW_COPY_MAX_BYTES", limit)
    llm = LLM(str(tiny_model_dir), dtype="bfloat16")
    try:
        model = llm.engine_core.executor.runner.model
        projections = [m for m in model.modules() if isinstance(m, Projection)]
        assert all(p.weight_pairs is not None for p in projections)
        assert all((p.weight_onednn is not None) == (limit > 0) for p in projections)
        assert not any(p.row_gemv for p in projections)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        (output,) = llm.generate([list(range(3, 3 + PAIRS_MAX_ROWS + 20))], params)
        assert len(output.token_ids) == 4
    finally:
        llm.shutdown()
