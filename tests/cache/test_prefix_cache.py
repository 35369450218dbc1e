"""The seed's cache rules, one worked example each: prefix matching, the continuous window condition, the
SWACacheManager's allocation order and eviction order, and the remote cache loading sequence."""

from __future__ import annotations

import pytest

from ksana.cache.prefix_cache import PrefixCacheManager, RemoteLoadingError
from ksana.cache.swa_cache import SWACacheManager
from ksana.messages import BlockDemand

B = 4


def _fill(manager: PrefixCacheManager, rid: str, tokens: list[int]) -> None:
    """A request that computed all of ``tokens``."""
    grant = manager.serve_demand(BlockDemand(rid, len(tokens), tuple(tokens), match_prefix=True))
    assert grant is not None and grant.remote_load is None


def test_full_blocks_are_shared_and_a_full_prompt_hit_computes_the_last_token():
    manager = PrefixCacheManager(num_blocks=10, block_size=B)
    _fill(manager, "a", list(range(1, 11)))  # 2 full blocks + 2 tokens
    assert len(manager.tree) == 2
    assert manager.get_request_prefix_block_number("b", list(range(1, 10))) == 2  # 9 tokens: 2 blocks shared
    assert manager.requests["b"].cached_blocks[:2] == manager.requests["a"].cached_blocks[:2]
    # A prompt of exactly 2 blocks: the last block is not matched, its last token must be computed.
    assert manager.get_request_prefix_block_number("c", list(range(1, 9))) == 1
    assert manager.get_request_prefix_block_number("d", [1, 2, 3, 99, 5]) == 0
    manager.check_invariants()
    for rid in "abcd":
        manager.free_request(rid)
    manager.check_invariants()
    assert manager.num_free_blocks == 10 and len(manager.reusable) == 2  # unreferenced blocks stay cached


def test_a_hash_collision_is_a_miss(monkeypatch):
    import ksana.cache.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "chain_hash", lambda parent, tokens: 42)  # every block collides
    manager = PrefixCacheManager(num_blocks=10, block_size=B)
    _fill(manager, "a", [1, 2, 3, 4, 5])
    assert manager.get_request_prefix_block_number("b", [9, 9, 9, 9, 5]) == 0


def test_unreferenced_cached_blocks_are_evicted_least_recently_released_first():
    manager = PrefixCacheManager(num_blocks=4, block_size=B)
    _fill(manager, "a", [1] * 8)
    _fill(manager, "b", [2] * 8)
    a_blocks = {b.block_id for b in manager.requests["a"].cached_blocks}
    manager.free_request("a")
    manager.free_request("b")
    grant = manager.serve_demand(BlockDemand("c", 8, (3,) * 8, match_prefix=True))
    # The pool is full of cached blocks: "c" takes the 2 released first ("a"'s), and "b"'s stay cached.
    assert grant is not None and set(grant.block_ids) == a_blocks and len(a_blocks) == 2
    assert manager.get_request_prefix_block_number("d", [1] * 9) == 0
    assert manager.get_request_prefix_block_number("e", [2] * 9) == 2
    manager.check_invariants()


def _swa_manager(num_fa: int, num_swa: int, window: int) -> PrefixCacheManager:
    return PrefixCacheManager(num_fa, B, swa=SWACacheManager(num_swa), sliding_window=window)


def test_window_endpoint_valid_only_when_the_last_w_blocks_are_valid():
    # W = 6, B = 4: W_blocks = ceil(6 / 4) = 2.
    manager = _swa_manager(16, 16, window=6)
    tokens = list(range(1, 22))  # 5 full blocks + 1 token
    _fill(manager, "a", tokens)
    manager.free_request("a")
    blocks = sorted(manager.tree.values(), key=lambda b: b.prefix_fa_block_num)
    assert [manager.swa.is_valid(b.block_id) for b in blocks] == [True] * 5
    # Invalidate block 3's SWA copy: endpoints 4 and 5 lose a window block, endpoint 3 has blocks 1, 2 valid.
    manager.swa.by_fa_block.pop(blocks[3].block_id)
    assert manager.get_request_prefix_block_number("b", tokens) == 3
    # Invalidate block 1 too: endpoint 3 now has only block 2 valid in its window; endpoint 2 has 0, 1 -> no.
    manager.free_request("b")
    manager.swa.by_fa_block.pop(blocks[1].block_id)
    assert manager.get_request_prefix_block_number("c", tokens) == 0


def test_matching_registers_the_window_blocks_as_held_and_counts_hits():
    manager = _swa_manager(16, 16, window=6)
    tokens = list(range(1, 22))
    _fill(manager, "a", tokens)
    manager.free_request("a")
    assert manager.get_request_prefix_block_number("b", tokens) == 5
    blocks = sorted(manager.tree.values(), key=lambda b: b.prefix_fa_block_num)
    swa_blocks = [manager.swa.by_fa_block[b.block_id] for b in blocks]
    # [win_start, last_swa_valid_idx) = [3, 5): held (not reclaimable) and hit once; the rest untouched.
    assert [s.hit_count for s in swa_blocks] == [0, 0, 0, 1, 1]
    assert [s.is_reclaimable for s in swa_blocks] == [True, True, True, False, False]
    assert manager.requests["b"].swa_block_ids[:3] == [-1, -1, -1]
    manager.check_invariants()


