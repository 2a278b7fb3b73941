"""Per-request state the model runner keeps, and the flattened tensors of one step."""

from __future__ import annotations

import dataclasses

import torch

from engine_svc.core.sched.output import ScheduledRequest
from engine_svc.layers.attention import (
    AttentionMetadata,
    DecodeKernelInputs,
    PrefillChunk,
    PrefillKernelInputs,
)
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.sampler import SamplingRow


@dataclasses.dataclass(slots=True)
class RunnerRequestState:
    sampling_params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]  # prompt and every sampled token, kept in step with the scheduler
    block_ids: list[int]

    def sampling_row(self) -> SamplingRow:
        n = self.num_prompt_tokens
        has_penalties = self.sampling_params.has_penalties
        return SamplingRow(
            params=self.sampling_params,
            output_index=len(self.token_ids) - n,
            prompt_token_ids=self.token_ids[:n] if has_penalties else [],
            output_token_ids=self.token_ids[n:] if has_penalties else [],
        )


@dataclasses.dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the batch whose logits are sampled
    sample_request_ids: list[str]


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    states: dict[str, RunnerRequestState],
    block_size: int,
    is_causal: bool,
    device: torch.device,
    dtype: torch.dtype,
    decode_kernel: bool = False,
    prefill_kernel: bool = False,
) -> ModelInputs:
    """Flatten one step: single-token (decode) requests first, then prefill chunks.
    With `decode_kernel`, decodes get int32 block tables and context lengths for the C++
    kernel instead of a padding mask; with `prefill_kernel`, causal chunks that start a
    prompt go to the C++ prefill kernel together."""
    decodes = [s for s in scheduled if len(s.token_ids) == 1]
    prefills = [s for s in scheduled if len(s.token_ids) > 1]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_indices: list[int] = []
    sample_ids: list[str] = []
    tables: list[list[int]] = []
    context_lens: list[int] = []
    for row, entry in enumerate(decodes):
        state = states[entry.request_id]
        pos = entry.num_computed_tokens
        input_ids.append(entry.token_ids[0])
        positions.append(pos)
        slots.append(state.block_ids[pos // block_size] * block_size + pos % block_size)
        tables.append(state.block_ids)
        context_lens.append(pos + 1)
        if pos + 1 == len(state.token_ids):
            sample_indices.append(row)
            sample_ids.append(entry.request_id)

    chunks: list[PrefillChunk] = []
    kernel_chunks: list[tuple[int, int]] = []  # (query_start, length)
    slot_pieces = [torch.tensor(slots, dtype=torch.long)]
    for entry in prefills:
        state = states[entry.request_id]
        start, length = entry.num_computed_tokens, len(entry.token_ids)
        query_start = len(input_ids)
        input_ids.extend(entry.token_ids)
        positions.extend(range(start, start + length))
        table = torch.tensor(state.block_ids, dtype=torch.long)
        slot_pieces.append(_slots(table, torch.arange(start, start + length), block_size))
        chunk = PrefillChunk(query_start, length, None, None)
        if start > 0:
            context = torch.arange(start + length)
            chunk.context_slots = _slots(table, context, block_size).to(device)
            query_pos = torch.arange(start, start + length).unsqueeze(1)
            chunk.mask = _additive_mask(context.unsqueeze(0) <= query_pos, dtype, device)
        if start == 0 and prefill_kernel and is_causal:
            kernel_chunks.append((query_start, length))
        else:
            chunks.append(chunk)
        if start + length == len(state.token_ids):
            sample_indices.append(query_start + length - 1)
            sample_ids.append(entry.request_id)

    block_tables = mask = kernel_inputs = None
    if decodes:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        if decode_kernel:
            block_tables = torch.tensor(padded, dtype=torch.int32, device=device)
            kernel_inputs = DecodeKernelInputs(
                context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
                max_context_len=max(context_lens),
            )
        else:
            block_tables = torch.tensor(padded, device=device)
            lens = torch.tensor(context_lens, device=device)
            keys = torch.arange(width * block_size, device=device)
            visible = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(len(decodes), 1, 1, -1)
            mask = _additive_mask(visible, dtype, device)

    prefill_inputs = None
    if kernel_chunks:
        spans = torch.tensor(kernel_chunks, dtype=torch.int32, device=device)
        prefill_inputs = PrefillKernelInputs(spans[:, 0].contiguous(), spans[:, 1].contiguous())
    attention = AttentionMetadata(
        slot_mapping=torch.cat(slot_pieces).to(device),
        num_decodes=len(decodes),
        decode_block_tables=block_tables,
        decode_mask=mask,
        prefills=chunks,
        is_causal=is_causal,
        decode_kernel=kernel_inputs,
        prefill_kernel=prefill_inputs,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attention=attention,
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        sample_request_ids=sample_ids,
    )


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible.to(device), float("-inf"))


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size
