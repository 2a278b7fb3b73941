"""The random sampler draws from vLLM's distribution, computed here the plain way (sort
everything, mask, softmax). Where one uniform number decides a row's token, checked without
chance: the number swept over [0, 1), each token must come out for its probability's share of
the sweep. Top-p's rejection draws, which reuse the number after a miss, are checked against
many random draws. Each on both paths: torch's (any device) and, where the CPU kernels load,
sample_rows.cpp's for the rows without top-k."""

from __future__ import annotations

import pytest
import torch

from engine_svc.kernels import cpu_kernels_available
from engine_svc.worker import random_sampling
from engine_svc.worker.random_sampling import RowFilters, inverse_cdf, sample


def reference_distribution(logits: torch.Tensor, f: RowFilters) -> torch.Tensor:
    """One row's sampling distribution by sorting the whole vocabulary: temperature, top-k,
    top-p on the renormalized top-k (a token stays while the mass ranked above it is under
    top_p), min-p on what is left."""
    scaled = logits.double() / f.temperature
    order = scaled.argsort(descending=True)
    probs = torch.softmax(scaled[order], dim=-1)
    if 0 < f.top_k < len(probs):
        probs[f.top_k :] = 0.0
        probs /= probs.sum()
    if f.top_p < 1.0:
        probs[(probs.cumsum(0) - probs) >= f.top_p] = 0.0
        probs /= probs.sum()
    if f.min_p > 0.0:
        probs[probs < f.min_p * probs[0]] = 0.0
        probs /= probs.sum()
    return torch.zeros_like(probs).scatter_(0, order, probs)


KERNEL = pytest.param(
    True,
    id="kernel",
    marks=pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU kernels here"),
)
# torch's path: the same at every kernel level, so test_kernel_levels.py runs only the kernel's.
TORCH = pytest.param(False, id="torch", marks=pytest.mark.torch_path)
PATHS = pytest.mark.parametrize("kernel", [TORCH, KERNEL])


def swept_frequencies(
    logits: torch.Tensor, f: RowFilters, draws: int, kernel: bool
) -> torch.Tensor:
    """How often each token comes out of `sample` for uniforms (j + 0.5) / draws."""
    batch = logits.float().unsqueeze(0).expand(draws, -1).contiguous()
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens = sample(batch, [f] * draws, uniforms, kernel)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


