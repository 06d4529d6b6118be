"""Paged KV cache with prefix caching, as vLLM models it: pure, no I/O, no clock.

The cache has ``num_blocks`` blocks of ``block_size`` tokens. A block that is full gets a chained
hash ``H(parent_hash, tokens)`` and becomes findable by later requests with the same prefix. A
block nobody references but that still has a hash stays cached until space is needed, then goes
in LRU order (``BlockRemoved``); never-hashed free blocks are used first. Every change a subscriber
could care about is appended to :attr:`KVCache.events` for the KV-event publisher to drain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

_MASK = (1 << 64) - 1
NONE_HASH = 0x6E6F6E652D68617368  # "none-hash": the parent of the first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """64-bit chained hash of one full block (Python's int-tuple hash is stable across runs)."""
    return hash((parent, tuple(tokens))) & _MASK


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``tokens``."""
    hashes: list[int] = []
    parent = NONE_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class SeqBlocks:
    """The blocks one sequence holds, in order, and how many of its blocks are hashed."""

    blocks: list[int] = field(default_factory=list)
    hashed: int = 0
    last_hash: int = NONE_HASH


class KVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, LRU first
        self.events: list[KVEvent] = []

    # -- queries ---------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free + evictable)."""
        return len(self.free) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.available / self.num_blocks

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.by_hash:
                break
            n += 1
        return n

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------------------

    def acquire_prefix(self, seq: SeqBlocks, hashes: Sequence[int]) -> int:
        """Reference the cached blocks matching ``hashes`` (already counted by the caller)."""
        for h in hashes:
            block = self.by_hash[h]
            if self.refs[block] == 0:
                self.evictable.pop(block, None)
            self.refs[block] += 1
            seq.blocks.append(block)
            seq.hashed += 1
            seq.last_hash = h
        return len(hashes) * self.block_size

    def allocate(self, seq: SeqBlocks, count: int) -> bool:
        """Append ``count`` new blocks to ``seq``; False (and nothing changed) when they do not fit."""
        if count > self.available:
            return False
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.evictable.popitem(last=False)
                old = self.hash_of[block]
                assert old is not None
                del self.by_hash[old]
                self.hash_of[block] = None
                self.events.append(BlockRemoved((old,)))
            self.refs[block] = 1
            seq.blocks.append(block)
        return True

    def commit_full_blocks(self, seq: SeqBlocks, tokens: Sequence[int], computed: int) -> None:
        """Hash and publish every block of ``seq`` filled by its first ``computed`` ``tokens``.

        A block whose hash another block already holds (two requests computed the same prefix at
        the same time) stays private and is not announced; each contiguous run of newly cached
        blocks becomes one ``BlockStored`` whose ``parent_block_hash`` is the block before it.
        """
        bs = self.block_size
        full = min(computed // bs, len(seq.blocks))
        run: list[int] = []
        run_parent: int | None = None
        run_start = 0
        while seq.hashed < full:
            i = seq.hashed
            parent = seq.last_hash
            h = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            block = seq.blocks[i]
            if h not in self.by_hash and self.hash_of[block] is None:
                self.by_hash[h] = block
                self.hash_of[block] = h
                if not run:
                    run_parent = parent if i > 0 else None
                    run_start = i
                run.append(h)
            elif run:
                self._stored(run, run_parent, tokens[run_start * bs : i * bs])
                run = []
            seq.last_hash = h
            seq.hashed += 1
        if run:
            self._stored(run, run_parent, tokens[run_start * bs : full * bs])

    def _stored(self, hashes: list[int], parent: int | None, tokens: Sequence[int]) -> None:
        self.events.append(BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size))

    def release(self, seq: SeqBlocks) -> None:
        """Drop ``seq``'s references; hashed blocks stay cached (evictable), the rest become free."""
        for block in reversed(seq.blocks):  # tail blocks evicted first: they are least shareable
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.hash_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        seq.blocks.clear()
        seq.hashed = 0
        seq.last_hash = NONE_HASH

    def clear(self) -> None:
        """Forget every cached (unreferenced) block, as vLLM's reset_prefix_cache and sleep do."""
        for block in list(self.evictable):
            h = self.hash_of[block]
            if h is not None:
                del self.by_hash[h]
            self.hash_of[block] = None
            self.free.append(block)
        self.evictable.clear()
        self.events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
