"""Turn the logits of the sampled rows into tokens, one request's parameters per row.

Greedy rows take the argmax. Random rows go through temperature, top-k, top-p and min-p,
then one uniform draw each picks from the distribution (random_sampling.py). A seeded request
races Exp(1) numbers hashed from (seed, output index, token id) instead (seeded_sampling.py),
so its tokens do not depend on what else is in the batch, on preemption, or on pipelining,
even where the logits move in their last bits with the batch.
Only a request's allowed_token_ids are kept, then the tokens its bad words ban and, until it
has min_tokens output tokens, those that would end it are masked out; then its logit_bias is
added, then its penalties apply (vLLM's order). Logprobs are those of the raw model
output (before masks, biases, penalties and temperature), as vLLM's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine_svc.messages import TokenLogprobs
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.logprobs import token_logprobs
from engine_svc.worker.penalties import apply_penalties_
from engine_svc.worker.random_sampling import RowFilters, kernel_takes, sample
from engine_svc.worker.seeded_sampling import race, race_key


@dataclasses.dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    output_index: int  # how many tokens the request produced before this one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # masked out this step (bad words, min_tokens)
    # params.allowed_token_ids as a tensor: the runner's, made once a request; else made here.
    allowed_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        allowed = self.params.allowed_token_ids
        if self.allowed_index is None and allowed is not None:
            self.allowed_index = torch.tensor(allowed, dtype=torch.long)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, kernels: bool = False) -> None:
        self.device = device
        # With the CPU kernels loaded: argmax_rows (engine_svc/kernels/csrc/argmax.cpp),
        # torch.max's indices without its scalar loop; sample_rows and race_rows
        # (sample_rows.cpp, race_rows.cpp); token_logprobs (logprobs.cpp).
        self.kernels = kernels
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        if not want_logprobs and all(_plain_greedy(r) for r in rows):
            # The argmax of the model's own dtype: widening bfloat16 to float32 changes no
            # value, so no index, and costs a copy of [rows, vocab] floats every step.
            return self._argmax(logits).tolist(), [None] * len(rows)
        raw = logits  # the model's output, whose log-probabilities a request may want
        if any(_changes_logits(r) for r in rows):
            # One float32 copy, which the masks, biases and penalties change in place (else
            # the temperature's division makes the float32 copy).
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if any(r.allowed_index is not None for r in rows):
                _keep_allowed_(logits, rows)
            if any(r.banned_token_ids for r in rows):
                _mask_banned_(logits, rows)
            if any(r.params.logit_bias for r in rows):
                _add_logit_bias_(logits, rows)
            if any(r.params.has_penalties for r in rows):
                apply_penalties_(
                    logits,
                    rows,
                    [r.params.repetition_penalty for r in rows],
                    [r.params.frequency_penalty for r in rows],
                    [r.params.presence_penalty for r in rows],
                )

        if all(r.params.is_greedy for r in rows):
            tokens = self._argmax(logits)
        else:
            tokens = self._sample_random(logits, rows)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if want_logprobs:
            wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            for i, entry in zip(
                wanted, self._token_logprobs(raw, tokens, rows, wanted), strict=True
            ):
                logprobs[i] = entry
        return token_list, logprobs

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum (torch.argmax's answer, NaN first where a row has one)."""
        if kernel_takes(logits, self.kernels):
            return torch.ops.duoserve.argmax_rows(logits)
        # max's indices are argmax's, and on CPU 2.6x faster ([64, 49,152]: 0.85 vs 2.25 ms).
        return logits.max(dim=-1).indices

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Greedy rows' argmax; unseeded random rows draw with one uniform number each from
        the sampler's generator (random_sampling.py); seeded rows race with Exp(1) numbers
        hashed from (seed, output index, token id) (seeded_sampling.py)."""
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        unseeded = [
            i for i, r in enumerate(rows) if not r.params.is_greedy and r.params.seed is None
        ]
        seeded = [
            i for i, r in enumerate(rows) if not r.params.is_greedy and r.params.seed is not None
        ]
        if greedy:
            self._fill(tokens, logits, greedy, self._argmax)
        if unseeded:
            # float64: a top-p row may reuse what is left of its number after a rejection.
            uniforms = torch.rand(
                len(unseeded), generator=self.generator, device=self.device, dtype=torch.float64
            )
            filters = [_filters(rows[i]) for i in unseeded]
            self._fill(
                tokens, logits, unseeded, lambda part: sample(part, filters, uniforms, self.kernels)
            )
        if seeded:
            keys = [race_key(rows[i].params.seed or 0, rows[i].output_index) for i in seeded]
            filters = [_filters(rows[i]) for i in seeded]
            self._fill(tokens, logits, seeded, lambda part: race(part, filters, keys, self.kernels))
        return tokens

    def _token_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow], wanted: list[int]
    ) -> list[TokenLogprobs]:
        """The sampled tokens' logprobs of the rows in `wanted`, from the raw logits."""
        if len(wanted) == len(rows):
            part, token_ids = raw, tokens
        else:
            index = torch.tensor(wanted, device=raw.device)
            part, token_ids = raw.index_select(0, index), tokens.index_select(0, index)
        num_top = [rows[i].params.logprobs or 0 for i in wanted]
        return token_logprobs(part, token_ids, num_top, self.kernels)

    @staticmethod
    def _fill(
        tokens: torch.Tensor,
        logits: torch.Tensor,
        members: list[int],
        draw: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """tokens[members] = draw(logits[members]), without copies where members are all rows."""
        if len(members) == len(tokens):
            tokens.copy_(draw(logits))
            return
        index = torch.tensor(members, device=logits.device)
        tokens.index_copy_(0, index, draw(logits.index_select(0, index)))


# The smallest top_p the filters take: a positive top_p that rounds to 0 in float32 would
# keep no token, where the most likely one always stays.
_TOP_P_FLOOR = float(torch.finfo(torch.float32).tiny)


def _filters(row: SamplingRow) -> RowFilters:
    p = row.params
    return RowFilters(p.temperature, p.top_k, max(p.top_p, _TOP_P_FLOOR), p.min_p)


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, with nothing to change in the logits first."""
    return row.params.is_greedy and not _changes_logits(row)


def _changes_logits(row: SamplingRow) -> bool:
    params = row.params
    return bool(
        row.allowed_index is not None
        or row.banned_token_ids
        or params.logit_bias
        or params.has_penalties
    )


def _keep_allowed_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Logits of -inf for every token outside each row's allowed_token_ids, in place."""
    for i, row in enumerate(rows):
        if row.allowed_index is not None:
            token_ids = row.allowed_index.to(logits.device, non_blocking=True)
            kept = logits[i].index_select(0, token_ids)
            logits[i].fill_(float("-inf"))
            logits[i].index_copy_(0, token_ids, kept)


def _mask_banned_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Logits of -inf for each row's banned tokens, in place (before penalties and
    temperature, as vLLM's bad words and min_tokens processor), so no sampling method can
    pick them."""
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")


def _add_logit_bias_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each row's logit_bias added to its float32 logits, in place (after the min_tokens
    mask, so a held-back token stays -inf; before penalties and temperature, as vLLM)."""
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            token_ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=torch.float32, device=logits.device)
            logits[i].index_add_(0, token_ids, values)
