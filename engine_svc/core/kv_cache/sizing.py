"""How many KV blocks fit: the memory budget minus weights and the activation peak."""

from __future__ import annotations

import dataclasses
import os

from engine_svc.config import EngineConfig

GiB = 1 << 30

# On CPU, with no budget given: this much for all workers together, or a quarter of the
# machine's memory where that is less.
CPU_DEFAULT_BUDGET_BYTES = 4 * GiB


def cpu_worker_budget_bytes(config: EngineConfig) -> int | None:
    """The budget each CPU worker's weights, activations and KV cache share, for the choices
    a worker makes before the KV cache is sized (fast_paths.one_row_copy_limit); None where
    num_kv_blocks sizes the cache instead."""
    if config.num_kv_blocks is not None:
        return None
    return cpu_budget_bytes(config.kv_cache_memory_bytes, config.world_size)


def cpu_budget_bytes(configured_bytes: int | None, num_workers: int) -> int:
    """One CPU worker's share of the budget for weights, activations and KV cache: the
    configured one, or the default; the workers share the host's memory."""
    if configured_bytes is not None:
        return configured_bytes // num_workers
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(CPU_DEFAULT_BUDGET_BYTES, physical // 4) // num_workers


class KVCacheTooSmallError(RuntimeError):
    """One request of the maximum length would not fit: refuse to start."""


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    blocks_per_request: int  # the most one request of max_model_len holds at once

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of the maximum length fit at once."""
        return self.num_blocks / self.blocks_per_request

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens ({self.num_blocks * self.bytes_per_block / GiB:.2f} GiB); "
            f"max concurrency for {self.max_model_len}-token requests: "
            f"{self.max_concurrency:.2f}x"
        )


def plan_kv_cache(
    *,
    budget_bytes: int,
    weight_bytes: int,
    activation_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_blocks_override: int | None = None,
    attention_span: int | None = None,
    max_step_tokens: int | None = None,
) -> KVCachePlan:
    needed = blocks_per_request(max_model_len, block_size, attention_span, max_step_tokens)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    else:
        available = budget_bytes - weight_bytes - activation_bytes
        # More than max_num_seqs requests of the maximum length can ever hold is dead
        # memory (for small models it would be most of the budget).
        num_blocks = min(max(available, 0) // bytes_per_block, max_num_seqs * needed)
    plan = KVCachePlan(num_blocks, block_size, bytes_per_block, max_model_len, needed)
    if num_blocks < needed:
        source = (
            "num_kv_blocks"
            if num_blocks_override is not None
            else (
                f"a budget of {budget_bytes / GiB:.2f} GiB minus weights "
                f"({weight_bytes / GiB:.2f} GiB) and activations "
                f"({activation_bytes / GiB:.2f} GiB)"
            )
        )
        raise KVCacheTooSmallError(
            f"{source} leaves {num_blocks} KV blocks, but one request of max_model_len="
            f"{max_model_len} needs {needed}. Raise the KV-cache memory budget or lower "
            "max_model_len."
        )
    return plan


def blocks_per_request(
    max_model_len: int,
    block_size: int,
    attention_span: int | None = None,
    max_step_tokens: int | None = None,
) -> int:
    """The most KV blocks one request holds at once: its whole length; or, when every layer
    attends over a window (attention_span), the window behind its longest step and that
    step, plus one block where they straddle a boundary (engine_svc/core/kv_cache/manager.py
    releases the blocks before the window)."""
    whole = -(-max_model_len // block_size)
    if attention_span is None or max_step_tokens is None:
        return whole
    return min(whole, -(-(attention_span - 1 + max_step_tokens) // block_size) + 1)
