"""BlockPool and KVCacheManager: allocation, reference counts, prefix caching."""

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request


def test_allocate_and_free_track_usage():
    pool = BlockPool(10)
    blocks = pool.allocate(4)
    assert len(set(blocks)) == 4
    assert pool.usage == pytest.approx(0.4)
    pool.free(blocks)
    assert pool.usage == 0.0
    pool.check_integrity()


def test_allocation_that_does_not_fit_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free == 1


def test_double_free_is_caught():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often than it was taken"):
        pool.free([block])


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        BlockPool(0)


def test_integrity_check_detects_corruption():
    pool = BlockPool(4)
    pool.allocate(1)
    pool._ref_counts[3] = 1  # a block counted as used but still in the free queue
    with pytest.raises(AssertionError, match="block 3"):
        pool.check_integrity()


def _request(rid, tokens):
    return Request(rid, tokens)


def _computed(manager, request, num_tokens):
    request.num_computed_tokens = num_tokens
    manager.cache_computed(request)


def test_block_table_grows_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 5) is not None
    assert len(kv.block_table("a")) == 2
    assert kv.allocate("a", 8) == []  # still fits
    assert len(kv.allocate("a", 9)) == 1
    assert len(kv.block_table("a")) == 3
    kv.free("a")
    assert kv.usage == 0.0
    kv.check_integrity()


def test_a_live_prompt_shares_its_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _request("a", list(range(10)))  # two full blocks + 2 tokens
    kv.allocate("a", a.num_tokens)
    _computed(kv, a, 10)
    b = _request("b", [*range(8), 99, 98, 97])
    shared = kv.match_prefix(b)
    assert shared == kv.block_table("a")[:2]
    kv.allocate("b", b.num_tokens, shared)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.pool.ref_count(shared[0]) == 2
    kv.check_integrity()


def test_a_freed_prompt_stays_cached_until_its_blocks_are_needed():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _request("a", list(range(9)))
    kv.allocate("a", 9)
    _computed(kv, a, 9)
    kv.free("a")
    assert kv.usage == 0.0
    again = _request("again", list(range(9)))
    assert len(kv.match_prefix(again)) == 2
    # Filling the pool evicts the cached prefix: uncached blocks go first, then LRU.
    kv.allocate("filler", 16)
    assert kv.match_prefix(_request("late", list(range(9)))) == []
    kv.check_integrity()


def test_uncached_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = _request("a", list(range(5)))
    kv.allocate("a", 4)
    _computed(kv, a, 4)  # a full block, offered to the prefix cache
    kv.free("a")  # freed first: the older of the two free blocks
    kv.allocate("b", 3)  # a partial block, never cached
    kv.free("b")
    kv.allocate("c", 3)  # one block: b's, though a's was freed earlier
    assert len(kv.match_prefix(_request("d", list(range(5))))) == 1


def test_the_last_prompt_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(8)))  # exactly two blocks
    kv.allocate("a", 8)
    _computed(kv, a, 8)
    # Same 8 tokens: only the first block may be reused, so the last token still
    # runs through the model and yields the first output token's logits.
    assert len(kv.match_prefix(_request("b", list(range(8))))) == 1


def test_prefix_match_requires_the_whole_chain_to_agree():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5])
    kv.allocate("a", 5)
    _computed(kv, a, 5)
    # Second block equal to a's second block, but after a different first block.
    assert kv.match_prefix(_request("b", [9, 9, 3, 4, 5])) == []


def test_two_identical_prompts_in_one_step_keep_one_cached_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _request("a", list(range(5))), _request("b", list(range(5)))
    kv.allocate("a", 5)
    kv.allocate("b", 5)
    _computed(kv, a, 5)
    _computed(kv, b, 5)
    assert kv.pool.num_cached == 1
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


def test_allocation_with_revived_cached_blocks_counts_them_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _request("a", list(range(9)))
    kv.allocate("a", 9)
    _computed(kv, a, 9)
    kv.free("a")
    b = _request("b", [*range(8), 7, 7, 7, 7, 7])  # 13 tokens: needs 4 blocks
    shared = kv.match_prefix(b)
    assert len(shared) == 2
    assert kv.allocate("b", b.num_tokens, shared) is None
    assert kv.usage == 0.0
    kv.check_integrity()


def test_prefix_caching_can_be_turned_off():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    kv.allocate("a", 9)
    _computed(kv, a, 9)
    assert kv.match_prefix(_request("b", list(range(9)))) == []
    assert kv.pool.num_cached == 0


def test_trim_gives_back_the_blocks_past_the_tokens_kept_in_the_same_table():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    manager.allocate("a", 13)  # 4 blocks: 3 tokens of drafts in the last
    table = manager.block_table("a")
    manager.trim("a", 9)  # 9 tokens: 3 blocks
    assert len(table) == 3 and manager.block_table("a") is table  # the live list
    assert manager.pool.num_free == 5
    manager.trim("a", 12)  # holds them already: nothing
    manager.trim("never-seen", 4)
    assert manager.pool.num_free == 5
    manager.check_integrity()


def test_trim_never_drops_a_block_offered_to_the_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = _request("a", list(range(9)))
    manager.allocate("a", 9)
    _computed(manager, request, 8)  # two full blocks offered
    with pytest.raises(ValueError, match="would drop a cached block"):
        manager.trim("a", 4)
