"""gateway/sim/kv_cache.py: prefix hits, LRU eviction, events."""

from __future__ import annotations

from gateway.sim.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCache,
    SeqBlocks,
    prefix_hashes,
)

BS = 4


def fill(cache: KVCache, tokens: list[int]) -> SeqBlocks:
    """Allocate and commit ``tokens`` as one sequence, reusing cached prefix blocks."""
    seq = SeqBlocks()
    hashes = prefix_hashes(tokens, BS)
    hits = cache.cached_prefix_blocks(hashes)
    cache.acquire_prefix(seq, hashes[:hits])
    assert cache.allocate(seq, cache.blocks_needed(len(tokens)) - hits)
    cache.commit_full_blocks(seq, tokens, len(tokens))
    return seq


def test_hashes_chain_and_only_full_blocks_count() -> None:
    a = prefix_hashes(list(range(10)), BS)
    b = prefix_hashes([*range(8), 99, 98], BS)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)[1] != prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)[1]
    assert all(0 <= h < 2**64 for h in a)


def test_prefix_hit_after_release_and_events() -> None:
    cache = KVCache(8, BS)
    tokens = list(range(12))
    seq = fill(cache, tokens)
    first_blocks = list(seq.blocks)  # release() empties seq.blocks: remember the physical ids
    stored = cache.drain_events()
    assert stored == [BlockStored(tuple(prefix_hashes(tokens, BS)), None, tuple(tokens), BS)]
    cache.release(seq)
    assert cache.usage == 0.0
    assert cache.cached_prefix_blocks(prefix_hashes([*tokens, 50, 51, 52, 53], BS)) == 3
    other = fill(cache, [*tokens, 50, 51, 52, 53])
    # the three cached blocks are the very same physical blocks, not recomputed copies
    assert other.blocks[:3] == first_blocks
    assert other.blocks[3] not in first_blocks
    assert cache.available == 8 - 4  # one new block taken, the cached three came back into use
    (event,) = cache.drain_events()  # only the new block is announced; nothing evicted or re-stored
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == prefix_hashes(tokens, BS)[-1]
    assert event.token_ids == (50, 51, 52, 53)


def test_live_sequences_share_prefix_blocks_by_reference() -> None:
    cache = KVCache(6, BS)
    prefix = list(range(8))  # two full blocks
    a = fill(cache, [*prefix, 1, 2, 3, 4])
    b = fill(cache, [*prefix, 5, 6, 7, 8])
    shared = a.blocks[:2]
    assert b.blocks[:2] == shared and b.blocks[2] != a.blocks[2]
    assert [cache.refs[blk] for blk in shared] == [2, 2]
    assert cache.available == 6 - 4  # 2 shared + 1 private each, not 3 + 3
    cache.release(a)
    # b still holds the shared blocks: they must be neither free nor evictable
    assert [cache.refs[blk] for blk in shared] == [1, 1]
    assert not set(shared) & (set(cache.free) | set(cache.evictable))
    cache.release(b)
    assert cache.available == 6
    # a later request finds the prefix cached and gets the same physical blocks back
    c = fill(cache, [*prefix, 9, 9, 9, 9])
    assert c.blocks[:2] == shared
    assert [cache.refs[blk] for blk in shared] == [1, 1]


def test_lru_eviction_of_unreferenced_blocks() -> None:
    cache = KVCache(4, BS)
    a = fill(cache, list(range(8)))  # 2 blocks
    b = fill(cache, list(range(100, 108)))  # 2 blocks
    cache.release(a)
    cache.release(b)  # a's blocks are older in the LRU
    cache.drain_events()
    c = fill(cache, list(range(200, 208)))  # needs 2 blocks: evicts a's
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert {h for e in removed for h in e.block_hashes} == set(prefix_hashes(list(range(8)), BS))
    assert cache.cached_prefix_blocks(prefix_hashes(list(range(100, 108)), BS)) == 2
    assert cache.cached_prefix_blocks(prefix_hashes(list(range(8)), BS)) == 0
    assert cache.available == 2
    cache.release(c)


def test_referenced_blocks_are_never_evicted() -> None:
    cache = KVCache(4, BS)
    fill(cache, list(range(16)))
    seq = SeqBlocks()
    assert not cache.allocate(seq, 1)
    assert seq.blocks == []


def test_clear_forgets_cached_blocks() -> None:
    cache = KVCache(4, BS)
    cache.release(fill(cache, list(range(8))))
    cache.drain_events()
    cache.clear()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.cached_prefix_blocks(prefix_hashes(list(range(8)), BS)) == 0
    assert cache.available == 4
