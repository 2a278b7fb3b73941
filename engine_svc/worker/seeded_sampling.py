"""Seeded rows: the exponential race, whose draw survives a nudge to the logits.

A seeded float32 request must draw the same tokens alone or in any batch. Where the model's numbers
are the same bits at every batch size (the AVX-512 kernels), any draw would do; where they
are not (the AVX2 build's projections differ by a few units in the last place between one
row and many), the inverse-CDF draw of random_sampling.py is fragile: its cumulative sum
carries every token's nudge, and on a flat distribution a shift of 4e-6 moved the chosen
token one time in five (tests/engine_svc/test_sampling.py's seeded test failed there). The
race keeps the token with the largest p / E, E an Exp(1) number of its own: a nudge changes
the winner only where two ratios are that close. In bfloat16 the logits themselves differ
between batch sizes by far more than a nudge (the projections round to bfloat16 from sums
taken in another order: AMX's tiles from 4 rows, dot products below), so a seeded bfloat16
request's tokens can part from its lone run's (seen at tokens 4-20, in a batch of 6 and
under preemption).

Each token's E is a function of the row's key (from the request's seed and the output's
index, race_key) and the token id alone: a counter-based hash, no generator state. So a
row's numbers cost a few integer operations a token, computed where they are used (the
CPU kernel computes the same hash, engine_svc/kernels/csrc/race_rows.cpp), and a top-k row
computes them for its k candidates only. Filling the vocabulary from a seeded
torch.Generator instead (exponential_) took 0.88 ms a row of 49,152 tokens on the 2-core
Xeon, and the race in torch another 0.19-0.44 ms.

The filters are random_sampling's (vLLM's): top-k candidates; top-p and min-p by rejection,
a winner outside the kept tokens raising the row's pivot to it (every kept token is more
likely), the race run again over the tokens above it: the race over a subset picks that
subset's winner, so the first winner kept is the kept tokens' winner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_svc.worker.random_sampling import (
    RowFilters,
    apply_min_p,
    filter_columns,
    kept_candidates,
    kernel_takes,
    row_values,
)

# Rounds of the race a top-p or min-p row runs before it sorts the tokens above its pivot.
RACE_ROUNDS = 32

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_W_MAX = 1.0 - 2.0**-24  # the largest float32 below 1: E stays finite


def race_key(seed: int, output_index: int) -> int:
    """The 64-bit key of a seeded request's output number `output_index`: splitmix64's
    finalizer over the seed, then over that plus the index, so neighbouring indices (and
    seeds) get unrelated keys."""
    return _splitmix64((_splitmix64(seed & _MASK64) + output_index) & _MASK64)


def key_tensor(keys: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """race_key's keys as int64 [rows] (the same 64 bits, read as signed)."""
    return torch.tensor([key - (1 << 64) if key >> 63 else key for key in keys], device=device)


def exponential_noise(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) numbers (float32) for token ids `ids` (int64, below 2**32) of the rows whose
    keys (key_tensor's) broadcast against them: h = mix32(mix32(id ^ key's low half) ^ key's
    high half), mix32 being lowbias32 (Chris Wellons' 32-bit integer hash); w = (h + 0.5) /
    2**32 in float32 (h rounded to float32 first), at most 1 - 2**-24; E = -log1p(-w), so
    the small E that win races keep float32's relative precision (a 24-bit u made ties for
    the smallest E in 0.26% of 49,152-token rows, won by the lower id). The int64 arithmetic
    never overflows (mix32's products are split in halves), so every device computes the
    same w."""
    h = _mix32(_mix32(ids ^ (key & _MASK32)) ^ ((key >> 32) & _MASK32))
    w = ((h.float() + 0.5) * 2.0**-32).clamp_(max=_W_MAX)
    return -torch.log1p(-w)


def race(
    logits: torch.Tensor,
    filters: Sequence[RowFilters],
    keys: Sequence[int],
    kernel: bool = False,
) -> torch.Tensor:
    """Each row's token: the largest p / E over the tokens its filters keep, E the row's
    exponential_noise (keys: race_key's, one a row). logits: [rows, vocab]. Top-k rows race
    over their candidates together; with `kernel` (the CPU kernels are loaded), the other
    rows race in race_rows.cpp, else one at a time here."""
    rows, vocab = logits.shape
    device = logits.device
    in_kernel = kernel_takes(logits, kernel)
    all_keys = key_tensor(keys, device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    groups: dict[int, list[int]] = {}  # top-k's k, 0 for the whole vocabulary
    for row, f in enumerate(filters):
        groups.setdefault(f.top_k if 0 < f.top_k < vocab else 0, []).append(row)
    for k, members in groups.items():
        index = torch.tensor(members, device=device)
        part = logits if len(members) == rows else logits.index_select(0, index)
        chosen = [filters[row] for row in members]
        part_keys = all_keys.index_select(0, index)
        if k > 0:
            picked = _race_candidates(part, chosen, part_keys, k)
        elif in_kernel:
            picked = torch.ops.duoserve.race_rows(
                part, *filter_columns(chosen, device), part_keys, RACE_ROUNDS
            )
        else:
            ids = torch.arange(vocab, device=device)
            picked = torch.stack(
                [
                    _kept_winner(
                        torch.softmax(part[i].float() / f.temperature, dim=-1),
                        f,
                        exponential_noise(part_keys[i], ids),
                    )
                    for i, f in enumerate(chosen)
                ]
            )
        if len(members) == rows:
            return picked
        tokens.index_copy_(0, index, picked)
    return tokens


def _race_candidates(
    logits: torch.Tensor, filters: list[RowFilters], keys: torch.Tensor, k: int
) -> torch.Tensor:
    """Rows with top-k: their k candidates in descending order, of which top-p and min-p keep
    kept_candidates'; the race over what is kept, every row at once."""
    values, ids = logits.topk(k, dim=-1)
    temperature = row_values(filters, "temperature", logits.device).unsqueeze(1)
    probs = torch.softmax(values / temperature, dim=-1)  # float32: bfloat16 promotes
    kept = kept_candidates(probs, filters)
    scores = (kept / exponential_noise(keys.unsqueeze(1), ids)).masked_fill(kept <= 0.0, -1.0)
    return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


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
    ranked, order = probs.masked_fill(probs <= pivot, 0.0).sort(descending=True, stable=True)
    kept = (ranked.cumsum(0) - ranked < f.top_p) & (ranked > 0.0)
    kept_probs = apply_min_p(ranked.where(kept, 0.0).unsqueeze(0), ranked[:1], [f]).squeeze(0)
    winner = (kept_probs / noise[order]).masked_fill(kept_probs <= 0.0, -1.0).argmax()
    return order[winner]


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = _times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _times32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x below 2**32, in products below 2**48."""
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (x * (c & 0xFFFF) + high) & _MASK32
