"""Seeded rows: the exponential race, whose draw survives a nudge to the logits.

A seeded request must draw the same tokens alone or in any batch. Where the model's numbers
are the same bits at every batch size (the AVX-512 kernels), any draw would do; where they
are not (the AVX2 build's projections differ by a few units in the last place between one
row and many), the inverse-CDF draw of random_sampling.py is fragile: its cumulative sum
carries every token's nudge, and on a flat distribution a shift of 4e-6 moved the chosen
token one time in five (tests/engine_svc/test_sampling.py's seeded test failed there). The
race keeps the token with the largest p / E, E an Exp(1) number of its own from the row's
seeded generator: a nudge changes the winner only where two ratios are that close.

The filters are random_sampling's (vLLM's): top-k candidates; top-p and min-p by rejection,
a winner outside the kept tokens raising the row's pivot to it (every kept token is more
likely), the race run again over the tokens above it: the race over a subset picks that
subset's winner, so the first winner kept is the kept tokens' winner.
"""

from __future__ import annotations

import torch

from engine_svc.worker.random_sampling import RowFilters, apply_min_p

# Rounds of the race a top-p or min-p row runs before it sorts the tokens above its pivot.
RACE_ROUNDS = 32


def race(logits: torch.Tensor, filters: list[RowFilters], noise: torch.Tensor) -> torch.Tensor:
    """Each row's token: the largest p / noise over the tokens its filters keep. logits:
    [rows, vocab]; noise: Exp(1) numbers of the same shape, one per token."""
    tokens = torch.empty(len(filters), dtype=torch.long, device=logits.device)
    vocab = logits.shape[-1]
    for row, f in enumerate(filters):
        scaled = logits[row].float() / f.temperature
        if 0 < f.top_k < vocab:
            values, ids = scaled.topk(f.top_k)
            tokens[row] = ids[_kept_winner(torch.softmax(values, dim=-1), f, noise[row, ids])]
        else:
            tokens[row] = _kept_winner(torch.softmax(scaled, dim=-1), f, noise[row])
    return tokens


def _kept_winner(probs: torch.Tensor, f: RowFilters, noise: torch.Tensor) -> torch.Tensor:
    """The index of the largest probs / noise among the tokens top-p and min-p keep of
    `probs` (one row)."""
    scores = probs / noise
    if f.top_p >= 1.0 and f.min_p <= 0.0:
        return scores.argmax()
    floor = f.min_p * probs.max()
    pivot = probs.new_zeros(())
    for _ in range(RACE_ROUNDS):
        winner = scores.masked_fill(probs <= pivot, -1.0).argmax()
        chosen = probs[winner]
        above = probs.masked_fill(probs <= chosen, 0.0).sum()
        if above < f.top_p and chosen >= floor:
            return winner
        pivot = chosen
    ranked, order = probs.masked_fill(probs <= pivot, 0.0).sort(descending=True)
    kept = (ranked.cumsum(0) - ranked < f.top_p) & (ranked > 0.0)
    kept_probs = apply_min_p(ranked.where(kept, 0.0).unsqueeze(0), ranked[:1], [f]).squeeze(0)
    winner = (kept_probs / noise[order]).masked_fill(kept_probs <= 0.0, -1.0).argmax()
    return order[winner]