def assert_draws_follow(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Random draws `tokens` land only where `expected` (a distribution over the vocabulary)
    has mass, each token's count within five standard deviations of a binomial count."""
    draws = len(tokens)
    got = torch.bincount(tokens, minlength=len(expected)).double() / draws
    assert (got[expected == 0] == 0).all(), "a token outside the distribution was drawn"
    bound = 5 * (expected * (1 - expected) / draws).sqrt() + 1.0 / draws
    assert ((got - expected).abs() <= bound).all()


def _logits(vocab: int, spread: float, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread


CASES = [
    (3.0, RowFilters(1.0, 0, 1.0, 0.0)),  # temperature only
    (3.0, RowFilters(0.7, 40, 1.0, 0.0)),  # top-k
    (3.0, RowFilters(0.8, 40, 0.9, 0.0)),  # top-k, then top-p on what it kept
    (3.0, RowFilters(1.0, 0, 1.0, 0.05)),  # min-p
    (3.0, RowFilters(0.9, 0, 0.95, 0.02)),  # top-p then min-p
    (6.0, RowFilters(1.0, 0, 0.9, 0.0)),  # top-p, a narrow nucleus
    (1.0, RowFilters(1.0, 0, 0.8, 0.0)),  # top-p, hundreds of tokens
    (0.05, RowFilters(1.0, 0, 0.5, 0.0)),  # top-p, nearly flat: most of the vocabulary
]


@PATHS
@pytest.mark.parametrize(("spread", "filters"), CASES)
def test_one_number_a_row_follows_the_filtered_distribution(
    spread: float, filters: RowFilters, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Top-p rows without top-k go straight to the sort of their last resort (no rejection
    rounds), so one number decides every row here."""
    monkeypatch.setattr(random_sampling, "NUCLEUS_ROUNDS", 0)
    vocab, draws = 3000, 4000
    logits = _logits(vocab, spread, seed=5)
    expected = reference_distribution(logits, filters)
    got = swept_frequencies(logits, filters, draws, kernel)
    assert (got[expected == 0] == 0).all(), "a token outside the distribution was drawn"
    # Each token takes a run of the sweep within one step of its probability.
    assert (got - expected).abs().max().item() <= 1.0 / draws + 1e-6


@PATHS
@pytest.mark.parametrize(("spread", "filters"), [c for c in CASES if c[1].top_p < 1.0])
def test_top_p_rejection_draws_follow_the_filtered_distribution(
    spread: float, filters: RowFilters, kernel: bool
) -> None:
    vocab, draws = 1000, 40_000
    logits = _logits(vocab, spread, seed=6)
    expected = reference_distribution(logits, filters)
    batch = logits.float().unsqueeze(0).expand(draws, -1).contiguous()
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    tokens = sample(batch, [filters] * draws, uniforms, kernel)
    assert_draws_follow(tokens, expected)


@PATHS
def test_top_p_rejection_reaches_its_last_resort_and_stays_exact(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rejection round: rows that miss once sort the tokens above their pivot."""
    monkeypatch.setattr(random_sampling, "NUCLEUS_ROUNDS", 1)
    test_top_p_rejection_draws_follow_the_filtered_distribution(
        0.05, RowFilters(1.0, 0, 0.5, 0.0), kernel
    )


@PATHS
def test_a_row_draws_the_same_alone_and_in_a_mixed_batch(kernel: bool) -> None:
    """Rows are grouped by their filters; a row's token depends only on its logits, its
    filters and its uniform number."""
    vocab = 2000
    rows = [_logits(vocab, 2.0, seed) for seed in range(6)]
    filters = [
        RowFilters(0.8, 0, 0.9, 0.0),
        RowFilters(1.0, 50, 1.0, 0.0),
        RowFilters(1.2, 0, 1.0, 0.1),
        RowFilters(0.8, 0, 0.9, 0.0),
        RowFilters(0.5, 7, 0.5, 0.0),
        RowFilters(1.0, 0, 0.3, 0.0),
    ]
    uniforms = torch.tensor([0.1, 0.5, 0.9, 0.33, 0.999, 0.0], dtype=torch.float64)
    together = sample(torch.stack(rows), filters, uniforms, kernel)
    for i in range(len(rows)):
        alone = sample(rows[i].unsqueeze(0), [filters[i]], uniforms[i : i + 1], kernel)
        assert alone.item() == together[i].item()


def test_zero_weights_are_never_picked_even_at_the_ends() -> None:
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.5, 1.0 - 2.0**-24):
        picked = inverse_cdf(weights, torch.tensor([u, u]))
        assert weights[torch.arange(2), picked].gt(0).all(), (u, picked)
    assert inverse_cdf(weights, torch.tensor([0.0, 0.0])).tolist() == [1, 2]
    assert inverse_cdf(weights, torch.tensor([1.0 - 2.0**-24, 0.7])).tolist() == [3, 2]


def test_the_kernel_takes_bfloat16_logits_as_their_float32_values() -> None:
    """bfloat16 logits widen exactly: the kernel draws the same tokens from them as from
    their float32 copy, where one number decides."""
    if not cpu_kernels_available():
        pytest.skip("no CPU kernels here")
    logits = torch.stack([_logits(3000, 3.0, seed) for seed in range(8)]).bfloat16()
    filters = [RowFilters(0.8, 0, 1.0, 0.0)] * 4 + [RowFilters(1.0, 0, 1.0, 0.05)] * 4
    uniforms = torch.rand(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = sample(logits, filters, uniforms, kernel=True)
    assert got.tolist() == sample(logits.float(), filters, uniforms, kernel=True).tolist()


def test_a_row_at_top_p_1_keeps_every_candidate_beside_rows_that_filter() -> None:
    """Float32 sums that reach 1 before the last candidate must not cut a top_p = 1 row's
    tail because another row in its group filters."""
    probs = torch.tensor([[1.0, 1e-8, 1e-8, 1e-8], [0.5, 0.3, 0.1, 0.1]])
    filters = [RowFilters(1.0, 4, 1.0, 0.0), RowFilters(1.0, 4, 0.5, 0.0)]
    kept = random_sampling.kept_candidates(probs, filters)
    assert torch.equal(kept[0], probs[0])
    assert kept[1].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert torch.equal(random_sampling.kept_candidates(probs[:1], filters[:1]), probs[:1])
