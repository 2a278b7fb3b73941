"""Seeded rows' exponential race: vLLM's filtered distribution, Exp(1) numbers that are a
function of (key, token id) alone, a winner that a nudge to the logits in their last bits
leaves alone, and the CPU kernel's race equal to torch's."""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc.worker import seeded_sampling
from engine_svc.worker.random_sampling import RowFilters
from engine_svc.worker.seeded_sampling import exponential_noise, key_tensor, race, race_key
from tests.engine_svc.test_random_sampling import (
    CASES,
    KERNEL,
    PATHS,
    _logits,
    assert_draws_follow,
    reference_distribution,
)


def _keys(rows: int, seed: int) -> list[int]:
    return [race_key(seed, index) for index in range(rows)]


@PATHS
@pytest.mark.parametrize(("spread", "filters"), CASES)
def test_race_winners_follow_the_filtered_distribution(
    spread: float, filters: RowFilters, kernel: bool
) -> None:
    vocab, draws = 400, 6000
    logits = _logits(vocab, spread, seed=8)
    expected = reference_distribution(logits, filters)
    batch = logits.unsqueeze(0).expand(draws, -1).contiguous()
    assert_draws_follow(race(batch, [filters] * draws, _keys(draws, seed=9), kernel), expected)


@PATHS
def test_race_after_its_rounds_sorts_and_stays_exact(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seeded_sampling, "RACE_ROUNDS", 0)
    test_race_winners_follow_the_filtered_distribution(0.05, RowFilters(1.0, 0, 0.5, 0.0), kernel)
    test_race_winners_follow_the_filtered_distribution(3.0, RowFilters(0.9, 0, 0.95, 0.02), kernel)


@pytest.mark.torch_path
def test_noise_is_a_function_of_the_key_and_the_token_alone() -> None:
    ids = torch.arange(49152)
    keys = key_tensor([race_key(3, 0), race_key(3, 1), race_key(4, 0)])
    whole = exponential_noise(keys[0], ids)
    picked = torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:100]
    assert torch.equal(exponential_noise(keys[0], ids[picked]), whole[picked])
    assert torch.equal(exponential_noise(keys[:1].unsqueeze(1), ids.unsqueeze(0))[0], whole)
    assert not torch.equal(exponential_noise(keys[1], ids), whole)
    assert not torch.equal(exponential_noise(keys[2], ids), whole)


@pytest.mark.torch_path
def test_noise_is_exponential_and_unrelated_between_neighbouring_keys() -> None:
    """Exp(1)'s tail at a few points, within 5 standard errors over 20 keys of the whole
    vocabulary, and no correlation between neighbouring outputs' or seeds' numbers."""
    ids = torch.arange(49152)
    keys = key_tensor([race_key(seed, index) for seed in (0, 1) for index in range(10)])
    noise = exponential_noise(keys.unsqueeze(1), ids).double()
    count = noise.numel()
    for x in (0.1, 0.5, 1.0, 2.0, 5.0, 10.0):
        expected = math.exp(-x)
        got = (noise > x).double().mean().item()
        assert abs(got - expected) <= 5 * math.sqrt(expected * (1 - expected) / count) + 1e-6
    assert abs(noise.mean().item() - 1.0) < 5 / math.sqrt(count)
    centred = noise - noise.mean(dim=1, keepdim=True)
    for a, b in [(0, 1), (4, 5), (0, 10), (3, 13)]:  # next output; the other seed
        correlation = (centred[a] * centred[b]).mean() / (centred[a].std() * centred[b].std())
        assert abs(correlation.item()) < 5 / math.sqrt(49152)


@pytest.mark.torch_path
def test_a_nudge_to_the_logits_rarely_moves_the_winner() -> None:
    """A nearly flat row, nudged by 4e-6 as the AVX2 build's logits move between batch sizes:
    the race keeps its winner in all but a few rows in a thousand."""
    rows, vocab = 1000, 5000
    logits = torch.stack([_logits(vocab, 0.05, seed) for seed in range(rows)])
    nudged = logits + 4e-6 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    keys = _keys(rows, seed=2)
    filters = [RowFilters(1.0, 0, 0.9, 0.0)] * rows
    moved = (race(logits, filters, keys) != race(nudged, filters, keys)).sum().item()
    assert moved <= 5


FILTERS = [
    RowFilters(1.0, 0, 1.0, 0.0),
    RowFilters(0.8, 0, 0.95, 0.0),
    RowFilters(1.0, 0, 1.0, 0.05),
    RowFilters(0.9, 0, 0.9, 0.02),
    RowFilters(0.7, 50, 0.9, 0.0),  # top-k: torch's path in both
]


@pytest.mark.parametrize("kernel", [KERNEL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_race_picks_torch_s_tokens(kernel: bool, dtype: torch.dtype) -> None:
    """Same keys, same hash: the kernel's winners are torch's, row for row, in a batch mixing
    every filter (spreads from nearly flat to peaked)."""
    rows, vocab = 200, 5003  # a vocabulary that is no multiple of any vector width
    spreads = [0.05, 1.0, 3.0, 8.0]
    logits = torch.stack([_logits(vocab, spreads[r % 4], seed=r) for r in range(rows)]).to(dtype)
    filters = [FILTERS[r % len(FILTERS)] for r in range(rows)]
    keys = _keys(rows, seed=11)
    assert race(logits, filters, keys, kernel).tolist() == race(logits, filters, keys).tolist()


@pytest.mark.torch_path
def test_the_smallest_numbers_have_float32_resolution() -> None:
    """The E that win races are the small ones: over 2,000 keys of a 49,152-token row, the
    smallest E is never shared by two tokens (a 24-bit u tied it in about 0.26% of rows)."""
    ids = torch.arange(49152)
    keys = key_tensor([race_key(21, index) for index in range(2000)])
    noise = exponential_noise(keys.unsqueeze(1), ids)
    smallest = noise.min(dim=1, keepdim=True).values
    assert ((noise == smallest).sum(dim=1) == 1).all()
    assert torch.isfinite(noise).all() and (noise > 0).all()