def test_swa_allocation_takes_the_idle_pool_first():
    swa = SWACacheManager(4)
    first = swa.allocate(2)
    swa.set_content_fixed(first[0], fa_block_id=10, prefix_fa_block_num=0)
    swa.set_reclaimable(10, True)  # reclaimable, content fixed
    assert swa.allocate(2) is not None
    assert swa.num_evictions == 0 and swa.is_valid(10)
    assert swa.allocate(1) is not None  # idle pool empty: now the reclaimable block goes
    assert swa.num_evictions == 1 and not swa.is_valid(10)


def test_swa_eviction_order_is_hit_count_then_prefix_position():
    swa = SWACacheManager(4)
    ids = swa.allocate(4)
    # (fa_block_id, hit_count, prefix_fa_block_num)
    for swa_id, (fa, hits, prefix) in zip(ids, [(10, 2, 0), (11, 1, 5), (12, 1, 3), (13, 0, 9)], strict=True):
        swa.set_content_fixed(swa_id, fa, prefix)
        for _ in range(hits):
            swa.increment_hit_count(fa)
        swa.set_reclaimable(fa, True)
    order = []
    for _ in range(4):
        order.append(swa.eviction_candidate().fa_block_id)
        swa.allocate(1)
    assert order == [13, 12, 11, 10]


def test_blocks_whose_content_is_not_fixed_are_never_evicted():
    swa = SWACacheManager(2)
    ids = swa.allocate(2)
    swa.release(ids[0])  # not content fixed: straight back to the idle pool, not a candidate
    assert swa.eviction_candidate() is None
    assert swa.allocate(1) is not None
    assert swa.allocate(1) is None  # both held, neither content fixed: nothing to evict
    assert not swa.can_allocate(1)


def test_remote_loading_sequence_and_forbidden_calls():
    manager = _swa_manager(16, 16, window=6)
    tokens = list(range(1, 22))
    assert manager.get_request_prefix_block_number_before_remote_cache_loading("r", tokens) == 0
    reserved = manager.allocate_blocks_for_remote_cache("r", fa_block_num=5, swa_block_num=2)
    assert reserved is not None
    req = manager.requests["r"]
    assert req.is_remote_loading and req.is_remote_loading_block_allocated
    with pytest.raises(RemoteLoadingError, match="allocate_request_blocks.*request r"):
        manager.allocate_request_blocks("r", 1)
    with pytest.raises(RemoteLoadingError, match="update_request_tokens.*request r"):
        manager.update_request_tokens("r", (), 8)
    with pytest.raises(RemoteLoadingError, match="append_filled_cached_block.*request r"):
        manager.append_filled_cached_block("r", 0)
    # A partial load: 4 of 5 blocks arrived, with the SWA block of position 3 (the second reserved SWA block,
    # for position 4, was not loaded). The window [2, 4) lacks block 2's SWA: the valid endpoint falls back.
    from ksana.cache.prefix_cache import chain_hash

    hashes, parent = [], 0
    for i in range(5):
        parent = chain_hash(parent, tuple(tokens[i * B:(i + 1) * B]))
        hashes.append(parent)
    req.remote_hashes = hashes
    manager.confirm_remote_cache_loading_result("r", 4, [3], 4)
    assert not req.is_remote_loading and not req.is_remote_loading_block_allocated
    assert len(req.cached_blocks) == 0  # endpoint 4 needs SWA of blocks 2 and 3; block 2 has none
    manager.check_invariants()
    manager.free_request("r")
    manager.check_invariants()
    assert manager.num_free_blocks == 16 and manager.swa.num_free_blocks + manager.swa.num_reclaimable_blocks() == 16


def test_a_full_remote_load_is_a_hit():
    manager = _swa_manager(16, 16, window=6)
    tokens = list(range(1, 22))
    manager.get_request_prefix_block_number_before_remote_cache_loading("r", tokens)
    manager.allocate_blocks_for_remote_cache("r", fa_block_num=5, swa_block_num=2)
    from ksana.cache.prefix_cache import chain_hash

    parent, hashes = 0, []
    for i in range(5):
        parent = chain_hash(parent, tuple(tokens[i * B:(i + 1) * B]))
        hashes.append(parent)
    manager.requests["r"].remote_hashes = hashes
    manager.confirm_remote_cache_loading_result("r", 5, [3, 4], 5)
    assert len(manager.requests["r"].cached_blocks) == 5 and len(manager.tree) == 5
    manager.check_invariants()
    # A second request now hits the loaded blocks locally.
    assert manager.get_request_prefix_block_number("s", tokens) == 5
    manager.check_invariants()
