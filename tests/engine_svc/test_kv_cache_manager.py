"""KVCacheManager: prefix-cache lookup over chained block hashes, slot allocation, freeing."""

from __future__ import annotations

import pytest

from engine_svc.core.kv_cache.manager import KVCacheManager
from engine_svc.core.kv_cache.sizing import blocks_per_request
from engine_svc.core.request import Request
from engine_svc.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=4))


def prefill(manager: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt as the scheduler would; returns the prefix-hit tokens."""
    hits = manager.get_computed_blocks(request)
    num_hit_tokens = len(hits) * manager.block_size
    num_new = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new, hits) is not None
    manager.record_prefix_query(request.num_tokens, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def assert_all_blocks_free(manager: KVCacheManager) -> None:
    assert manager.pool.num_free_blocks == manager.num_blocks
    assert all(b.ref_count == 0 for b in manager.pool.blocks)
    assert manager.req_to_blocks == {}


def test_a_request_gets_enough_blocks_for_its_tokens() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(10)))

    new_block_ids = manager.allocate_slots(request, 10)

    assert new_block_ids is not None and len(new_block_ids) == 3
    assert manager.block_ids("a") == new_block_ids
    assert manager.pool.num_free_blocks == 5


def test_decode_takes_a_new_block_only_when_the_last_one_is_full() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(7)))
    prefill(manager, request)  # 7 tokens: 2 blocks, one slot left

    request.append_output_token(100)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1

    request.append_output_token(101)
    assert manager.allocate_slots(request, 1) is not None
    assert len(manager.block_ids("a")) == 3


def test_prefix_hits_cover_full_blocks_only() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    prefill(manager, make_request("a", list(range(10))))  # blocks [0-3] [4-7] and 2 tokens

    same_prompt = make_request("b", list(range(10)))
    shares_six_tokens = make_request("c", [*range(6), 50, 51, 52, 53])

    assert len(manager.get_computed_blocks(same_prompt)) == 2
    assert len(manager.get_computed_blocks(shares_six_tokens)) == 1


def test_the_same_block_after_a_different_prefix_is_not_a_hit() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    prefill(manager, make_request("a", [1, 1, 1, 1, 7, 7, 7, 7, 9]))
    prefill(manager, make_request("b", [2, 2, 2, 2, 9]))

    # Its first block is b's and its second has a's tokens, but a's came after [1, 1, 1, 1].
    mixed = make_request("c", [2, 2, 2, 2, 7, 7, 7, 7, 9])

    hits = manager.get_computed_blocks(mixed)
    assert [b.block_id for b in hits] == manager.block_ids("b")[:1]


def test_a_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    prefill(manager, make_request("a", list(range(12))))

    again = make_request("b", list(range(12)))
    num_hit_tokens = prefill(manager, again)

    assert num_hit_tokens == 8
    assert again.num_tokens - num_hit_tokens >= 1


def test_hit_blocks_are_shared_not_copied() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    prefill(manager, make_request("a", list(range(9))))
    num_free = manager.pool.num_free_blocks

    prefill(manager, make_request("b", list(range(9))))

    assert manager.block_ids("b")[:2] == manager.block_ids("a")[:2]
    assert manager.block_ids("b")[2] != manager.block_ids("a")[2]
    assert manager.pool.num_free_blocks == num_free - 1
    assert [manager.pool.blocks[i].ref_count for i in manager.block_ids("a")] == [2, 2, 1]


def test_a_block_filled_by_decode_steps_inside_it_is_published() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(6)))
    prefill(manager, request)  # 6 tokens: block 0 full and published, block 1 half
    for token in (100, 101):  # the last two slots of block 1: no new block
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    assert len(manager.block_ids("a")) == 2
    # Block 1 (tokens 4, 5, 100, 101) is full: a request with that prefix hits both blocks.
    other = make_request("b", [*range(6), 100, 101, 7])
    assert len(manager.get_computed_blocks(other)) == 2


def test_blocks_of_a_finished_request_are_still_hits_until_evicted() -> None:
    manager = KVCacheManager(3, BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)

    second = make_request("b", list(range(9)))
    assert prefill(manager, second) == 8
    manager.free(second)

    # Freed tail first, so the unshared last block goes before the shared prefix.
    make_room = make_request("c", [60, 61, 62])
    prefill(manager, make_room)
    assert len(manager.get_computed_blocks(make_request("d", list(range(9))))) == 2

    manager.free(make_room)
    assert_all_blocks_free(manager)


def test_hashing_a_waiting_request_ahead_gives_the_same_hits() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    prefill(manager, make_request("a", list(range(10))))
    ahead = make_request("b", list(range(10)))

    manager.hash_request(ahead)

    assert len(ahead.block_hashes) == 2  # full blocks only
    fresh = make_request("c", list(range(10)))
    assert manager.get_computed_blocks(ahead) == manager.get_computed_blocks(fresh)
    assert ahead.block_hashes == fresh.block_hashes


def test_no_hits_when_caching_is_off() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=False)
    prefill(manager, make_request("a", list(range(12))))

    assert prefill(manager, make_request("b", list(range(12)))) == 0
    assert manager.num_queried_tokens == 0
    assert manager.num_hit_tokens == 0


def test_prefix_counters_count_queried_and_hit_tokens() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)

    prefill(manager, make_request("a", list(range(10))))
    prefill(manager, make_request("b", list(range(10))))

    assert manager.num_queried_tokens == 20
    assert manager.num_hit_tokens == 8


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 12, 13, 16, 17, 40])
def test_can_allocate_agrees_with_allocate_slots(num_tokens: int) -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(num_tokens)))

    can = manager.can_allocate(request, num_tokens)
    result = manager.allocate_slots(request, num_tokens)

    assert can == (result is not None) == (num_tokens <= 16)
    manager.free(request)
    assert_all_blocks_free(manager)


def test_a_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(8)))
    prefill(manager, first)
    manager.free(first)  # its two full blocks stay cached

    too_long = make_request("b", list(range(20)))  # hits 2 cached blocks, needs 5 in all
    hits = manager.get_computed_blocks(too_long)
    assert len(hits) == 2
    ref_counts = [b.ref_count for b in manager.pool.blocks]

    assert not manager.can_allocate(too_long, 12, hits)
    assert manager.allocate_slots(too_long, 12, hits) is None

    assert [b.ref_count for b in manager.pool.blocks] == ref_counts
    assert manager.pool.num_free_blocks == 4
    assert "b" not in manager.req_to_blocks
    assert len(manager.get_computed_blocks(make_request("c", list(range(9))))) == 2


def test_reviving_cached_blocks_counts_against_the_free_blocks() -> None:
    manager = KVCacheManager(3, BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)  # 3 free blocks, 2 of them cached

    again = make_request("b", list(range(13)))  # 2 hits + 2 new blocks: 4 > 3
    hits = manager.get_computed_blocks(again)

    assert len(hits) == 2
    assert not manager.can_allocate(again, 5, hits)
    assert manager.allocate_slots(again, 5, hits) is None
    assert manager.can_allocate(again, 4, hits)
    assert manager.allocate_slots(again, 4, hits) is not None

    manager.free(again)
    assert_all_blocks_free(manager)


def test_discarded_uncomputed_blocks_are_not_hits() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    victim = make_request("a", list(range(12)))
    assert manager.allocate_slots(victim, 12) is not None  # scheduled, never run

    manager.discard_uncomputed(victim, 4)
    manager.free(victim)

    assert len(manager.get_computed_blocks(make_request("b", list(range(12))))) == 1


def test_every_block_is_free_after_all_requests_are_freed() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    requests = [make_request(str(i), [*range(8), i, i + 1, i + 2]) for i in range(4)]
    for request in requests:
        prefill(manager, request)
    for request in requests:
        request.append_output_token(99)
        assert manager.allocate_slots(request, 1) is not None

    for request in requests:
        manager.free(request)

    assert_all_blocks_free(manager)
    assert manager.reset_prefix_cache() is True


# ---- sliding windows (every layer attends over the last `attention_span` tokens) -----------


def test_a_windowed_request_releases_the_blocks_behind_its_window() -> None:
    """Span 6, blocks of 4: before computing position p, blocks wholly before p - 5 go back
    to the pool; their places read as block 0 (masked out), the rest keep their ids."""
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=False, attention_span=6)
    request = make_request("a", list(range(12)))
    prefill(manager, request)  # 12 tokens: 3 blocks
    prompt_blocks = manager.block_ids("a")
    assert manager.num_blocks_held("a") == 3

    held = []
    for token in range(100, 110):  # positions 12..21
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        held.append(manager.num_blocks_held("a"))
    # Position 12 sees 7..12 (blocks 1-3), 13 sees 8..13 (blocks 2-3), ..., 21 sees 16..21
    # (blocks 4-5): three blocks where a new block starts, else two.
    assert held == [3, 2, 2, 2, 3, 2, 2, 2, 3, 2]
    assert manager.block_ids("a")[:4] == [0, 0, 0, 0] and len(manager.block_ids("a")) == 6
    assert manager.pool.num_free_blocks == 8 - 2
    # Released blocks were free to reuse: the request's later blocks took them back.
    assert set(manager.block_ids("a")[4:]) <= set(prompt_blocks)

    manager.free(request)
    assert_all_blocks_free(manager)


def test_prefix_hits_before_the_window_are_not_taken() -> None:
    """A cached prefix of 5 blocks, then a token to compute at position 20 with span 6: only
    the hit blocks that hold positions 15..19 are touched; the older ones stay in the free
    list, cached, and the request's table reads 0 there."""
    manager = KVCacheManager(10, BLOCK_SIZE, enable_caching=True, attention_span=6)
    first = make_request("a", list(range(21)))
    prefill(manager, first)
    manager.free(first)

    second = make_request("b", list(range(21)))
    hits = manager.get_computed_blocks(second)
    assert len(hits) == 5
    assert manager.allocate_slots(second, 1, hits) is not None
    assert [b.ref_count for b in hits] == [0, 0, 0, 1, 1]
    assert manager.block_ids("b")[:3] == [0, 0, 0]
    assert manager.num_blocks_held("b") == 3  # two hits and the new block
    manager.free(second)
    assert_all_blocks_free(manager)


def test_a_request_needs_its_window_and_step_at_most_and_never_more_than_its_length() -> None:
    # Window 32 behind a 16-token step: 47 tokens, 6 blocks of 8, one more where they
    # straddle a boundary; never more than the whole request's 8 blocks of 64 tokens.
    assert blocks_per_request(1000, 8, attention_span=32, max_step_tokens=16) == 7
    assert blocks_per_request(64, 16, attention_span=48, max_step_tokens=16) == 4
    assert blocks_per_request(1000, 8) == 125
