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
    # The tokens that would end the request (its stop token ids, and EOS unless it ignores
    # EOS): never sampled before it has min_tokens output tokens.
    held_back_token_ids: tuple[int, ...] = ()
    # allowed_token_ids as an index into a row of the logits, made once.
    allowed_index: torch.Tensor | None = None

    @classmethod
    def new(
        cls,
        sampling_params: SamplingParams,
        num_prompt_tokens: int,
        token_ids: list[int],
        block_ids: list[int],
        eos_token_ids: tuple[int, ...],
    ) -> RunnerRequestState:
        held_back: tuple[int, ...] = ()
        if sampling_params.min_tokens:
            held_back = tuple(sorted(sampling_params.ending_token_ids(eos_token_ids)))
        allowed = sampling_params.allowed_token_ids
        allowed_index = None if allowed is None else torch.tensor(allowed, dtype=torch.long)
        return cls(
            sampling_params, num_prompt_tokens, token_ids, block_ids, held_back, allowed_index
        )

    def sampling_row(self) -> SamplingRow:
        n = self.num_prompt_tokens
        output_index = len(self.token_ids) - n
        params = self.sampling_params
        held_back = params.min_tokens > output_index
        banned = self.held_back_token_ids if held_back else ()
        if params.bad_words_token_ids:
            tail = self.token_ids[max(n, len(self.token_ids) - params.bad_word_span) :]
            bans = params.bad_word_bans(tail)
            banned = tuple(sorted(bans.union(banned))) if bans else banned
        return SamplingRow(
            params=params,
            output_index=output_index,
            prompt_token_ids=self.token_ids[:n] if params.has_penalties else [],
            output_token_ids=self.token_ids[n:] if params.has_penalties else [],
            banned_token_ids=banned,
            allowed_index=self.allowed_index,
        )


@dataclasses.dataclass(slots=True)
class PromptLogprobRows:
    """Rows `row` to `row + count - 1` of a step whose logits give the prompt logprobs of a
    request's prompt tokens `first` to `first + count - 1` (each from the position before)."""

    request_id: str
    row: int
    first: int
    count: int
    num_top: int


@dataclasses.dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the batch whose logits are sampled
    sample_request_ids: list[str]
    prompt_logprob_rows: list[PromptLogprobRows] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _FlatBatch:
    """The step's rows as Python lists, decodes first, until they become tensors."""

    input_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    sample_indices: list[int] = dataclasses.field(default_factory=list)
    sample_request_ids: list[str] = dataclasses.field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = dataclasses.field(default_factory=list)

    def note_prompt_rows(
        self, row: int, request_id: str, start: int, length: int, state: RunnerRequestState
    ) -> None:
        """Input positions start.. at `row`.. give the logprobs of the prompt tokens after
        them, for a request that asked for its prompt's."""
        num_top = state.sampling_params.prompt_logprobs
        count = min(length, state.num_prompt_tokens - 1 - start)
        if num_top is not None and count > 0:
            self.prompt_logprob_rows.append(
                PromptLogprobRows(request_id, row, start + 1, count, num_top)
            )

    def sample_if_done(
        self, row: int, request_id: str, end: int, state: RunnerRequestState
    ) -> None:
        """A request whose input ends at this row samples its next token here."""
        if end == len(state.token_ids):
            self.sample_indices.append(row)
            self.sample_request_ids.append(request_id)


@dataclasses.dataclass(slots=True)
class _DecodeRows:
    slots: list[int]  # the cache slot each decode token writes
    block_tables: list[list[int]]
    context_lens: list[int]


