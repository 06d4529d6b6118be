"""The admission queue: a pure, synchronous priority queue of waiting requests for one queue order.

Who calls it: the gateway's dispatch loop (``gateway/dispatch``) and the offline simulator. It does
no I/O and reads no clock: every call that orders passes ``now`` (seconds, monotonic, never
decreasing between calls) and the :class:`OrderContext` in effect.

How it stays O(log n):

* a binary heap of ``sort_key + (generation, slot)`` entries beside a sorted run: an arrival whose
  entry sorts at or after the run's last one is appended to the run (a deque), any other goes to
  the heap, and the first in order is the lesser of their two fronts. Arrivals mostly come in key
  order (first come first served, or any order whose key grows with arrival within a class), and
  then a push and a pop are O(1) instead of O(log n) tuple comparisons each in a heap of 10,000.
  Removal is lazy (the slot is marked dead and skipped when it surfaces), and both are compacted
  when dead entries outnumber live ones, so memory stays O(live) and the amortised cost O(log n);
* a second heap on each key's ``valid_until``: before any read, keys whose piece has ended are
  recomputed and pushed again (the old entry becomes dead). Each order documents how many times a
  request can change key (once for aging / S-EDF / RED, a bounded geometric number for Kairos);
* a third heap on ``queue_deadline`` for :meth:`AdmissionQueue.expire`, with its own sorted run
  (deadlines of one class's arrivals come in order);
* what a compaction or a re-key of every item replaces is let go of a few entries per arrival
  and per departure (:class:`_Discards`), not in one call;
* for orders that rank by fair rounds (``uses_flows``: ``flow_control``), a
  :class:`~policies.flow_control.FlowRounds` stamps each push with its round; the request it
  displaces as its tenant's head is re-keyed at once, the one that becomes a head when a head
  leaves is re-keyed at the next read (so :meth:`AdmissionQueue.remove` and ``expire`` never
  restructure the heap under an open iterator).

Context changes: a context-sensitive order keys with the context the queue holds; a new context
replaces it (and every key is recomputed, O(n)) only when one of its estimates moved by more than
``context_tolerance`` (relative), so an online estimator's jitter does not rebuild the heap on
every event.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, KeysView
from typing import Any

from policies.flow_control import FlowRounds
from policies.queue_order import (
    OrderContext,
    QueuedRequest,
    QueueOrder,
    with_demotion,
    with_flow_round,
    with_prefill_backlog,
)

_INF = math.inf
_COMPACT_MIN = 64  # below this many dead entries compaction is not worth an O(n) pass
#: entries a compaction replaced that each arrival and each departure lets go of (see _Discards)
_DISCARDS_PER_MOVE = 8
#: what the discards may hold: this many entries per queued item (a compaction replaces about two
#: per item in each of four heaps), and this many more
_DISCARDS_PER_ITEM, _DISCARDS_SLACK = 8, 4096


def _live(heap: list[tuple[Any, int, _Slot]]) -> list[tuple[Any, int, _Slot]]:
    """``heap`` without the entries of items that left: those surface only when they are the
    least, so a side heap (KV needs) would otherwise hold every item ever queued."""
    kept = [entry for entry in heap if _queued(entry)]
    heapq.heapify(kept)
    return kept


class _RunHeap:
    """Tuples, least first: each one pushed at or after the last pushed one is appended to a
    sorted run, any other goes to a binary heap, and the least is the lesser of the two fronts.
    Pushes that mostly come in order (arrivals) then cost O(1) to push and to pop instead of
    O(log n) comparisons in a large heap, whose sifts also touch memory all over it. Entries leave
    from the front; the owner marks an entry dead and drops it when it surfaces, or keeps only
    the live ones (:meth:`kept`)."""

    __slots__ = ("heap", "run")

    def __init__(self, entries: Iterable[tuple[Any, ...]] = ()) -> None:
        self.heap: list[tuple[Any, ...]] = list(entries)
        heapq.heapify(self.heap)
        self.run: deque[tuple[Any, ...]] = deque()

    def __len__(self) -> int:
        return len(self.heap) + len(self.run)

    def push(self, entry: tuple[Any, ...]) -> None:
        run = self.run
        if not run or not entry < run[-1]:
            run.append(entry)
        else:
            heapq.heappush(self.heap, entry)

    def push_to_heap(self, entry: tuple[Any, ...]) -> None:
        """Push ``entry`` into the heap whatever its place (a re-keyed request: one that sorts
        after the arrivals would end the run they keep appending to)."""
        heapq.heappush(self.heap, entry)

    def first(self) -> tuple[Any, ...] | None:
        heap, run = self.heap, self.run
        if heap:
            return run[0] if run and run[0] < heap[0] else heap[0]
        return run[0] if run else None

    def pop_first(self) -> tuple[Any, ...]:
        """Remove and return the least entry (there is one)."""
        heap, run = self.heap, self.run
        if heap and (not run or heap[0] < run[0]):
            return heapq.heappop(heap)
        return run.popleft()

    def kept(self, live: Callable[[tuple[Any, ...]], bool], discards: _Discards) -> _RunHeap:
        """A copy holding only the entries ``live`` keeps: O(n). What this one held goes to
        ``discards``."""
        fresh = _RunHeap(entry for entry in self.heap if live(entry))
        fresh.run = deque(entry for entry in self.run if live(entry))
        self.discard_into(discards)
        return fresh

    def discard_into(self, discards: _Discards) -> None:
        """Hand every entry to ``discards``, leaving this one empty."""
        discards.add(self.heap)
        discards.add(self.run)
        self.heap, self.run = [], deque()


class _Discards:
    """What compactions and re-keys replaced, let go of a few entries per arrival and per
    departure rather than all at once.

    CPython starts a young collection once its count of container allocations, less
    deallocations, passes a threshold, and that count never goes below zero. Dropping a compacted
    heap at once freed its 10,000-30,000 dead entries (and the requests only they still held) in
    one go: far more deallocations than the count could take, so the count kept only the
    allocations, and each compaction brought on a collection of the whole young generation, 40-70
    ms at 10,000 queued (a stall of every stream the gateway relays). Freed a few per push, in
    step with the allocations, they balance. The work is the same O(n) as dropping them at once.

    Bounded all the same: past :meth:`trim`'s bound (a few times what is queued) the excess goes
    at once. A context that moved re-keys every item and replaces two whole heaps without waiting
    for dead entries to build up; flapping, it replaced them faster than moves let go of them."""

    __slots__ = ("count", "held")

    def __init__(self) -> None:
        self.held: list[list[Any]] = []
        #: entries held, all lists together
        self.count = 0

    def add(self, entries: Iterable[Any]) -> None:
        """Hold ``entries`` (a replaced heap or run; live entries in it are shared, not copied)."""
        kept = entries if type(entries) is list else list(entries)
        if kept:
            self.held.append(kept)
            self.count += len(kept)

    def trim(self, most: int) -> None:
        """Hold no more than ``most`` entries."""
        if self.count > most:
            self.release(self.count - most)

    def clear(self) -> None:
        self.held, self.count = [], 0

    def release(self, count: int) -> None:
        """Let go of up to ``count`` held entries."""
        held = self.held
        while count > 0 and held:
            last = held[-1]
            if len(last) > count:
                del last[-count:]
                self.count -= count
                return
            count -= len(last)
            self.count -= len(last)
            held.pop()


def _queued(entry: tuple[Any, ...]) -> bool:
    """Whether a deadline or KV-need entry ``(value, generation, slot)`` is of a queued item."""
    return entry[2].entry is not None


def _current_order(entry: tuple[Any, ...]) -> bool:
    """Whether an order entry is its item's current one (not re-keyed, not left)."""
    return entry[-1].entry is entry


