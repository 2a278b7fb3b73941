"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob, rank and most
likely alternatives, from the logits of the position before it, as its chunk of the prompt
runs. The logits of a long prompt do not fit at once ([tokens, vocab] float32), so they are
computed a bounded block of rows at a time."""

from __future__ import annotations

import torch

from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.worker.input_batch import PromptLogprobRows, RunnerRequestState
from engine_svc.worker.logprobs import token_logprobs
from engine_svc.worker.outputs import PromptLogprobsChunk

# Rows of logits at a time: [256, 49152] float32 is 50 MB. The activation profile sizes the
# logits of a step for this many rows, or max_num_seqs if more.
BLOCK_ROWS = 256


def compute_prompt_logprobs(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    spans: list[PromptLogprobRows],
    states: dict[str, RunnerRequestState],
    kernels: bool,
    samples: bool,
) -> dict[str, PromptLogprobsChunk]:
    """The step's prompt logprobs, per request. Every tensor rank of the last stage calls
    this (computing logits gathers the vocabulary across them); the rank that samples
    (`samples`) turns them into logprobs."""
    rows: list[int] = []
    targets: list[int] = []
    num_top: list[int] = []
    for span in spans:
        rows.extend(range(span.row, span.row + span.count))
        targets.extend(states[span.request_id].token_ids[span.first : span.first + span.count])
        num_top.extend([span.num_top] * span.count)
    entries = []
    for begin in range(0, len(rows), BLOCK_ROWS):
        end = min(begin + BLOCK_ROWS, len(rows))
        index = torch.tensor(rows[begin:end], dtype=torch.long, device=hidden.device)
        logits = model.compute_logits(hidden.index_select(0, index))
        if samples:
            token_ids = torch.tensor(targets[begin:end], dtype=torch.long, device=hidden.device)
            entries.extend(token_logprobs(logits, token_ids, num_top[begin:end], kernels))
        del logits  # before the next block's: one block of logits at a time
    if not samples:
        return {}
    chunks: dict[str, PromptLogprobsChunk] = {}
    offset = 0
    for span in spans:
        chunks[span.request_id] = PromptLogprobsChunk(
            span.first, entries[offset : offset + span.count]
        )
        offset += span.count
    return chunks
