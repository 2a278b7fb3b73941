"""Log-probabilities of chosen tokens from raw logits: each row's chosen token's logprob and
rank, and its most likely tokens'. The sampler asks for the sampled tokens', the prompt
logprobs for each prompt token's (from the logits of the position before it)."""

from __future__ import annotations

import torch

from engine_svc.messages import TokenLogprobs
from engine_svc.worker.random_sampling import kernel_takes


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int], kernels: bool
) -> list[TokenLogprobs]:
    """Row i's token_ids[i] and its num_top[i] most likely tokens, from logits [rows, vocab]:
    with the CPU kernels in one C++ call (engine_svc/kernels/csrc/logprobs.cpp), else
    log_softmax, one comparison and one top-k for all rows."""
    most = max(num_top, default=0)
    if kernel_takes(logits, kernels):
        chosen, ranks, values, ids = torch.ops.duoserve.token_logprobs(
            logits, token_ids.contiguous(), most
        )
    else:
        row_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = row_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (row_logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
        values, ids = row_logprobs.topk(most, dim=-1)
    chosen_logprobs, chosen_ids, rank_list = chosen.tolist(), token_ids.tolist(), ranks.tolist()
    top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(
            token_id=chosen_ids[row],
            logprob=chosen_logprobs[row],
            rank=rank_list[row],
            top_token_ids=top_ids[row][:top],
            top_logprobs=top_values[row][:top],
        )
        for row, top in enumerate(num_top)
    ]
