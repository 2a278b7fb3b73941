"""Requests that pass validation with extreme parameters, and logits a broken model can
produce, sample without crashing the worker: the sampler answers with a token every time."""

from __future__ import annotations

import pytest
import torch

from engine_svc.kernels import cpu_kernels_available
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.sampler import Sampler, SamplingRow
from tests.engine_svc.test_random_sampling import PATHS


def _row(**params: float | int | None) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), 0, [1], [])  # type: ignore[arg-type]


@PATHS
@pytest.mark.parametrize("seed", [None, 5])
def test_a_tiny_temperature_is_greedy(kernel: bool, seed: int | None) -> None:
    logits = torch.randn(4, 3001, generator=torch.Generator().manual_seed(0))
    rows = [_row(temperature=1e-39, top_p=0.9, seed=seed) for _ in range(4)]
    tokens, _ = Sampler(torch.device("cpu"), kernels=kernel)(logits, rows)
    assert tokens == logits.argmax(dim=-1).tolist()


@PATHS
@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("top_k", [0, 40])
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(
    kernel: bool, seed: int | None, top_k: int
) -> None:
    logits = torch.randn(4, 3001, generator=torch.Generator().manual_seed(1)) * 3
    rows = [_row(temperature=1.0, top_p=1e-50, top_k=top_k, seed=seed) for _ in range(4)]
    tokens, _ = Sampler(torch.device("cpu"), kernels=kernel)(logits, rows)
    assert tokens == logits.argmax(dim=-1).tolist()


@PATHS
@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_inf_or_nan_still_get_a_token(
    kernel: bool, seed: int | None, top_p: float, dtype: torch.dtype
) -> None:
    vocab = 1000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    logits[0, 7] = float("inf")
    logits[1] = float("-inf")
    logits[2, 11] = float("nan")
    rows = [_row(temperature=0.8, top_p=top_p, seed=seed) for _ in range(3)]
    tokens, _ = Sampler(torch.device("cpu"), kernels=kernel)(logits.to(dtype), rows)
    assert all(0 <= token < vocab for token in tokens)
    if kernel:  # the kernels' stand-in: the first largest logit, NaN aside
        assert tokens[:2] == [7, 0]


def test_the_kernels_called_with_top_p_0_answer_the_most_likely_token() -> None:
    """The sampler floors top_p; the operators themselves still answer when called with 0."""
    if not cpu_kernels_available():
        pytest.skip("no CPU kernels here")
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    ones, zeros = torch.ones(3), torch.zeros(3)
    sampled = torch.ops.duoserve.sample_rows(
        logits, ones, zeros, zeros, torch.full((3,), 0.5, dtype=torch.float64), 2
    )
    raced = torch.ops.duoserve.race_rows(logits, ones, zeros, zeros, torch.arange(3), 2)
    assert sampled.tolist() == raced.tolist() == logits.argmax(dim=-1).tolist()