def _current_rekey(entry: tuple[Any, ...]) -> bool:
    """Whether a re-key entry ``(valid until, generation, slot)`` is of its item's current key."""
    current = entry[2].entry
    return current is not None and current[-2] == entry[1]


_slot_of = operator.itemgetter(-1)
_item_of_slot = operator.attrgetter("item")


def _items(entries: Iterable[tuple[Any, ...]]) -> Iterator[QueuedRequest]:
    """The queued requests of ``entries``, lazily: C-level getters, not a Python call each (a
    HyperFlexis turn reads its head through this, dozens of entries a placement)."""
    return map(_item_of_slot, map(_slot_of, entries))


class _Slot:
    """One queued request. ``entry`` is its live heap entry, ``None`` once it has left the queue."""

    __slots__ = ("entry", "item")

    def __init__(self, item: QueuedRequest) -> None:
        self.item = item
        self.entry: tuple[Any, ...] | None = None


def _moved(old: OrderContext, new: OrderContext, tolerance: float) -> bool:
    """True when any estimate of ``new`` differs from ``old`` by more than ``tolerance`` (relative)."""
    pairs = (
        (old.prefill_tokens_per_s, new.prefill_tokens_per_s),
        (old.decode_step_s, new.decode_step_s),
        (old.prefill_base_s, new.prefill_base_s),
    )
    for a, b in pairs:
        if abs(a - b) > tolerance * max(abs(a), abs(b)):
            return True
    return old.prefill_engines != new.prefill_engines


