"""BlockPool: reference counts, the LRU free list and the prefix-cache index of full blocks."""

from __future__ import annotations

import pytest

from engine_svc.core.kv_cache.block_hash import hash_block
from engine_svc.core.kv_cache.block_pool import BlockPool


def block_hash(*token_ids: int) -> bytes:
    return hash_block(None, list(token_ids))


def test_a_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_new_blocks_hold_one_reference_and_leave_the_free_list() -> None:
    pool = BlockPool(4, enable_caching=True)

    blocks = pool.get_new_blocks(3)

    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert len({b.block_id for b in blocks}) == 3
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(2, enable_caching=True)
    pool.get_new_blocks(1)

    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)

    assert pool.num_free_blocks == 1


def test_a_shared_block_returns_to_the_free_list_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_count == 2

    pool.free_blocks([block])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 1

    pool.free_blocks([block])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 2


def test_the_least_recently_freed_cached_block_is_handed_out_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    for i, block in enumerate((a, b, c)):
        pool.cache_block(block, block_hash(i))

    pool.free_blocks([b])
    pool.free_blocks([c])
    pool.free_blocks([a])

    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [b.block_id, c.block_id, a.block_id]


def test_cached_blocks_freed_together_are_evicted_in_the_order_given() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, block_hash(i))

    pool.free_blocks(blocks[::-1])  # what the KV manager does: tail first

    assert pool.get_new_blocks(1)[0] is blocks[2]


def test_a_freed_block_holding_nothing_is_reused_before_any_cached_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    cached, empty, other = pool.get_new_blocks(3)
    pool.cache_block(cached, block_hash(1))

    pool.free_blocks([cached])
    pool.free_blocks([empty])  # no hash: to the head, ahead of the never-used block 3 too
    pool.free_blocks([other])

    assert pool.get_new_blocks(4) == [other, empty, pool.blocks[3], cached]
    assert pool.get_cached_block(block_hash(1)) is None  # evicted last, when it had to be


def test_a_freed_block_keeps_its_hash_and_a_prefix_hit_revives_it() -> None:
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, block_hash(1, 2))
    pool.free_blocks([block])

    hit = pool.get_cached_block(block_hash(1, 2))
    assert hit is block
    pool.touch([hit])

    assert block.ref_count == 1
    assert pool.num_free_blocks == 1
    # Revived, so not handed out to someone else.
    assert pool.get_new_blocks(1)[0] is not block


def test_evicting_a_cached_block_drops_its_hash() -> None:
    pool = BlockPool(1, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, block_hash(1, 2))
    pool.free_blocks([block])

    [reused] = pool.get_new_blocks(1)

    assert reused is block
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash(1, 2)) is None


def test_the_first_block_cached_for_some_content_stays_the_one_found() -> None:
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)

    pool.cache_block(first, block_hash(5))
    pool.cache_block(second, block_hash(5))

    assert pool.get_cached_block(block_hash(5)) is first
    assert second.block_hash is None


def test_uncaching_a_block_forgets_its_content() -> None:
    pool = BlockPool(1, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, block_hash(5))

    pool.uncache_block(block)

    assert pool.get_cached_block(block_hash(5)) is None
    assert block.block_hash is None


def test_nothing_is_cached_when_caching_is_off() -> None:
    pool = BlockPool(1, enable_caching=False)
    [block] = pool.get_new_blocks(1)

    pool.cache_block(block, block_hash(5))

    assert pool.get_cached_block(block_hash(5)) is None


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use() -> None:
    pool = BlockPool(2, enable_caching=True)
    cached, in_use = pool.get_new_blocks(2)
    pool.cache_block(cached, block_hash(5))
    pool.free_blocks([cached])

    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(block_hash(5)) is cached

    pool.free_blocks([in_use])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(block_hash(5)) is None
    assert cached.block_hash is None
    assert pool.get_new_blocks(2) == pool.blocks  # back in block-id order
