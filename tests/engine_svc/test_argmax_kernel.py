"""Greedy sampling's argmax (engine_svc/kernels/csrc/argmax.cpp) answers what torch.max's
indices answer: the first of tied maxima, the first NaN of a row that has one, index 0 for a
row of -inf; over float32 and bfloat16, rows of whole vectors and rows with a partial last
one, rows spaced wider than they are long; and the sampler takes it where the kernels load."""

from __future__ import annotations

import pytest
import torch

from engine_svc import SamplingParams
from engine_svc.kernels import cpu_kernels_available
from engine_svc.worker.sampler import Sampler, SamplingRow

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.duoserve.argmax_rows(logits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "vocab"), [(1, 1), (3, 7), (5, 16), (2, 33), (2, 40), (64, 49152)]
)
def test_the_first_maximum_as_torch_finds_it(dtype: torch.dtype, rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(rows * 100_000 + vocab)
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    if vocab > 20:  # a tie between a vector's lane and the tail (33 and 40 have one on
        # AVX-512 and AVX2), and one across vectors
        logits[0, 3] = logits[0, vocab - 1] = 50.0
        logits[-1, 17] = logits[-1, 1] = 60.0
    assert torch.equal(_argmax(logits), logits.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_infinities_as_torch_answers_them(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[0, 70] = logits[0, 40] = float("nan")  # the first NaN: 40
    logits[1, 97] = float("nan")  # in the tail on AVX-512 and AVX2
    logits[2] = float("-inf")
    logits[3, 99] = float("inf")
    expected = logits.max(dim=-1).indices
    assert expected.tolist() == [40, 97, 0, 99]
    assert torch.equal(_argmax(logits), expected)


def test_rows_spaced_wider_than_they_are_long() -> None:
    padded = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    logits = padded[:, :257]  # the vocabulary's rows of a padded LM head's output
    assert torch.equal(_argmax(logits), logits.max(dim=-1).indices)


def test_the_sampler_draws_with_the_kernel_what_it_draws_without() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[2, 10] = logits[2, 400] = 20.0
    greedy = [SamplingRow(SamplingParams(temperature=0.0), 0, [1], []) for _ in range(8)]
    seeded = [SamplingRow(SamplingParams(temperature=0.7, seed=i), 0, [1], []) for i in range(8)]
    with_kernel = Sampler(torch.device("cpu"), kernels=True)
    plain = Sampler(torch.device("cpu"))
    assert with_kernel(logits, greedy)[0] == plain(logits, greedy)[0]
    assert with_kernel(logits, greedy)[0][2] == 10
    # The exponential race draws the same tokens: its argmax is the kernel's too.
    assert with_kernel(logits, seeded)[0] == plain(logits, seeded)[0]
