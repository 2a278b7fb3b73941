"""A fixed pool of KV blocks with reference counts, an LRU free list and a prefix cache.

A block whose reference count drops to zero goes to the tail of the free list but keeps
its hash: until it is handed out again it can still be found by a later request with the
same prefix (a prefix-cache hit revives it). New blocks come from the head of the free
list, so the least recently freed blocks are evicted first. A freed block that holds no
cached content (a partial block, or caching off) goes to the head instead, as SGLang keeps
free memory apart from its cache: it is reused before any cached block is evicted, and the
blocks in use stay few and warm rather than cycling through the whole cache, whose pages a
CPU engine otherwise faults in one by one. A reset of the prefix cache puts every block
back in block-id order.
"""

from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is the LRU order; OrderedDict gives O(1) removal from the middle
        # when a cached block is revived.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving those that sat in the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass tail first):
        cached blocks to the tail of the free list, blocks holding nothing to its head."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that `block` is full and holds the tokens that `block_hash` names."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # the same content already lives in another block; keep that one
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache_block(self, block: KVBlock) -> None:
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused while blocks are in use, as vLLM does."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._free = OrderedDict((b.block_id, b) for b in self.blocks)
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