@dataclasses.dataclass(slots=True)
class _PrefillRows:
    slots: list[torch.Tensor]  # per chunk, the cache slots its tokens write
    chunks: list[PrefillChunk]  # the chunks that attend through SDPA
    kernel_chunks: list[tuple[int, int]]  # (query_start, length): the C++ prefill kernel's


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
    batch = _FlatBatch()
    decodes = _decode_rows(
        batch, [s for s in scheduled if len(s.token_ids) == 1], states, block_size
    )
    prefills = _prefill_rows(
        batch,
        [s for s in scheduled if len(s.token_ids) > 1],
        states,
        block_size,
        is_causal and prefill_kernel,
        device,
        dtype,
    )
    return ModelInputs(
        input_ids=torch.tensor(batch.input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(batch.positions, dtype=torch.long, device=device),
        attention=_attention_metadata(
            decodes, prefills, block_size, is_causal, device, dtype, decode_kernel
        ),
        sample_indices=torch.tensor(batch.sample_indices, dtype=torch.long, device=device),
        sample_request_ids=batch.sample_request_ids,
        prompt_logprob_rows=batch.prompt_logprob_rows,
    )


def _decode_rows(
    batch: _FlatBatch,
    decodes: list[ScheduledRequest],
    states: dict[str, RunnerRequestState],
    block_size: int,
) -> _DecodeRows:
    rows = _DecodeRows(slots=[], block_tables=[], context_lens=[])
    for entry in decodes:
        state = states[entry.request_id]
        position = entry.num_computed_tokens
        batch.note_prompt_rows(len(batch.input_ids), entry.request_id, position, 1, state)
        batch.sample_if_done(len(batch.input_ids), entry.request_id, position + 1, state)
        batch.input_ids.append(entry.token_ids[0])
        batch.positions.append(position)
        block = state.block_ids[position // block_size]
        rows.slots.append(block * block_size + position % block_size)
        rows.block_tables.append(state.block_ids)
        rows.context_lens.append(position + 1)
    return rows


def _prefill_rows(
    batch: _FlatBatch,
    prefills: list[ScheduledRequest],
    states: dict[str, RunnerRequestState],
    block_size: int,
    use_kernel: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> _PrefillRows:
    """Chunks that start a prompt go to the kernel when `use_kernel`; a chunk after cached
    tokens gathers its context from the cache through its slots, under a causal mask."""
    rows = _PrefillRows(slots=[], chunks=[], kernel_chunks=[])
    for entry in prefills:
        state = states[entry.request_id]
        start, length = entry.num_computed_tokens, len(entry.token_ids)
        query_start = len(batch.input_ids)
        batch.note_prompt_rows(query_start, entry.request_id, start, length, state)
        batch.input_ids.extend(entry.token_ids)
        batch.positions.extend(range(start, start + length))
        table = torch.tensor(state.block_ids, dtype=torch.long)
        rows.slots.append(_slots(table, torch.arange(start, start + length), block_size))
        if start == 0 and use_kernel:
            rows.kernel_chunks.append((query_start, length))
        else:
            chunk = PrefillChunk(query_start, length, None, None)
            if start > 0:
                context = torch.arange(start + length)
                chunk.context_slots = _slots(table, context, block_size).to(device)
                query_positions = torch.arange(start, start + length).unsqueeze(1)
                chunk.mask = _additive_mask(context.unsqueeze(0) <= query_positions, dtype, device)
            rows.chunks.append(chunk)
        batch.sample_if_done(query_start + length - 1, entry.request_id, start + length, state)
    return rows


def _attention_metadata(
    decodes: _DecodeRows,
    prefills: _PrefillRows,
    block_size: int,
    is_causal: bool,
    device: torch.device,
    dtype: torch.dtype,
    decode_kernel: bool,
) -> AttentionMetadata:
    """Decodes read the cache through padded block tables: with the C++ kernel, as int32
    with their context lengths; without it, under an additive padding mask."""
    block_tables = mask = lens = kernel_inputs = None
    num_decodes = len(decodes.context_lens)
    if num_decodes:
        width = max(len(t) for t in decodes.block_tables)
        padded = [t + [0] * (width - len(t)) for t in decodes.block_tables]
        if decode_kernel:
            block_tables = torch.tensor(padded, dtype=torch.int32, device=device)
            kernel_inputs = DecodeKernelInputs(
                context_lens=torch.tensor(decodes.context_lens, dtype=torch.int32, device=device),
                max_context_len=max(decodes.context_lens),
            )
        else:
            block_tables = torch.tensor(padded, device=device)
            lens = torch.tensor(decodes.context_lens, device=device)
            keys = torch.arange(width * block_size, device=device)
            visible = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(num_decodes, 1, 1, -1)
            mask = _additive_mask(visible, dtype, device)
    prefill_inputs = None
    if prefills.kernel_chunks:
        spans = torch.tensor(prefills.kernel_chunks, dtype=torch.int32, device=device)
        prefill_inputs = PrefillKernelInputs(spans[:, 0].contiguous(), spans[:, 1].contiguous())
    decode_slots = torch.tensor(decodes.slots, dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=torch.cat([decode_slots, *prefills.slots]).to(device),
        num_decodes=num_decodes,
        decode_block_tables=block_tables,
        decode_mask=mask,
        prefills=prefills.chunks,
        decode_context_lens=lens,
        is_causal=is_causal,
        decode_kernel=kernel_inputs,
        prefill_kernel=prefill_inputs,
    )


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible.to(device), float("-inf"))


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size
