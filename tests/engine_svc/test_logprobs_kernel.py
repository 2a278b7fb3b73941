"""The CPU kernel's logprobs (engine_svc/kernels/csrc/logprobs.cpp) against torch's
log_softmax, rank by comparison and topk: the same numbers to float rounding, the same ranks
and top tokens, through the sampler as a request sees them."""

from __future__ import annotations

import pytest
import torch

from engine_svc.kernels import cpu_kernels_available
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels_available(), "the CPU kernels did not build: see the warning logged"


def _logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * vocab)
    spread = torch.linspace(0.1, 8.0, rows).unsqueeze(1)
    return (torch.randn(rows, vocab, generator=generator) * spread).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "num_top"), [(49152, 5), (5003, 20), (37, 0), (40, 40)])
def test_token_logprobs_are_torch_s(dtype: torch.dtype, vocab: int, num_top: int) -> None:
    rows = 24
    logits = _logits(rows, vocab, dtype)
    # The argmax, a middling token and the least likely: ranks 1, some, vocab.
    picks = [logits[r].float().argmax() for r in range(0, rows, 3)]
    picks += [logits[r].float().argsort()[vocab // 2] for r in range(1, rows, 3)]
    picks += [logits[r].float().argmin() for r in range(2, rows, 3)]
    order = [*range(0, rows, 3), *range(1, rows, 3), *range(2, rows, 3)]
    tokens = torch.empty(rows, dtype=torch.long)
    tokens[order] = torch.stack(picks)
    chosen, ranks, values, ids = torch.ops.duoserve.token_logprobs(logits, tokens, num_top)

    expected = torch.log_softmax(logits.float(), dim=-1)
    expected_chosen = expected.gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(chosen, expected_chosen, rtol=1e-5, atol=1e-5)
    assert ranks.tolist() == ((expected > expected_chosen.unsqueeze(1)).sum(-1) + 1).tolist()
    assert ranks[0::3].tolist() == [1] * len(range(0, rows, 3))
    torch.testing.assert_close(values, expected.topk(num_top, dim=-1).values, rtol=1e-5, atol=1e-5)
    _assert_top_tokens(ids, values, expected)


def _assert_top_tokens(ids: torch.Tensor, values: torch.Tensor, expected: torch.Tensor) -> None:
    """Distinct tokens whose logprobs are the values given, best first, ties (bfloat16 has
    many) in any order, as torch's topk leaves them."""
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    torch.testing.assert_close(expected.gather(1, ids), values, rtol=1e-5, atol=1e-5)
    assert (values[:, 1:] <= values[:, :-1]).all()


def test_a_tie_ranks_as_torch_and_keeps_the_lower_id_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]])
    chosen, ranks, _, ids = torch.ops.duoserve.token_logprobs(logits, torch.tensor([4]), 4)
    assert ranks.tolist() == [1]  # no token is more likely than a tied maximum
    assert ids.tolist() == [[1, 2, 4, 3]]
    torch.testing.assert_close(chosen, torch.log_softmax(logits, -1)[:, 4])


def test_bad_arguments_are_refused() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.duoserve.token_logprobs(logits, torch.tensor([0, 10]), 1)
    with pytest.raises(RuntimeError, match="num_top"):
        torch.ops.duoserve.token_logprobs(logits, torch.tensor([0, 1]), 11)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.duoserve.token_logprobs(logits, torch.tensor([0, 1], dtype=torch.int32), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_gives_the_same_logprobs_with_and_without_kernels(dtype: torch.dtype) -> None:
    """Rows that want logprobs among rows that do not, greedy and random, some with a banned
    token (logprobs stay the raw model's)."""
    logits = _logits(8, 3001, dtype)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5), 0, [1], []),
        SamplingRow(SamplingParams(temperature=0.0), 0, [1], []),
        SamplingRow(SamplingParams(temperature=1.0, seed=3, logprobs=0), 2, [1], [4]),
        SamplingRow(SamplingParams(temperature=0.7, top_k=20, seed=4, logprobs=2), 1, [1], []),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 0, [1], [], (17, 18)),
        SamplingRow(SamplingParams(temperature=0.9, seed=5), 0, [1], []),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=20), 0, [1], []),
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.5, seed=6, logprobs=3), 5, [1], []),
    ]
    with_kernels = Sampler(torch.device("cpu"), kernels=True)(logits, rows)
    without = Sampler(torch.device("cpu"), kernels=False)(logits, rows)
    assert with_kernels[0] == without[0]
    for ours, theirs in zip(with_kernels[1], without[1], strict=True):
        assert (ours is None) == (theirs is None)
        if ours is None or theirs is None:
            continue
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert ours.logprob == pytest.approx(theirs.logprob, rel=1e-5, abs=1e-5)
        assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, rel=1e-5, abs=1e-5)
        # The same tokens, tied ones (bfloat16) in any order among themselves.
        by_value = dict(zip(theirs.top_token_ids, theirs.top_logprobs, strict=True))
        for token, value in zip(ours.top_token_ids, ours.top_logprobs, strict=True):
            assert token in by_value or value == pytest.approx(min(theirs.top_logprobs))
