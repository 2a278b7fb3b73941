"""Scheduler: prefix-cache hits, caching off, the cache reset, and request ids, with a fake
runner (scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shared.errors import InvalidRequestError
from tests.engine_svc.scheduler_harness import (
    FakeEngine,
    expected_tokens,
    make_request,
)

# ---- prefix caching ---------------------------------------------------------------------


def test_a_repeated_prompt_hits_the_prefix_cache(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine()
    prompt = list(range(12))
    engine.add(make_request("first", prompt, max_tokens=2))
    engine.run()

    engine.add(make_request("again", prompt, max_tokens=2))
    results = engine.run()

    assert engine.entries_of("again")[0] == (8, 4)  # the last block is recomputed
    assert results["again"].num_cached_tokens == 8
    assert results["first"].num_cached_tokens == 0
    assert results["again"].token_ids == results["first"].token_ids
    stats = engine.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24, 8)


def test_no_prefix_hits_when_prefix_caching_is_off(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(enable_prefix_caching=False)
    prompt = list(range(12))
    engine.add(make_request("first", prompt, max_tokens=2))
    engine.run()

    engine.add(make_request("again", prompt, max_tokens=2))
    results = engine.run()

    assert engine.entries_of("again")[0] == (0, 12)
    assert results["again"].num_cached_tokens == 0
    stats = engine.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache_is_refused_while_requests_hold_blocks(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", list(range(12)), max_tokens=2))
    engine.step()

    assert engine.scheduler.reset_prefix_cache() is False
    engine.run()
    assert engine.scheduler.reset_prefix_cache() is True

    engine.add(make_request("b", list(range(12)), max_tokens=2))
    assert engine.run()["b"].num_cached_tokens == 0


# ---- request ids ----------------------------------------------------------------------


def test_a_duplicate_request_id_is_rejected_until_the_first_finishes(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine()
    engine.add(make_request("a", [1, 2], max_tokens=2))

    with pytest.raises(InvalidRequestError) as error:
        engine.add(make_request("a", [3, 4], max_tokens=2))

    assert error.value.field == "request_id"
    assert engine.run()["a"].token_ids == expected_tokens([2], 2)
    engine.add(make_request("a", [3, 4], max_tokens=2))
    engine.run()
