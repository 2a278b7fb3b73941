"""The batched penalties give, bit for bit, what a row-by-row loop over vLLM's definitions
gives on CPU: repetition on the prompt and output tokens, then frequency and presence on the
output's."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine_svc.worker.penalties import apply_penalties_


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _row_by_row(
    logits: torch.Tensor,
    rows: list[Row],
    repetition: list[float],
    frequency: list[float],
    presence: list[float],
) -> torch.Tensor:
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        if repetition[i] != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long)
            values = logits[i, seen]
            logits[i, seen] = torch.where(
                values > 0, values / repetition[i], values * repetition[i]
            )
        if row.output_token_ids and (frequency[i] or presence[i]):
            counts = torch.bincount(torch.tensor(row.output_token_ids), minlength=vocab).float()
            logits[i] -= frequency[i] * counts
            logits[i] -= presence[i] * (counts > 0).float()
    return logits


def test_batched_penalties_equal_the_row_by_row_loop() -> None:
    rng = random.Random(0)
    rows_count, vocab = 40, 3001
    logits = torch.randn(rows_count, vocab, generator=torch.Generator().manual_seed(1)) * 4
    rows, repetition, frequency, presence = [], [], [], []
    for i in range(rows_count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        # Outputs repeat tokens (of the prompt too) so counts exceed 1.
        output = [rng.choice([*prompt[:5], rng.randrange(vocab)]) for _ in range(i * 3)]
        rows.append(Row(prompt, output))
        repetition.append(rng.choice([1.0, 1.3, 0.7, 2.0]))
        frequency.append(rng.choice([0.0, 0.5, -0.8, 2.0]))
        presence.append(rng.choice([0.0, 0.4, -1.5]))
    repetition[3], frequency[3], presence[3] = 1.0, 0.0, 0.0  # a row without any
    got = logits.clone()
    apply_penalties_(got, rows, repetition, frequency, presence)
    assert torch.equal(got, _row_by_row(logits, rows, repetition, frequency, presence))
    assert torch.equal(got[3], logits[3])
    assert not torch.equal(got, logits)


def test_a_small_case_by_hand() -> None:
    out = torch.ones(2, 10)
    rows = [Row([1, 2], [3, 3]), Row([4], [])]
    apply_penalties_(out, rows, [2.0, 2.0], [0.5, 0.5], [0.25, 0.25])
    assert out[0, 1].item() == 0.5 and out[0, 3].item() == 0.5 - 1.0 - 0.25
    assert out[1, 4].item() == 0.5 and out[1, 3].item() == 1.0
