"""Which leading blocks of a prompt each engine holds in its KV cache, as well as the gateway knows.

Two feeds write the index; lookups only read it.

- *Approximate*: every dispatch (:meth:`PrefixIndex.record_dispatch`) marks the prompt's blocks as
  cached on the engine it went to, for ``approx_ttl_s``. It is right as soon as the engine has run
  the prefill and stays right until the engine evicts the blocks, which the gateway cannot see;
  the TTL bounds how long a guess outlives the truth.
- *Precise*: the engine's own KV events (``gateway/fleet/kv_events.py`` calls :meth:`stored`,
  :meth:`removed`, :meth:`cleared`, :meth:`drop_precise`). A removed block goes at once, whichever
  feed had written it.

Keys are the gateway's chain (``gateway/fleet/block_hash.py``) whichever feed wrote them: events
are re-hashed from their ``token_ids``, starting from the gateway key of the block their
``parent_block_hash`` names, so an engine hashing with a random seed still matches the prompts
the front door hashes. A lookup (:meth:`PrefixIndex.match`) answers, per engine, how many leading
blocks of the prompt are cached there: the prefill that engine would skip.

Memory: generations, not a per-entry LRU list. Each engine keeps its entries in a few plain dicts
(generations), writes go to the newest, and eviction drops the oldest whole. CPython dicts never
give back their table when entries are deleted and resize to three times their live entries
under churn, so a per-entry LRU (an ``OrderedDict`` with pops at the front) costs up to twice its
steady size at every resize and must be rebuilt to shrink; a generation is only ever appended to
and is freed at once, so memory follows the entries it holds. Recency is kept at generation
granularity: a dispatch re-writes the prompt's keys into the newest generation (older copies stay
until their generation goes, counted in full), so a prefix used all the time is never evicted and
a chain's tail, refreshed less often than its head, goes first.

An engine holds few generations whatever the fleet's size: the newest is closed once it holds a
sixteenth of the engine's entries (and at least an even share of the budget's sixteenth), and past
:data:`MAX_GENERATIONS` the two smallest neighbours are merged. Lookups, copy-forwards and
removals walk an engine's generations, so their count, not the fleet's, bounds each one's cost
(a budget split over 64 engines made one busy engine's 200,000 blocks 600 generations).

The byte budget is counted honestly: every dict's own allocation (``sys.getsizeof``: its table)
plus the int and float objects each entry keeps alive. Over budget, the engine holding the most
bytes gives up its oldest generation (its dispatch guesses before the blocks its events reported
when both are as old), so an engine with little traffic keeps its share instead of being emptied
by a busy neighbour and then looking cold to the router.

Not thread-safe: the event loop's thread owns it, like the fleet registry.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, islice, repeat, takewhile
from typing import TypeVar

from gateway.fleet.block_hash import PromptBlocks, chain, root_key

#: bytes an approximate entry keeps alive besides its dict slot: the key (a 64-bit int is 36 bytes
#: in CPython, allocated in 8-byte size classes)
APPROX_OBJECT_BYTES = 40
#: one float per dispatch written into a generation: every key of a dispatch shares its time
DISPATCH_TIME_BYTES = 24
#: bytes a precise entry keeps alive besides its two dict slots: the gateway key and the engine's
#: own hash (one object each, shared by the two dicts)
PRECISE_OBJECT_BYTES = 40 + 40
#: generations per engine at its share of the budget: eviction drops about 1/16 of an engine's
#: entries at a time, and only the newest generation ever resizes (its transient copy is small)
GENERATIONS = 16
#: the largest block size an engine's event may set (vLLM's are at most a few hundred tokens)
MAX_EVENT_BLOCK_SIZE = 1 << 16
#: the largest table a generation holds per entry: a dict grown by appends has at most three
#: slots per entry (it doubles when two thirds are used), each an index (4 bytes) and two thirds
#: of a 24-byte entry; used only to size generations, never to count memory
_SLOT_BYTES_PER_ENTRY = 3 * (4 + 16)
#: the fewest entries a generation takes before the next is opened
_MIN_GENERATION = 256
#: generations an engine keeps per feed before neighbours are merged
MAX_GENERATIONS = 2 * GENERATIONS
#: vLLM's default when the engine has not told its block size yet
DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class _ApproxGen:
    """Keys dispatched to the engine, with the time of their last dispatch."""

    created: float
    last_write: float
    keys: dict[int, float] = field(default_factory=dict)
    #: dispatches written here (each left one float alive, at most one per key)
    writes: int = 0
    bytes: int = 0

    def measure(self) -> int:
        self.bytes = (
            sys.getsizeof(self.keys)
            + len(self.keys) * APPROX_OBJECT_BYTES
            + min(self.writes, len(self.keys)) * DISPATCH_TIME_BYTES
        )
        return self.bytes


@dataclass(slots=True)
class _PreciseGen:
    """Keys the engine reported stored, with the engine's own hash each way."""

    created: float
    last_write: float
    keys: dict[int, int] = field(default_factory=dict)
    by_engine_hash: dict[int, int] = field(default_factory=dict)
    bytes: int = 0

    def measure(self) -> int:
        self.bytes = (
            sys.getsizeof(self.keys)
            + sys.getsizeof(self.by_engine_hash)
            + len(self.keys) * PRECISE_OBJECT_BYTES
        )
        return self.bytes


