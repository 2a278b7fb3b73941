"""Which CPU fast path each module of a loaded model takes, by what this machine's kernels
and torch's oneDNN serve for the dtype (engine_svc/kernels)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine_svc.kernels import (
    bf16_pairs_available,
    one_row_copy_available,
    onednn_linear_available,
    packed_linear_available,
    row_gemv_available,
)
from engine_svc.layers.linear import Projection
from engine_svc.layers.norm import RMSNorm
from engine_svc.models.decode_layers import DecodeLayers
from engine_svc.models.llama import MLP, Attention, LlamaForCausalLM
from engine_svc.worker.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

# bfloat16 on AMX or AVX512-BF16: models whose projection weights take at most this, and at
# most this share of what the worker's memory budget leaves after the weights (the KV
# cache's and the activations' room), keep a second copy of them: oneDNN's prepacked layout
# for prompt steps beside the pairs of k (Projection.use_bf16_pairs' onednn_copy), or
# [out, in] for one-row steps beside oneDNN's layout where the pairs are not taken
# (Projection.use_onednn's keep_rows).
# Past either, the copy's memory goes to the KV cache.
ONE_ROW_COPY_MAX_BYTES = 1 << 30
ONE_ROW_COPY_ROOM_SHARE = 1 / 4


def one_row_copy_limit(budget_bytes: int | None, weight_bytes: int) -> int:
    """The most the one-row copy may take, for a worker with this memory budget (None: the
    budget does not size the KV cache, as with num_kv_blocks or outside an engine) and
    weights of this size."""
    if budget_bytes is None:
        return ONE_ROW_COPY_MAX_BYTES
    room = max(budget_bytes - weight_bytes, 0)
    return min(ONE_ROW_COPY_MAX_BYTES, int(room * ONE_ROW_COPY_ROOM_SHARE))


def use_fused_ops(
    model: LlamaForCausalLM,
    enabled: bool,
    dtype: torch.dtype,
    budget_bytes: int | None = None,
    decode_loop: bool = True,
) -> None:
    """RMSNorm (with the residual add), rotary and silu(gate) * up as the C++ CPU kernels'
    single passes, and the projections on packed weights where that kernel serves the dtype
    (bfloat16 on AVX512-BF16: packed in pairs of k for its dot products and AMX's tiles where
    in_features is even, prompt steps on a copy in oneDNN's prepacked layout where it fits
    one_row_copy_limit(budget_bytes); where torch's matmul is oneDNN's otherwise (an odd
    in_features; a build without AVX512-BF16's dot products, or on an AMX CPU without AMX's
    tiles): prepacked in oneDNN's layout, single rows through the row GEMV on a copy of the
    weights where it fits that limit; elsewhere a single row through the row GEMV, more
    rows through torch). `decode_loop`: decode steps
    run the layers in one C++ call where it describes them (models/decode_layers.py)."""
    model.fused_ops = enabled
    packed = enabled and packed_linear_available(dtype)
    onednn = enabled and onednn_linear_available(dtype)
    row_gemv = enabled and row_gemv_available(dtype)
    pairs = enabled and bf16_pairs_available(dtype)

    def takes_pairs(projection: Projection) -> bool:
        return pairs and projection.in_features % 2 == 0

    # Gate/up projections whose output only the fused silu(gate) * up reads.
    silu_gate_ups = {
        id(module.gate_up)
        for module in model.modules()
        if isinstance(module, MLP) and hasattr(module, "gate_up") and module.act == "silu"
    }

    # A second copy of the projection weights where it fits the limit: with the pairs
    # kernel, oneDNN's prepacked layout for prompt steps; on oneDNN's layout otherwise, the
    # [out, in] rows for one-row steps' GEMV.
    limit = one_row_copy_limit(budget_bytes, tensor_bytes(model))
    if pairs:
        copy_bytes = projection_bytes(model, dtype, counted=takes_pairs)
        keep_copy = onednn and copy_bytes <= limit
        steps, path = "prompt steps", "on oneDNN's prepacked layout"
    else:
        copy_bytes = projection_bytes(model, dtype)
        keep_copy = enabled and one_row_copy_available(dtype) and copy_bytes <= limit
        steps, path = "one-row steps", "through the row GEMV"
    if keep_copy:
        logger.info(
            "%s %s, on a second copy of the projection weights (%.2f GiB)",
            steps,
            path,
            copy_bytes / (1 << 30),
        )
    elif (pairs and onednn) or (enabled and one_row_copy_available(dtype)):
        logger.info(
            "no second copy of the projection weights for %s: its %.2f GiB is over %.2f GiB "
            "(a quarter of the memory budget's room past the weights, at most 1 GiB)",
            steps,
            copy_bytes / (1 << 30),
            limit / (1 << 30),
        )
    # Each projection's decode weights go to huge pages as soon as their layout is made.
    arena = HugePageArena(layout_bytes_bound(model, dtype)) if enabled else None
    for module in model.modules():
        if isinstance(module, Projection) and packed:
            module.pack()
        elif isinstance(module, Projection) and takes_pairs(module):
            module.use_bf16_pairs(onednn_copy=keep_copy, silu_halves=id(module) in silu_gate_ups)
        elif isinstance(module, Projection) and onednn:
            module.use_onednn(keep_rows=keep_copy and not pairs)
        elif isinstance(module, Projection) and row_gemv:
            module.use_row_gemv()
        elif isinstance(module, RMSNorm):
            # The C++ pass casts before the weight, as most families do.
            if enabled and not (module.weight_in_float32 and dtype != torch.float32):
                module.fuse()
        elif isinstance(module, Attention):
            module.fused_rotary = enabled
        elif isinstance(module, MLP):
            module.fused_act = enabled and module.act == "silu"
        if isinstance(module, Projection) and arena is not None:
            arena.take(decode_weights(module))
    if arena is not None:
        arena.finish()
    model.decode_layers = DecodeLayers.of(model) if decode_loop else None
    if model.decode_layers is not None:
        logger.info("decode steps run the decoder layers in one C++ loop")


def layout_bytes_bound(model: nn.Module, dtype: torch.dtype) -> int:
    """At most what the projections' chosen layouts take: each packed or paired layout pads
    its columns to a block (at most 64) and its rows to even, and a one-row copy may sit
    beside it (twice the weight)."""
    return sum(
        2 * (module.out_features + 64) * (module.in_features + 1) * dtype.itemsize
        for module in model.modules()
        if isinstance(module, Projection)
    )


def decode_weights(projection: Projection) -> list[torch.Tensor]:
    """The weights a decode step reads of this projection (Projection.kernel_args): its
    one-row weight and its main path's."""
    row_weight, weight, _ = projection.kernel_args()[0]
    return [t for t in (row_weight, weight) if t is not None]


def tensor_bytes(model: nn.Module) -> int:
    """What a model's parameters and buffers take."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def projection_bytes(
    model: nn.Module,
    dtype: torch.dtype,
    counted: Callable[[Projection], bool] = lambda _: True,
) -> int:
    """What a model's projection weights take in `dtype`, of the projections `counted`
    names, an LM head tied to the embeddings excluded."""
    return sum(
        module.in_features * module.out_features * dtype.itemsize
        for module in model.modules()
        if isinstance(module, Projection) and not module.shared_weight and counted(module)
    )
