"""bfloat16 projections on weights prepacked in oneDNN's blocked layout
(`Projection.use_onednn`), where torch's bfloat16 matmul is oneDNN's and the CPU has
bfloat16 arithmetic (AMX or AVX512-BF16):
the results are F.linear's bit for bit, at decode's and prefill's row counts, and the
engine chooses that layout exactly there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_svc.kernels import (
    one_row_copy_available,
    onednn_linear_available,
    packed_linear_available,
    row_gemv_available,
    torch_bf16_matmul_is_scalar,
)
from engine_svc.kernels.loader import _cpu_flags
from engine_svc.layers.linear import Projection

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_linear_available(torch.bfloat16),
    reason="the engine takes this path only where oneDNN runs bfloat16 on AMX or AVX512-BF16",
)


def _projection(out_features: int, in_features: int, bias: bool) -> Projection:
    generator = torch.Generator().manual_seed(out_features + in_features)
    projection = Projection(in_features, out_features, bias=bias).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    projection.weight.data.copy_(weight)
    if projection.bias is not None:
        projection.bias.data.copy_(torch.randn(out_features, generator=generator))
    return projection


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (70, 333)])
@torch.inference_mode()
def test_prepacked_results_are_f_linear_bit_for_bit(
    rows: int, bias: bool, out_features: int, in_features: int
) -> None:
    projection = _projection(out_features, in_features, bias)
    weight = projection.weight.detach().clone()
    bias_value = None if projection.bias is None else projection.bias.detach().clone()
    projection.transpose()  # as the model stores it after loading
    projection.use_onednn()
    assert projection.weight_t is None and not hasattr(projection, "weight")
    assert projection.weight_onednn is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = projection(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, F.linear(x, weight, bias_value))
    # Rows of a wider buffer (a strided view) read as the same values.
    wide = torch.zeros(rows, in_features * 2, dtype=torch.bfloat16)
    wide[:, :in_features] = x
    assert torch.equal(projection(wide[:, :in_features]), got)


@needs_onednn_bf16
@torch.inference_mode()
def test_a_weight_tied_to_the_embeddings_stays() -> None:
    projection = _projection(96, 64, bias=False)
    projection.shared_weight = True
    projection.use_onednn()
    assert projection.weight.shape == (96, 64)  # still the embedding table's
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(projection(x), F.linear(x, projection.weight))


needs_one_row_copy = pytest.mark.skipif(
    not one_row_copy_available(torch.bfloat16),
    reason="needs oneDNN's prepacked bfloat16 (AMX or AVX512-BF16) and a fast build's row GEMV",
)


@needs_one_row_copy
@pytest.mark.parametrize("shared", [False, True], ids=["own", "tied"])
@torch.inference_mode()
def test_kept_rows_serve_one_row_and_the_prepacked_weight_more(shared: bool) -> None:
    """keep_rows: one row through the row GEMV on the [out, in] weight (float32 sums,
    rounded once), more rows through oneDNN, bit for bit F.linear's."""
    projection = _projection(960, 576, bias=True)
    weight = projection.weight.detach().clone()
    bias = projection.bias.detach().clone()
    if shared:  # a tied LM head: the embeddings are the [out, in] weight already
        projection.shared_weight = True
        embeddings = projection.weight.data_ptr()
    else:
        projection.transpose()
    projection.use_onednn(keep_rows=True)
    assert projection.weight_onednn is not None and projection.weight_t is None
    assert projection.row_gemv and torch.equal(projection.weight, weight)
    if shared:  # read in place, not copied
        assert projection.weight.data_ptr() == embeddings
    one = torch.randn(1, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(projection(one), torch.ops.duoserve.row_gemv(one, weight, bias))
    expected = (one.double() @ weight.double().T + bias.double()).bfloat16()
    assert (projection(one) == expected).double().mean().item() > 0.98
    many = torch.randn(5, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(projection(many), F.linear(many, weight, bias))


def test_the_layout_is_chosen_for_bfloat16_where_the_cpu_has_bfloat16_arithmetic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    arithmetic = {"amx_tile", "avx512_bf16"} & _cpu_flags()
    expected = bool(arithmetic) and not torch_bf16_matmul_is_scalar()
    assert onednn_linear_available(torch.bfloat16) == expected
    assert not onednn_linear_available(torch.float32)
    if expected:  # one layout per projection: the packed kernel and the row GEMV stand aside
        assert not packed_linear_available(torch.bfloat16)
        assert not row_gemv_available(torch.bfloat16)
    # oneDNN held to its bfloat16 AVX-512 kernels: the same; below them, torch's own paths.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert onednn_linear_available(torch.bfloat16) == expected
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert not onednn_linear_available(torch.bfloat16)


@needs_one_row_copy
@pytest.mark.parametrize("limit", [0, 1 << 30], ids=["over-the-limit", "within"])
def test_a_model_keeps_its_rows_only_within_the_limit(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    from engine_svc import LLM
    from engine_svc.models import fast_paths

    monkeypatch.setattr(fast_paths, "ONE_ROW_COPY_MAX_BYTES", limit)
    # As on AMX, where oneDNN's layout stays (on AVX512-BF16 the pairs kernel takes them).
    monkeypatch.setattr(fast_paths, "bf16_pairs_available", lambda _dtype: False)
    llm = LLM(str(tiny_model_dir), dtype="bfloat16")
    try:
        model = llm.engine_core.executor.runner.model
        projections = [m for m in model.modules() if isinstance(m, Projection)]
        assert all(p.weight_onednn is not None for p in projections)
        assert all(p.row_gemv == (limit > 0) for p in projections)
        own = [p for p in projections if not p.shared_weight]
        assert all(hasattr(p, "weight") == (limit > 0) for p in own)
    finally:
        llm.shutdown()


def test_the_copy_takes_at_most_a_quarter_of_the_room_past_the_weights() -> None:
    from engine_svc.models.fast_paths import ONE_ROW_COPY_MAX_BYTES, one_row_copy_limit

    assert one_row_copy_limit(None, 5 << 30) == ONE_ROW_COPY_MAX_BYTES == 1 << 30
    assert one_row_copy_limit(4 << 30, 2 << 30) == 512 << 20
    assert one_row_copy_limit(64 << 30, 1 << 30) == 1 << 30
    assert one_row_copy_limit(1 << 30, 2 << 30) == 0


@needs_one_row_copy
def test_a_tight_memory_budget_leaves_the_kv_cache_the_copy_s_room(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's budget decides: with room past the weights four times the copy the
    weights are kept twice, 8 bytes less and they are not; no budget, no limit but 1 GiB."""
    from engine_svc.models import fast_paths
    from engine_svc.models.fast_paths import projection_bytes, tensor_bytes
    from engine_svc.models.loader import load_model
    from engine_svc.models.model_spec import load_model_spec
    from engine_svc.worker.model_runner import ModelRunner

    monkeypatch.setattr(fast_paths, "bf16_pairs_available", lambda _dtype: False)  # as on AMX

    spec = load_model_spec(str(tiny_model_dir))
    cpu = torch.device("cpu")
    loaded = load_model(str(tiny_model_dir), spec, torch.bfloat16, cpu)
    roomy = tensor_bytes(loaded) + 4 * projection_bytes(loaded, torch.bfloat16)

    def rows_kept(budget: int | None) -> bool:
        runner = ModelRunner(str(tiny_model_dir), spec, torch.bfloat16, cpu, 16,
                             memory_budget_bytes=budget)  # fmt: skip
        projections = [m for m in runner.model.modules() if isinstance(m, Projection)]
        kept = {p.row_gemv for p in projections}
        assert len(kept) == 1
        return kept.pop()

    assert rows_kept(None)
    assert rows_kept(roomy)
    assert not rows_kept(roomy - 8)