class AdmissionQueue:
    """Requests waiting for dispatch, ordered by one :class:`QueueOrder`.

    Items leave exactly once: by :meth:`pop`, :meth:`remove` or :meth:`expire`. ``pop``/``peek``
    do not expire anything themselves; the dispatcher calls :meth:`expire` first so an expired
    request is reported (and answered) rather than dropped silently. Request ids are unique among
    queued items. ``context_tolerance`` (>= 0) is the relative change of an estimate that makes a
    context-sensitive order re-key everything; 0 re-keys on any change.
    """

    def __init__(self, order: QueueOrder, *, context_tolerance: float = 0.05) -> None:
        if not (context_tolerance >= 0 and math.isfinite(context_tolerance)):
            raise ValueError(f"context_tolerance must be a finite number >= 0, got {context_tolerance}")
        self.order = order
        self._key = order.key
        self._context_sensitive: bool = getattr(order, "context_sensitive", True)
        self._uses_backlog: bool = getattr(order, "uses_backlog", False)
        #: fair rounds per band and tenant, for orders that rank by them (flow_control)
        self._flows: FlowRounds | None = FlowRounds() if getattr(order, "uses_flows", False) else None
        #: (request id, round) of requests that became their flow's head, re-keyed at the next read
        self._promoted: list[tuple[str, float]] = []
        self._tolerance = context_tolerance
        self._ctx: OrderContext | None = None
        self._seen_ctx: OrderContext | None = None  # last object passed in, to skip the comparison
        #: the order's entries (``sort_key + (generation, slot)``)
        self._order = _RunHeap()
        #: (valid until, generation, slot): when each item's key is recomputed
        self._rekeys = _RunHeap()
        #: (queue deadline, generation, slot)
        self._deadlines = _RunHeap()
        #: (prompt + output bound, generation, slot) of each item, kept from the first
        #: :meth:`min_need` on (HyperFlexis reads it; a queue nobody asks keeps no such heap)
        self._needs: list[tuple[int, int, _Slot]] | None = None
        self._slots: dict[str, _Slot] = {}
        #: heaps and runs compactions replaced, let go of a few entries per push
        self._discards = _Discards()
        self._generation = 0
        self._dead_in_heap = 0
        self._queued_prompt_tokens = 0
        self._structure_version = 0  # bumped when the heap array changes shape (see iter_in_order)
        # the first items in order, cached for :meth:`head`: entries kept sorted as items come and
        # go, dropped whenever keys change (re-key, context change)
        self._head: list[tuple[Any, ...]] = []
        self._head_valid = False
        self._head_complete = False
        #: how deep the cached head was read (a complete one is cut back to it past twice that)
        self._head_depth = 64

    # -- size and membership ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    def ids(self) -> KeysView[str]:
        """The queued request ids, a live view (``in`` on it is a C-level lookup)."""
        return self._slots.keys()

    def get(self, request_id: str) -> QueuedRequest | None:
        """The queued item with this id (as stored, e.g. with its stamped backlog), or ``None``."""
        slot = self._slots.get(request_id)
        return None if slot is None else slot.item

    def items(self) -> list[QueuedRequest]:
        """Every queued item, in no particular order (O(n); for tests, metrics and shedding scans)."""
        return [slot.item for slot in self._slots.values()]

    @property
    def queued_prompt_tokens(self) -> int:
        """Sum of ``prompt_tokens`` over queued items."""
        return self._queued_prompt_tokens

    @property
    def context(self) -> OrderContext | None:
        """The context keys are currently computed with (``None`` before the first call)."""
        return self._ctx

    # -- mutation --------------------------------------------------------------------------------

    def push(self, item: QueuedRequest, now: float, ctx: OrderContext) -> None:
        """Queue ``item`` at time ``now``. Raises ``ValueError`` if its request id is already queued.

        For orders that predict from the FCFS backlog (Kairos) an item without
        ``prefill_tokens_ahead`` is stored stamped with the prompt tokens queued at this moment.
        """
        request_id = item.view.request_id
        slots = self._slots
        if request_id in slots:
            raise ValueError(f"request {request_id!r} is already queued")
        held = self._ctx
        if ctx is not self._seen_ctx or held is None:
            held = self._adopt(ctx, now)
        if self._uses_backlog and item.prefill_tokens_ahead is None:
            item = with_prefill_backlog(item, self._queued_prompt_tokens)
        moved: list[tuple[str, float]] = []
        if self._flows is not None:
            if self._promoted:
                self._restamp(self._promoted, now, held)
                self._promoted = []
            item, moved = self._flows.admit(item)
        # _insert inlined: push is the hot path of a burst of arrivals
        sort_key, valid_until = self._key(item, now, held)
        self._generation += 1
        generation = self._generation
        slot = _Slot(item)
        entry = (*sort_key, generation, slot)
        slot.entry = entry
        slots[request_id] = slot
        self._queued_prompt_tokens += item.view.prompt_tokens
        self._order.push(entry)
        if self._head_valid:
            self._head_insert(entry)
        if valid_until != _INF:
            if not valid_until > now:  # an order broke the contract; re-key at the next read instead
                valid_until = math.nextafter(now, _INF)
            self._rekeys.push((valid_until, generation, slot))
        deadline = item.queue_deadline
        if deadline != _INF:
            self._deadlines.push((deadline, generation, slot))
            if len(self._deadlines) > 64 + 2 * len(slots):
                self._deadlines = self._deadlines.kept(_queued, self._discards)
                self._trim_discards()
        needs = self._needs
        if needs is not None:
            heapq.heappush(needs, (item.view.prompt_tokens + item.view.max_output_tokens, generation, slot))
            if len(needs) > 64 + 2 * len(slots):
                self._needs = _live(needs)
                self._discards.add(needs)
                self._trim_discards()
        if self._discards.held:  # (an attribute, not a call: every arrival and departure asks)
            self._discards.release(_DISCARDS_PER_MOVE)
        if moved:
            self._restamp(moved, now, held)  # the flow's head it displaced is parked
        self._structure_version += 1
        if self._dead_in_heap > _COMPACT_MIN and self._dead_in_heap > len(slots):
            self._compact()

    def pop(self, now: float, ctx: OrderContext) -> QueuedRequest | None:
        """Remove and return the first item in order at ``now``; ``None`` when empty."""
        self._refresh(now, ctx)
        entry = self._front()
        self._structure_version += 1
        if entry is None:
            return None
        self._order.pop_first()
        slot: _Slot = entry[-1]
        self._forget(slot)
        return slot.item

    def set_demoted(self, request_ids: Iterable[str], demoted: bool, now: float, ctx: OrderContext) -> None:
        """Stamp queued requests ``demoted`` (or not) and re-key those that changed, O(log n)
        each; ids no longer queued are skipped. Not while an iterator of the queue is open."""
        held = self._adopt(ctx, now)
        slots = self._slots
        changed = False
        for request_id in request_ids:
            slot = slots.get(request_id)
            if slot is not None and slot.item.demoted != demoted:
                self._restamp_one(slot, with_demotion(slot.item, demoted), now, held)
                changed = True
        if changed:
            self._structure_version += 1

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take the request out of the queue in O(1) (lazily); ``None`` if it is not queued.

        Safe while an :meth:`iter_in_order` iterator is open: the heap array is not restructured.
        """
        slot = self._slots.get(request_id)
        if slot is None:
            return None
        self._forget(slot)
        self._dead_in_heap += 1
        return slot.item

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every item whose ``queue_deadline <= now``, earliest deadline first.

        O(k log n) for k expired items. Like :meth:`remove`, safe while iterating.
        """
        expired: list[QueuedRequest] = []
        deadlines = self._deadlines
        while (first := deadlines.first()) is not None and first[0] <= now:
            deadlines.pop_first()
            slot: _Slot = first[2]
            if slot.entry is not None:
                self._forget(slot)
                self._dead_in_heap += 1
                expired.append(slot.item)
        return expired

    def next_expiry(self) -> float:
        """Earliest ``queue_deadline`` of a queued item (``inf`` if none): when to wake for :meth:`expire`."""
        deadlines = self._deadlines
        while (first := deadlines.first()) is not None and first[2].entry is None:
            deadlines.pop_first()
        return _INF if first is None else float(first[0])

    def min_need(self) -> int:
        """The least KV any queued item needs (prompt tokens + output bound); 0 when empty.
        Amortised O(log n): entries of items that left are dropped as they surface (the first
        call, O(n), starts the heap that later pushes keep)."""
        needs = self._needs
        if needs is None:
            needs = self._needs = [
                (slot.item.view.prompt_tokens + slot.item.view.max_output_tokens, slot.entry[-2], slot)
                for slot in self._slots.values()
                if slot.entry is not None
            ]
            heapq.heapify(needs)
        while needs and needs[0][2].entry is None:
            heapq.heappop(needs)
        return needs[0][0] if needs else 0

    # -- reading in order ------------------------------------------------------------------------

    def peek(self, now: float, ctx: OrderContext) -> QueuedRequest | None:
        """The first item in order at ``now`` without removing it; ``None`` when empty."""
        self._refresh(now, ctx)
        entry = self._front()
        return None if entry is None else entry[-1].item

    def _front(self) -> tuple[Any, ...] | None:
        """The first live entry in order (the lesser of the heap's and the run's fronts), dropping
        dead entries from either front on the way."""
        order = self._order
        while (entry := order.first()) is not None and entry[-1].entry is not entry:
            order.pop_first()
            self._dead_in_heap -= 1
            self._structure_version += 1
        return entry

    def iter_in_order(self, now: float, ctx: OrderContext, limit: int) -> Iterator[QueuedRequest]:
        """The first ``limit`` items in order at ``now``, lazily, without removing them.

        Costs O(k log k) for the k items actually consumed (a best-first walk of the heap tree,
        merged with the sorted run).
        :meth:`remove` and :meth:`expire` may be called while iterating (removed items are then
        skipped); :meth:`push`, :meth:`pop`, or a read that drops dead entries at the front
        (:meth:`peek`, another :meth:`iter_in_order`, a :meth:`head` that rebuilds its cache)
        during iteration may make the next step raise ``RuntimeError``.
        """
        self._refresh(now, ctx)
        self._front()  # (now, not at the iterator's first step: see _walk_entries)
        return self._walk(max(0, limit))

    def head(self, now: float, ctx: OrderContext, limit: int) -> Iterator[QueuedRequest]:
        """Up to ``limit`` items in order at ``now``, like :meth:`iter_in_order`, but from a cache
        of the queue's head that arrivals and departures keep sorted (O(log n) each), so repeated
        reads of the head between re-keys cost O(k) for the k items consumed, not O(k log k).

        The queue may change while the iterator is open (items removed meanwhile still appear);
        read it before mutating, as the dispatcher does.
        """
        self._refresh(now, ctx)
        want = max(0, limit)
        head = self._head
        if not self._head_valid or (len(head) < want and not self._head_complete):
            depth = self._head_depth = max(64, 2 * want)
            self._front()
            head = self._head = list(self._walk_entries(depth))
            self._head_complete = len(head) < depth
            self._head_valid = True
        return _items(head[:want])

    def _head_insert(self, entry: tuple[Any, ...]) -> None:
        """Keep the cached head a sorted prefix of the order as ``entry`` joins the queue."""
        head = self._head
        if self._head_complete or (head and entry < head[-1]):
            bisect.insort(head, entry)
            if len(head) > 2 * self._head_depth:
                # a head read whole while the queue was short, or one that arrivals keep sorting
                # into, would otherwise grow with the queue, and every arrival and departure
                # cost O(n): cut back to a prefix (no longer the whole queue)
                del head[self._head_depth :]
                self._head_complete = False

    def _walk(self, limit: int) -> Iterator[QueuedRequest]:
        return _items(self._walk_entries(limit))

    def _walk_entries(self, limit: int) -> Iterator[tuple[Any, ...]]:
        """The first ``limit`` live entries in order: a best-first walk of the heap tree merged
        with the sorted run. Callers drop dead entries at the fronts first (:meth:`_front`): a
        request re-keyed by a late lane leaves its old entry at the run's front, and every walk
        from there would read past all of them."""
        heap = self._order.heap
        version = self._structure_version
        frontier: list[tuple[tuple[Any, ...], int]] = [(heap[0], 0)] if heap and limit else []
        size = len(heap)
        run = iter(self._order.run)
        ran = next(run, None) if limit else None
        produced = 0
        while (frontier or ran is not None) and produced < limit:
            if self._structure_version != version:
                raise RuntimeError("admission queue changed shape during iter_in_order")
            if ran is not None and (not frontier or ran < frontier[0][0]):
                entry, ran = ran, next(run, None)
            else:
                entry, index = heapq.heappop(frontier)
                child = 2 * index + 1
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
                    if child + 1 < size:
                        heapq.heappush(frontier, (heap[child + 1], child + 1))
            if entry[-1].entry is entry:
                produced += 1
                yield entry

    def key_of(self, request_id: str) -> tuple[float, ...] | None:
        """The sort key the queue currently holds for a request (as of the last read), or ``None``."""
        slot = self._slots.get(request_id)
        if slot is None or slot.entry is None:
            return None
        return tuple(slot.entry[:-2])

    # -- internals -------------------------------------------------------------------------------

    def _insert(self, slot: _Slot, now: float, ctx: OrderContext) -> None:
        """Re-key a queued slot: its old heap entry becomes dead, a new one is pushed."""
        key, valid_until = self._key(slot.item, now, ctx)
        self._generation += 1
        generation = self._generation
        entry = (*key, generation, slot)
        old = slot.entry
        slot.entry = entry
        self._order.push_to_heap(entry)
        if self._head_valid:
            # the cached head stays a prefix of the order: the old entry leaves it, the new one
            # joins it only if it sorts inside it (orders that re-key every request once, like
            # LateLast under overload, would otherwise rebuild the head on every read)
            head = self._head
            if old is not None:
                i = bisect.bisect_left(head, old)
                if i < len(head) and head[i] is old:
                    del head[i]
            self._head_insert(entry)
        if valid_until != _INF:
            if not valid_until > now:  # an order broke the contract; re-key at the next read instead
                valid_until = math.nextafter(now, _INF)
            self._rekeys.push((valid_until, generation, slot))

    def _restamp(self, rounds: list[tuple[str, float]], now: float, ctx: OrderContext) -> None:
        """Give queued requests their new ``flow_round`` and re-key them (ids that left since
        are skipped)."""
        slots = self._slots
        for request_id, flow_round in rounds:
            slot = slots.get(request_id)
            if slot is not None and slot.item.flow_round != flow_round:
                self._restamp_one(slot, with_flow_round(slot.item, flow_round), now, ctx)

    def _restamp_one(self, slot: _Slot, item: QueuedRequest, now: float, ctx: OrderContext) -> None:
        """Replace a queued slot's item by a re-stamped copy and re-key it (its old entry dies)."""
        slot.item = item
        self._insert(slot, now, ctx)
        self._dead_in_heap += 1

    def _forget(self, slot: _Slot) -> None:
        entry = slot.entry
        if self._head_valid and entry is not None:
            head = self._head
            i = bisect.bisect_left(head, entry)
            if i < len(head) and head[i] is entry:
                del head[i]
        slot.entry = None
        item = slot.item
        del self._slots[item.view.request_id]
        if self._discards.held:  # (an attribute, not a call: every arrival and departure asks)
            if self._slots:
                self._discards.release(_DISCARDS_PER_MOVE)
            else:
                self._discards.clear()  # (nothing queued: no allocations to keep pace with)
        self._queued_prompt_tokens -= item.view.prompt_tokens
        if self._flows is not None:
            self._promoted.extend(self._flows.leave(item))

    def _adopt(self, ctx: OrderContext, now: float) -> OrderContext:
        """The context to key with: the held one unless ``ctx`` moved past the tolerance."""
        held = self._ctx
        if ctx is self._seen_ctx and held is not None:
            return held
        self._seen_ctx = ctx
        if held is None:
            self._ctx = ctx
            return ctx
        if self._context_sensitive and _moved(held, ctx, self._tolerance):
            self._ctx = ctx
            self._rebuild(now, ctx)
            return ctx
        return held

    def _refresh(self, now: float, ctx: OrderContext) -> None:
        """Adopt ``ctx`` if it moved, then recompute every key whose piece ended at or before ``now``."""
        ctx = self._adopt(ctx, now)
        if self._promoted:
            self._restamp(self._promoted, now, ctx)
            self._promoted = []
            self._structure_version += 1
        rekeys = self._rekeys
        first = rekeys.first() if rekeys.heap or rekeys.run else None
        if first is not None and first[0] <= now:
            changed = False
            while first is not None and first[0] <= now:
                rekeys.pop_first()
                _, generation, slot = first
                entry = slot.entry
                if entry is not None and entry[-2] == generation:
                    self._insert(slot, now, ctx)
                    self._dead_in_heap += 1
                    changed = True
                first = rekeys.first()
            if changed:
                self._structure_version += 1
        if self._dead_in_heap > _COMPACT_MIN and self._dead_in_heap > len(self._slots):
            self._compact()

    def _rebuild(self, now: float, ctx: OrderContext) -> None:
        """Recompute every key (context change): O(n)."""
        self._head_valid = False
        slots = list(self._slots.values())
        entries: list[tuple[Any, ...]] = []
        rekeys: list[tuple[Any, ...]] = []
        self._dead_in_heap = 0
        self._structure_version += 1
        key = self._key
        for slot in slots:
            sort_key, valid_until = key(slot.item, now, ctx)
            self._generation += 1
            entry = (*sort_key, self._generation, slot)
            slot.entry = entry
            entries.append(entry)
            if valid_until != _INF:
                rekeys.append((max(valid_until, math.nextafter(now, _INF)), self._generation, slot))
        self._order.discard_into(self._discards)
        self._rekeys.discard_into(self._discards)
        self._order = _RunHeap(entries)
        self._rekeys = _RunHeap(rekeys)
        self._trim_discards()

    def _compact(self) -> None:
        """Drop dead entries from all three heaps and the runs: O(n), run when dead entries
        outnumber live ones."""
        discards = self._discards
        self._order = self._order.kept(_current_order, discards)
        self._rekeys = self._rekeys.kept(_current_rekey, discards)
        self._deadlines = self._deadlines.kept(_queued, discards)
        if self._needs is not None:
            discards.add(self._needs)
            self._needs = _live(self._needs)
        self._dead_in_heap = 0
        self._structure_version += 1
        self._trim_discards()

    def _trim_discards(self) -> None:
        if not self._slots:
            self._discards.clear()  # (nothing queued: what a compaction of an emptied queue parked)
        else:
            self._discards.trim(_DISCARDS_PER_ITEM * len(self._slots) + _DISCARDS_SLACK)