@dataclass(slots=True)
class _EngineEntries:
    """One engine's generations, oldest first (the last of each list takes the writes)."""

    model: str
    block_size: int
    #: the engine reported ``block_size`` (else it is the default, until a scrape or an event says)
    reported: bool = False
    #: ...and it was an event that said it (an engine restarted or reset may say another)
    from_event: bool = False
    approx: list[_ApproxGen] = field(default_factory=list)
    precise: list[_PreciseGen] = field(default_factory=list)
    bytes: int = 0

    def entries(self) -> int:
        return sum(len(g.keys) for g in self.approx) + sum(len(g.keys) for g in self.precise)

    def dicts(self) -> list[dict[int, float] | dict[int, int]]:
        """Every generation's key dict, newest first (where a hot prompt's keys are)."""
        out: list[dict[int, float] | dict[int, int]] = [g.keys for g in reversed(self.precise)]
        out.extend(g.keys for g in reversed(self.approx))
        return out

    def find_engine_hash(self, engine_hash: int) -> int | None:
        for gen in reversed(self.precise):
            key = gen.by_engine_hash.get(engine_hash)
            if key is not None:
                return key
        return None


_G = TypeVar("_G", _ApproxGen, _PreciseGen)
_V = TypeVar("_V")


@dataclass(slots=True)
class IndexStats:
    """Counters since start (for metrics and tests)."""

    #: generations dropped for the budget, and the entries they held
    evicted_generations: int = 0
    #: generations merged into a neighbour (past MAX_GENERATIONS)
    merged_generations: int = 0
    evicted: int = 0
    expired: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    #: stored blocks whose parent the index does not know (events missed before a gap or before
    #: the gateway subscribed): they cannot be keyed and are left out
    orphans: int = 0
    #: events skipped for naming another block size than the engine's
    block_size_mismatch: int = 0


