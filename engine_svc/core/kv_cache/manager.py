"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, freeing.

The scheduler calls `can_allocate` / `allocate_slots` (check, then act) and `free`.

With an attention span (a model whose every layer attends over a sliding window), the
blocks that fall wholly before the window of the next token to compute are released as a
sequence grows, so its KV use stops growing at the window. A released block keeps its place
in the request's list as None (block positions are token positions / block_size); the
model runner still names the old block there, masked out of every layer's window, never
written. Released full blocks stay in the prefix cache until evicted, like any freed block.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_svc.core.kv_cache.block_hash import extend_block_hashes
from engine_svc.core.kv_cache.block_pool import BlockPool, KVBlock
from engine_svc.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        attention_span: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.attention_span = attention_span
        self.pool = BlockPool(num_blocks, enable_caching)
        # None: a block released out of every layer's window (attention_span).
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        # How many leading blocks of each request were already offered to the prefix cache.
        self._num_published: dict[str, int] = {}
        # Cumulative prefix-cache counters, in tokens (vLLM's prefix_cache_queries/hits).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix of a request that holds no blocks yet."""
        if not self.enable_caching:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        hits: list[KVBlock] = []
        # At least one token must be computed to produce logits, so a full hit stops a
        # block short.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hash_request(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        return self._num_blocks_to_take(request, num_new_tokens, computed_blocks) <= (
            self.pool.num_free_blocks
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` are prefix-cache hits for a request being scheduled for the first
        time; the request's computed tokens then start after them. Returns the ids of the
        newly allocated blocks, or None when they do not fit (nothing changes then).
        """
        if not computed_blocks and self.attention_span is None:
            held = self.req_to_blocks.get(request.request_id)
            num_total = request.num_computed_tokens + num_new_tokens
            if held and len(held) * self.block_size >= num_total:
                # Room in the blocks held (a decode step inside its last block: 15 steps of
                # 16): nothing to take or release, only a block that filled to publish.
                if self.enable_caching:
                    self._cache_full_blocks(request, held, num_total)
                return []
        if not computed_blocks:
            self._release_out_of_window(request)
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if computed_blocks:
            # Hits before the window of the first token to compute are not needed.
            skipped = self._num_out_of_window(len(computed_blocks) * self.block_size)
            self.pool.touch(list(computed_blocks[skipped:]))
            blocks.extend([None] * skipped)
            blocks.extend(computed_blocks[skipped:])
        num_total = request.num_computed_tokens + num_new_tokens
        num_total += len(computed_blocks) * self.block_size
        new_blocks = self.pool.get_new_blocks(self.blocks_needed(num_total) - len(blocks))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a sequence is the least likely to be shared, so it
            # should be evicted before the prefix.
            self.pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def discard_uncomputed(self, request: Request, num_computed_tokens: int) -> None:
        """Unpublish the request's blocks past `num_computed_tokens`: scheduled, never run."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[num_computed_tokens // self.block_size :]:
            if block is not None:
                self.pool.uncache_block(block)
        num_published = self._num_published.get(request.request_id, 0)
        self._num_published[request.request_id] = min(
            num_published, num_computed_tokens // self.block_size
        )

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks by position; a released one reads as block 0, which the
        window masks out."""
        return [0 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not None)

    def _release_out_of_window(self, request: Request) -> None:
        """Free the blocks before the window of the request's next token: that token, at
        position p = num_computed_tokens, and every later one attend only to positions
        after p - attention_span.

        With batches in flight (pipeline parallelism), num_computed_tokens counts tokens
        of a chunk still being computed, which may read a block freed here. That is safe
        because every stage runs its batches in order: a new owner of the block writes it
        in a later batch, after the in-flight one has read it."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_out = min(self._num_out_of_window(request.num_computed_tokens), len(blocks))
        released = []
        for index in range(num_out):
            block = blocks[index]
            if block is not None:
                released.append(block)
                blocks[index] = None
        if released:
            self.pool.free_blocks(released[::-1])

    def _num_out_of_window(self, position: int) -> int:
        """How many leading blocks lie wholly before the window of the token at `position`
        (positions after position - attention_span)."""
        if self.attention_span is None:
            return 0
        return max(0, (position - self.attention_span + 1) // self.block_size)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _num_blocks_to_take(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock]
    ) -> int:
        num_owned = len(self.req_to_blocks.get(request.request_id, ())) + len(computed_blocks)
        num_total = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = self.blocks_needed(num_total) - num_owned
        # Hits that sit in the free list leave it when touched (those in the window).
        skipped = self._num_out_of_window(len(computed_blocks) * self.block_size)
        num_revived = sum(1 for b in computed_blocks[skipped:] if b.ref_count == 0)
        return max(num_needed, 0) + num_revived

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVBlock | None], num_tokens: int
    ) -> None:
        # The tokens being computed this step are already known (prompt, or outputs that
        # were sampled before), so their blocks can be published as soon as scheduled.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        for index in range(start, num_full):
            block = blocks[index]
            if block is not None:
                self.pool.cache_block(block, request.block_hashes[index])
        self._num_published[request.request_id] = num_full
