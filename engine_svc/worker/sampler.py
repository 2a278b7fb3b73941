"""Turn the logits of the sampled rows into tokens, one request's parameters per row.

Greedy rows take the argmax. Random rows go through temperature, top-k, top-p and min-p,
then an exponential race (argmax of p / Exp(1) noise) that draws from the distribution. A
seeded request draws its noise from a generator seeded by (seed, output index), so its
tokens do not depend on what else is in the batch, on preemption, or on pipelining.
Until a request has min_tokens output tokens, the tokens that would end it are masked out.
Logprobs are those of the raw model output (before masks, penalties and temperature), as
vLLM's default.
"""

from __future__ import annotations

import dataclasses

import torch

from engine_svc.messages import TokenLogprobs
from engine_svc.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the seed space


@dataclasses.dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    output_index: int  # how many tokens the request produced before this one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # masked out this step (min_tokens)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, argmax_kernel: bool = False) -> None:
        self.device = device
        # The CPU kernels' argmax_rows (engine_svc/kernels/csrc/argmax.cpp): torch.max's
        # indices, without its scalar loop.
        self.argmax_kernel = argmax_kernel
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        if not want_logprobs and all(_plain_greedy(r) for r in rows):
            # The argmax of the model's own dtype: widening bfloat16 to float32 changes no
            # value, so no index, and costs a copy of [rows, vocab] floats every step.
            return self._argmax(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(r.banned_token_ids for r in rows):
            logits = _mask_banned(logits, rows)
        if any(r.params.has_penalties for r in rows):
            logits = self._apply_penalties(logits, rows)

        if all(r.params.is_greedy for r in rows):
            tokens = self._argmax(logits)
        else:
            tokens = self._sample_random(logits, rows)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if row.params.logprobs is not None:
                    logprobs[i] = _token_logprobs(
                        raw_logprobs[i], token_list[i], row.params.logprobs
                    )
        return token_list, logprobs

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum (torch.argmax's answer, NaN first where a row has one)."""
        if (
            self.argmax_kernel
            and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.stride(-1) == 1
        ):
            return torch.ops.duoserve.argmax_rows(logits)
        # max's indices are argmax's, and on CPU 2.6x faster ([64, 49,152]: 0.85 vs 2.25 ms).
        return logits.max(dim=-1).indices

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            p = row.params
            if not p.has_penalties:
                continue
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, device=self.device)
                values = logits[i, seen]
                values = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty
                )
                logits[i, seen] = values
            if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(
                    torch.tensor(row.output_token_ids, device=self.device), minlength=vocab
                ).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts
                logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy_tokens = self._argmax(logits)
        temperatures = torch.tensor(
            [r.params.temperature if not r.params.is_greedy else 1.0 for r in rows],
            device=self.device,
        )
        logits = logits / temperatures.unsqueeze(1)
        logits = _apply_top_k_top_p(logits, rows, self.device)
        probs = torch.softmax(logits, dim=-1)
        min_ps = [r.params.min_p for r in rows]
        if any(min_ps):
            threshold = torch.tensor(min_ps, device=self.device).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None and not row.params.is_greedy:
                seed = (row.params.seed * _SEED_MIX + row.output_index) % (2**63)
                self._row_generator.manual_seed(seed)
                noise[i].exponential_(generator=self._row_generator)
        sampled = self._argmax(probs / noise)
        is_greedy = torch.tensor([r.params.is_greedy for r in rows], device=self.device)
        return torch.where(is_greedy, greedy_tokens, sampled)


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, with nothing to change in the logits first."""
    return row.params.is_greedy and not row.banned_token_ids and not row.params.has_penalties


def _mask_banned(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logits of -inf for each row's banned tokens (before penalties and temperature, as
    vLLM's min_tokens processor), so no sampling method can pick them."""
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    return logits


def _apply_top_k_top_p(
    logits: torch.Tensor, rows: list[SamplingRow], device: torch.device
) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_ks = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    top_ps = [r.params.top_p for r in rows]
    use_k = any(k < vocab for k in top_ks)
    use_p = any(p < 1.0 for p in top_ps)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.tensor(top_ks, device=device).unsqueeze(1)
        mask |= torch.arange(vocab, device=device).unsqueeze(0) < (vocab - k)
    if use_p:
        p = torch.tensor(top_ps, device=device).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        mask |= probs.cumsum(dim=-1) <= 1 - p
        mask[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _token_logprobs(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprob = row_logprobs[token_id]
    rank = int((row_logprobs > logprob).sum().item()) + 1
    top_ids: list[int] = []
    top_values: list[float] = []
    if num_top:
        values, ids = row_logprobs.topk(num_top)
        top_ids, top_values = ids.tolist(), values.tolist()
    return TokenLogprobs(
        token_id=token_id,
        logprob=float(logprob.item()),
        rank=rank,
        top_token_ids=top_ids,
        top_logprobs=top_values,
    )