class PrefixIndex:
    """Per-engine chained block keys from dispatches and KV events, under one byte budget."""

    def __init__(self, budget_bytes: int, approx_ttl_s: float) -> None:
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        if approx_ttl_s <= 0:
            raise ValueError(f"approx_ttl_s must be > 0, got {approx_ttl_s}")
        self.budget_bytes = budget_bytes
        self.approx_ttl_s = approx_ttl_s
        self._engines: dict[str, _EngineEntries] = {}
        self._bytes = 0
        self._generation_entries = self._size_generations(1)
        self.stats = IndexStats()

    def _size_generations(self, engines: int) -> int:
        """Entries per generation: an engine's even share of the budget in :data:`GENERATIONS`
        pieces, at the costliest entry's worst-case bytes."""
        worst = 2 * _SLOT_BYTES_PER_ENTRY + PRECISE_OBJECT_BYTES
        return max(_MIN_GENERATION, self.budget_bytes // (GENERATIONS * max(1, engines) * worst))

    # -- engines ---------------------------------------------------------------------------------

    def add_engine(self, engine_id: str, model: str, block_size: int | None = None) -> None:
        """Start tracking ``engine_id`` (serving ``model``); idempotent. ``block_size`` from the
        engine's ``cache_config_info`` when known (:data:`DEFAULT_BLOCK_SIZE` until then)."""
        if engine_id in self._engines:
            if block_size is not None:
                self.set_block_size(engine_id, block_size)
            return
        size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if size < 1:
            raise ValueError(f"block_size must be >= 1, got {size}")
        self._engines[engine_id] = _EngineEntries(model, size, reported=block_size is not None)
        self._generation_entries = self._size_generations(len(self._engines))

    def set_block_size(self, engine_id: str, block_size: int) -> None:
        """The engine reported its block size; a change makes every key of it wrong: drop them."""
        entries = self._engines[engine_id]
        if block_size < 1:
            return
        entries.reported, entries.from_event = True, False
        if block_size == entries.block_size:
            return
        entries.block_size = block_size
        self._reset(entries, precise_only=False)

    def remove_engine(self, engine_id: str) -> None:
        entries = self._engines.pop(engine_id, None)
        if entries is not None:
            self._bytes -= entries.bytes
            self._generation_entries = self._size_generations(len(self._engines))

    def engines(self) -> list[str]:
        return list(self._engines)

    def block_size(self, engine_id: str) -> int:
        return self._engines[engine_id].block_size

    def model(self, engine_id: str) -> str:
        return self._engines[engine_id].model

    # -- lookups (read only) ---------------------------------------------------------------------

    def match(self, blocks: PromptBlocks, engine_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of the prompt cached on each engine (0 for engines not tracked).

        Reads only: approximate entries past their TTL count until :meth:`expire` runs, so call
        it first (the caller owns the clock). Cost: one dict probe per matched block per engine,
        in C (``takewhile`` over ``__contains__``), none per unmatched block.
        """
        out: dict[str, int] = {}
        for engine_id in engine_ids:
            entries = self._engines.get(engine_id)
            out[engine_id] = (
                0 if entries is None else _leading(blocks.hashes(entries.block_size), entries.dicts())
            )
        return out

    def match_reported(self, blocks: PromptBlocks, engine_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`match` over what the engines' own KV events reported, without the dispatch
        guesses (for checks that the precise feed keys blocks as the front door does)."""
        out: dict[str, int] = {}
        for engine_id in engine_ids:
            entries = self._engines.get(engine_id)
            precise = [] if entries is None else [g.keys for g in reversed(entries.precise)]
            out[engine_id] = _leading(blocks.hashes(entries.block_size), precise) if entries else 0
        return out

    def cached_tokens(self, blocks: PromptBlocks, engine_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`match` in prompt tokens (blocks x each engine's block size)."""
        return {
            engine_id: n * self._engines[engine_id].block_size if n else 0
            for engine_id, n in self.match(blocks, engine_ids).items()
        }

    # -- approximate feed ------------------------------------------------------------------------

    def record_dispatch(self, engine_id: str, blocks: PromptBlocks, now: float) -> None:
        """The prompt went to ``engine_id`` at ``now``: its blocks are (about to be) cached there.

        Every key is (re)written into the newest generation: blocks the engine reported stay
        precise (copied forward with their engine hash), the rest are approximate as of ``now``.
        C loops over the prompt's keys only (a 200 KB prompt has ~4,000).
        """
        entries = self._engines.get(engine_id)
        if entries is not None:
            self._record(entries, blocks.hashes(entries.block_size), now)

    def record_keys(self, engine_id: str, block_size: int, keys: Sequence[int], now: float) -> bool:
        """:meth:`record_dispatch` of a prompt another gateway replica sent to ``engine_id``, by its
        chained keys at ``block_size``; False (nothing written) when this index keys the engine
        at another block size or does not know it."""
        entries = self._engines.get(engine_id)
        if entries is None or entries.block_size != block_size:
            return False
        self._record(entries, keys, now)
        return True

    def _record(self, entries: _EngineEntries, keys: Sequence[int], now: float) -> None:
        if not keys:
            return
        if entries.precise:
            precise = self._precise_gen(entries, now)
            older = entries.precise[:-1]
            if older:
                todo = list(filterfalse(precise.keys.__contains__, keys))
                for gen in reversed(older):
                    if not todo:
                        break
                    found = list(filter(gen.keys.__contains__, todo))
                    if found:
                        hashes = list(map(gen.keys.__getitem__, found))
                        precise.keys.update(zip(found, hashes, strict=True))
                        precise.by_engine_hash.update(zip(hashes, found, strict=True))
                        todo = list(filterfalse(precise.keys.__contains__, todo))
                precise.last_write = now
                self._remeasure(entries, precise)
            keys = list(filterfalse(precise.keys.__contains__, keys))
        if keys:
            approx = self._approx_gen(entries, now)
            approx.keys.update(zip(keys, repeat(now)))
            approx.writes += 1
            approx.last_write = now
            self._remeasure(entries, approx)
        self._enforce()

    def expire(self, now: float) -> int:
        """Drop approximate generations whose newest write is older than the TTL; returns the
        entries that went. An entry so lives between the TTL and the TTL plus one generation's
        span (an eighth of the TTL) after its last dispatch."""
        horizon = now - self.approx_ttl_s
        dropped = 0
        for entries in self._engines.values():
            while entries.approx and entries.approx[0].last_write <= horizon:
                gen = entries.approx.pop(0)
                dropped += len(gen.keys)
                self._bytes -= gen.bytes
                entries.bytes -= gen.bytes
        self.stats.expired += dropped
        return dropped

    # -- precise feed ----------------------------------------------------------------------------

    def stored(
        self,
        engine_id: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        now: float,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """A BlockStored event: ``engine_hashes[i]`` is the engine's hash of the ``i``-th block of
        ``token_ids``. Re-hashed with the gateway's chain from the parent's gateway key (or from
        the root of the engine's model, ``lora`` and ``cache_salt`` when there is no parent).
        Returns the blocks indexed (0 for an unknown parent or another block size)."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return 0
        if block_size != entries.block_size:
            if entries.reported or not 1 <= block_size <= MAX_EVENT_BLOCK_SIZE:
                self.stats.block_size_mismatch += 1
                return 0
            # events can come before the first scrape says the engine's block size (the replay of
            # its cache at subscription does), and SGLang's scrape never says its page size: the
            # event's own size is the engine's
            self.set_block_size(engine_id, block_size)
            entries.from_event = True
        elif not entries.reported:
            # an event that says the size assumed so far settles it as well (after a clear, one
            # of another size would otherwise have switched it and dropped every key)
            entries.reported = entries.from_event = True
        if parent_engine_hash is None:
            parent: int | None = root_key(entries.model, lora, cache_salt)
        else:
            parent = entries.find_engine_hash(parent_engine_hash)
        if parent is None:
            self.stats.orphans += len(engine_hashes)
            return 0
        n = min(len(engine_hashes), len(token_ids) // block_size)
        if n == 0:
            return 0
        keys = chain(token_ids[: n * block_size], block_size, parent)
        hashes = engine_hashes[:n]
        gen = self._precise_gen(entries, now)
        gen.keys.update(zip(keys, hashes, strict=True))
        gen.by_engine_hash.update(zip(hashes, keys, strict=True))
        gen.last_write = now
        self.stats.stored += n
        self._remeasure(entries, gen)
        self._enforce()
        return n

    def removed(self, engine_id: str, engine_hashes: Iterable[int]) -> int:
        """A BlockRemoved event: the engine evicted these blocks. They go from every generation,
        the dispatch guesses included. Returns how many were known."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return 0
        gone: set[int] = set()
        touched: set[int] = set()
        for engine_hash in engine_hashes:
            for i, gen in enumerate(entries.precise):
                key = gen.by_engine_hash.pop(engine_hash, None)
                if key is not None:
                    gen.keys.pop(key, None)
                    gone.add(key)
                    touched.add(i)
        if not gone:
            return 0
        for approx in entries.approx:
            before = len(approx.keys)
            for key in gone:
                approx.keys.pop(key, None)
            if len(approx.keys) != before:
                self._remeasure(entries, approx)
        for i in touched:
            self._remeasure(entries, entries.precise[i])
        # (an engine's cache churns: what its events stored long ago is evicted by now, and
        # the generations that held it would otherwise stay, empty, to be walked by every call)
        self._drop_empty(entries, entries.approx)
        self._drop_empty(entries, entries.precise)
        self.stats.removed += len(gone)
        return len(gone)

    def cleared(self, engine_id: str) -> None:
        """AllBlocksCleared (a prefix-cache reset, a sleep): nothing of the engine is cached,
        not even what was dispatched to it before."""
        entries = self._engines.get(engine_id)
        if entries is not None:
            self.stats.cleared += 1
            self._reset(entries, precise_only=False)
            if entries.from_event:
                # (an engine restarted with another page size said so only in its events: kept,
                # the old size refused every event from then on)
                entries.reported = entries.from_event = False

    def drop_precise(self, engine_id: str) -> None:
        """Forget what the engine's events said (a sequence gap: some of it is now wrong); the
        gateway's own dispatch guesses stay."""
        entries = self._engines.get(engine_id)
        if entries is not None:
            self._reset(entries, precise_only=True)

    # -- memory ----------------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Bytes the index holds, by its own count (tables plus the objects entries keep alive)."""
        return self._bytes

    def entries(self, engine_id: str | None = None) -> int:
        if engine_id is not None:
            return self._engines[engine_id].entries()
        return sum(e.entries() for e in self._engines.values())

    def _full(self, gens: Sequence[_ApproxGen | _PreciseGen]) -> bool:
        """The newest generation has taken its share: a sixteenth of the engine's entries in this
        feed, and at least the floor."""
        newest = len(gens[-1].keys)
        if newest < self._generation_entries:
            return False
        return newest * GENERATIONS >= sum(len(g.keys) for g in gens)

    def _approx_gen(self, entries: _EngineEntries, now: float) -> _ApproxGen:
        gens = entries.approx
        if (
            not gens
            or self._full(gens)
            # time-bounded too, so the TTL can drop old guesses a generation at a time
            or now - gens[-1].created >= self.approx_ttl_s / 8
        ):
            gen = _ApproxGen(now, now)
            gens.append(gen)
            self._remeasure(entries, gen)
            if len(gens) > MAX_GENERATIONS:
                i = self._smallest_pair(gens)
                older, newer = gens[i], gens[i + 1]
                older.keys = _merged(older.keys, newer.keys)
                older.writes += newer.writes
                self._absorb(entries, gens, i)
        return gens[-1]

    def _precise_gen(self, entries: _EngineEntries, now: float) -> _PreciseGen:
        gens = entries.precise
        if not gens or self._full(gens):
            gen = _PreciseGen(now, now)
            gens.append(gen)
            self._remeasure(entries, gen)
            if len(gens) > MAX_GENERATIONS:
                i = self._smallest_pair(gens)
                older, newer = gens[i], gens[i + 1]
                older.keys = _merged(older.keys, newer.keys)
                older.by_engine_hash = _merged(older.by_engine_hash, newer.by_engine_hash)
                self._absorb(entries, gens, i)
        return gens[-1]

    @staticmethod
    def _smallest_pair(gens: Sequence[_ApproxGen | _PreciseGen]) -> int:
        """Where the two neighbours holding the fewest entries start, the newest (open)
        generation aside."""
        return min(range(len(gens) - 2), key=lambda j: len(gens[j].keys) + len(gens[j + 1].keys))

    def _absorb(self, entries: _EngineEntries, gens: list[_G], i: int) -> None:
        """``gens[i]`` now holds ``gens[i + 1]``'s entries too: it takes its age and the other
        goes. (A dispatch guess so lives until the merged generation's newest write is older
        than the TTL: longer than the TTL and a generation's span when it was the older one.)"""
        older, newer = gens[i], gens[i + 1]
        older.last_write = max(older.last_write, newer.last_write)
        del gens[i + 1]
        self.stats.merged_generations += 1
        entries.bytes -= newer.bytes
        self._bytes -= newer.bytes
        self._remeasure(entries, older)

    def _drop_empty(self, entries: _EngineEntries, gens: list[_G]) -> None:
        empty = [g for g in gens[:-1] if not g.keys]  # (the newest stays: it takes the writes)
        if empty:
            freed = sum(g.bytes for g in empty)
            entries.bytes -= freed
            self._bytes -= freed
            gens[:-1] = [g for g in gens[:-1] if g.keys]

    def _remeasure(self, entries: _EngineEntries, gen: _ApproxGen | _PreciseGen) -> None:
        before = gen.bytes
        delta = gen.measure() - before
        entries.bytes += delta
        self._bytes += delta

    def forget_dispatched(self, engine_id: str) -> None:
        """Drop the gateway's own guesses of what ``engine_id`` holds (it was ejected: most likely
        it restarted, and they are void); what its KV events reported stays, since an engine that
        did restart says so in its events (its sequence starts again) and a blip changes nothing."""
        entries = self._engines.get(engine_id)
        if entries is not None and entries.approx:
            freed = sum(g.bytes for g in entries.approx)
            entries.approx = []
            entries.bytes -= freed
            self._bytes -= freed

    def _reset(self, entries: _EngineEntries, precise_only: bool) -> None:
        freed = sum(g.bytes for g in entries.precise)
        entries.precise = []
        if not precise_only:
            freed += sum(g.bytes for g in entries.approx)
            entries.approx = []
        entries.bytes -= freed
        self._bytes -= freed

    def _enforce(self) -> None:
        """Drop oldest generations, from the engine holding the most bytes each time, until the
        index is within its budget."""
        while self._bytes > self.budget_bytes:
            victim = max(self._engines.values(), key=lambda e: e.bytes)
            a = victim.approx[0] if victim.approx else None
            p = victim.precise[0] if victim.precise else None
            if a is None and p is None:
                return  # nothing left to drop (cannot happen while bytes > 0)
            gen: _ApproxGen | _PreciseGen
            if p is None or (a is not None and a.last_write <= p.last_write):
                assert a is not None
                gen = victim.approx.pop(0)
            else:
                gen = victim.precise.pop(0)
            self.stats.evicted_generations += 1
            self.stats.evicted += len(gen.keys)
            victim.bytes -= gen.bytes
            self._bytes -= gen.bytes


def _merged(older: dict[int, _V], newer: dict[int, _V]) -> dict[int, _V]:
    """``older`` and ``newer`` in one dict, ``newer``'s values winning; built in the larger of
    the two (updated in place), so a merge costs the smaller one's entries."""
    if len(older) >= len(newer):
        older.update(newer)
        return older
    for key, value in older.items():
        newer.setdefault(key, value)
    return newer


def _leading(keys: Sequence[int], dicts: Sequence[dict[int, float] | dict[int, int]]) -> int:
    """Length of the leading run of ``keys`` found in any of ``dicts``: from the first key, find a
    dict holding it and run through that dict in C (``takewhile``) as far as it goes, then again.
    A chain written by one dispatch or one event sits in one generation, so runs are long."""
    n, total = 0, len(keys)
    while n < total:
        key = keys[n]
        for d in dicts:
            if key in d:
                n += len(list(takewhile(d.__contains__, islice(keys, n, None))))
                break
        else:
            break
    return n
