"""Seeded rows' exponential race: vLLM's filtered distribution, and a winner that a nudge to
the logits in their last bits leaves alone."""

from __future__ import annotations

import pytest
import torch

from engine_svc.worker import seeded_sampling
from engine_svc.worker.random_sampling import RowFilters
from engine_svc.worker.seeded_sampling import race
from tests.engine_svc.test_random_sampling import CASES, _logits, reference_distribution


def _exponentials(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(rows, vocab).exponential_(generator=generator)


@pytest.mark.parametrize(("spread", "filters"), CASES)
def test_race_winners_follow_the_filtered_distribution(spread: float, filters: RowFilters) -> None:
    vocab, draws = 400, 6000
    logits = _logits(vocab, spread, seed=8)
    expected = reference_distribution(logits, filters)
    batch = logits.unsqueeze(0).expand(draws, -1)
    tokens = race(batch, [filters] * draws, _exponentials(draws, vocab, seed=9))
    got = torch.bincount(tokens, minlength=vocab).double() / draws
    assert (got[expected == 0] == 0).all(), "a token outside the distribution won"
    bound = 5 * (expected * (1 - expected) / draws).sqrt() + 1.0 / draws
    assert ((got - expected).abs() <= bound).all()


def test_race_after_its_rounds_sorts_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeded_sampling, "RACE_ROUNDS", 0)
    test_race_winners_follow_the_filtered_distribution(0.05, RowFilters(1.0, 0, 0.5, 0.0))
    test_race_winners_follow_the_filtered_distribution(3.0, RowFilters(0.9, 0, 0.95, 0.02))


def test_a_nudge_to_the_logits_rarely_moves_the_winner() -> None:
    """A nearly flat row, nudged by 4e-6 as the AVX2 build's logits move between batch sizes:
    the race keeps its winner in all but a few rows in a thousand."""
    rows, vocab = 1000, 5000
    logits = torch.stack([_logits(vocab, 0.05, seed) for seed in range(rows)])
    nudged = logits + 4e-6 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    noise = _exponentials(rows, vocab, seed=2)
    filters = [RowFilters(1.0, 0, 0.9, 0.0)] * rows
    moved = (race(logits, filters, noise) != race(nudged, filters, noise)).sum().item()
    assert moved <= 5
