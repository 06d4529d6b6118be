"""What the router adds to a request before the pipeline scores engines: how much of its prompt
each candidate holds (the prefix index) and where its session went last (the affinity store);
and what it records once an engine is chosen (the approximate feed, the session's engine).

The front door hands over a request's prompt blocks and session key once, when it has parsed
the body (:meth:`PrefixRouting.attach`), and takes them back when the request ends
(:meth:`PrefixRouting.detach`); the router calls :meth:`annotate` and :meth:`dispatched` around
every choice, so a request that waited in the queue is matched against the index as it is when
it finally goes, and a failover that re-routes it is matched again without the engine it left.

Engines join the index with the fleet (model and, once scraped, block size from the engine's
``cache_config_info``); a change of block size empties that engine's part of the index.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import takewhile

from gateway import metrics
from gateway.fleet.block_hash import PromptBlocks
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.registry import EngineRecord, Fleet
from policies.api import Affinity, EngineSnapshot, PrefixMatch, RequestView
from policies.hyperflexis import Held, PrefixLookup
from policies.plugins.affinity import AffinityStore

#: what another replica is told of a dispatch here: the engine, the block size the prompt's keys
#: are chained at and those keys (None without a prompt), and the session key (None without one)
RouteListener = Callable[[str, int, "list[int] | None", "str | None"], None]

#: requests attached and not yet detached beyond which the oldest are dropped: a front-door path
#: that forgot to detach must cost a routing hint, never unbounded memory
MAX_ATTACHED = 65_536
#: an engine ejected this soon after a connection to it was refused had its process end (seconds)
REFUSED_RECENTLY_S = 60.0


@dataclass(frozen=True, slots=True)
class Attached:
    prompt: PromptBlocks | None
    affinity_key: str | None


class PrefixRouting:
    """The prefix index and the affinity store, as the router uses them (either may be off)."""

    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndex | None,
        affinity: AffinityStore | None,
        track_in_use: bool = False,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.affinity = affinity
        self._attached: OrderedDict[str, Attached] = OrderedDict()
        #: with ``track_in_use`` (HyperFlexis predicting KV from it), the blocks each engine's
        #: dispatched requests use until they end: engine -> block key -> requests using it
        self.track_in_use = track_in_use and index is not None
        self._in_use: dict[str, Counter[int]] = {}
        self._using: dict[str, tuple[str, list[int]]] = {}  # request id -> (engine, its keys)
        #: told of every dispatch with a prompt or a session (gateway/state/replica_routes.py)
        self.route_listener: RouteListener | None = None
        if index is not None:
            for record in fleet.records.values():
                index.add_engine(record.engine_id, record.model, _scraped_block_size(record))
            fleet.listeners.append(self._on_change)

    def _on_change(self, engine_id: str, what: str) -> None:
        if self.index is None:
            return
        record = self.fleet.records[engine_id]
        if what == "state":
            block_size = _scraped_block_size(record)
            if block_size:
                self.index.set_block_size(engine_id, block_size)
        elif what == "health" and not record.healthy:
            # an ejected engine has most likely crashed or restarted: what was dispatched to it
            # is gone, and it would draw its old prompts back, to be prefilled from scratch, for
            # the TTL. What its KV events reported stays (a restart shows in them: the sequence
            # starts again, cleared and replayed; and a blip leaves its cache as it was), unless
            # its connections were refused: its process ended, and until the new one publishes
            # (if it ever does: events off, another endpoint) its old blocks drew every request
            # of their prompts to a cold engine
            self.index.forget_dispatched(engine_id)
            refused = record.adapter.refused_at
            if refused and time.monotonic() - refused < REFUSED_RECENTLY_S:
                self.index.drop_precise(engine_id)

    # -- the front door's side ---------------------------------------------------------------------

    def attach(self, request_id: str, prompt: PromptBlocks | None, affinity_key: str | None) -> None:
        if prompt is None and affinity_key is None:
            return
        self._attached[request_id] = Attached(prompt, affinity_key)
        self._attached.move_to_end(request_id)
        while len(self._attached) > MAX_ATTACHED:
            oldest, _ = self._attached.popitem(last=False)
            self._stop_using(oldest)

    def detach(self, request_id: str) -> None:
        self._attached.pop(request_id, None)
        self._stop_using(request_id)

    def _stop_using(self, request_id: str) -> None:
        using = self._using.pop(request_id, None)
        if using is None:
            return
        counts = self._in_use[using[0]]
        for key in using[1]:
            left = counts[key] - 1
            if left > 0:
                counts[key] = left
            else:
                del counts[key]

    def attached(self, request_id: str) -> Attached | None:
        return self._attached.get(request_id)

    # -- the router's side -------------------------------------------------------------------------

    def annotate(self, view: RequestView, candidates: Sequence[EngineSnapshot], now: float) -> RequestView:
        """``view`` with ``prefix`` (cached tokens per candidate) and ``affinity`` filled in, as
        far as the request was attached; the view itself when nothing is known of it."""
        attached = self._attached.get(view.request_id)
        if attached is None:
            return view
        prefix = view.prefix
        if attached.prompt is not None and self.index is not None:
            self.index.expire(now)
            cached = self.index.cached_tokens(attached.prompt, [e.engine_id for e in candidates])
            prefix = PrefixMatch(attached.prompt.prompt_tokens, cached)
        affinity = view.affinity
        if attached.affinity_key is not None and self.affinity is not None:
            affinity = Affinity(attached.affinity_key, self.affinity.get(attached.affinity_key, now))
        if prefix is view.prefix and affinity is view.affinity:
            return view
        return replace(view, prefix=prefix, affinity=affinity)

    def lookup(self, engine_ids: Sequence[str], now: float) -> PrefixLookup | None:
        """What each of ``engine_ids`` holds of a request's prompt, by request id, as the index
        knows it at ``now`` (None without an index): HyperFlexis's turn reads it for the requests
        it examines, each once. The shared part is known only with ``track_in_use``."""
        index = self.index
        if index is None:
            return None
        index.expire(now)
        attached = self._attached
        in_use = self._in_use
        seen: dict[str, Held | None] = {}

        def held(request_id: str) -> Held | None:
            if request_id in seen:
                return seen[request_id]
            entry = attached.get(request_id)
            match = None
            prompt = None if entry is None else entry.prompt
            if prompt is not None and len(prompt):
                total = prompt.prompt_tokens
                cached = {
                    e: min(1.0, n / total) for e, n in index.cached_tokens(prompt, engine_ids).items() if n
                }
                shared: dict[str, float] = {}
                for e in cached:
                    counts = in_use.get(e)
                    if counts:
                        size = index.block_size(e)
                        n = sum(1 for _ in takewhile(counts.__contains__, prompt.hashes(size)))
                        if n:
                            shared[e] = min(1.0, n * size / total)
                match = Held(cached, shared) if cached else None
            seen[request_id] = match
            return match

        return held

    def dispatched(self, request_id: str, engine_id: str, now: float) -> None:
        """The router chose ``engine_id``: the prompt will be cached there, the session goes there
        (Gimbal's line 21: the map is updated with every choice, affinity or not)."""
        attached = self._attached.get(request_id)
        if attached is None:
            return
        prompt = attached.prompt
        keys: list[int] | None = None
        block_size = 0
        if prompt is not None and self.index is not None:
            # what the engine chosen holds of the prompt, as the index knows it before this
            # dispatch writes the whole prompt there: the routing's expected prefix hit
            cached = self.index.cached_tokens(prompt, (engine_id,))[engine_id]
            total = len(prompt)
            full = total - cached < self.index.block_size(engine_id)
            match = "none" if cached == 0 else "full" if full else "partial"
            metrics.child(metrics.PREFIX_ROUTED, engine_id, match).inc()
            metrics.child(metrics.PREFIX_ROUTED_TOKENS, engine_id, "hit").inc(cached)
            metrics.child(metrics.PREFIX_ROUTED_TOKENS, engine_id, "miss").inc(total - cached)
            self.index.record_dispatch(engine_id, prompt, now)
            block_size = self.index.block_size(engine_id)
            keys = prompt.hashes(block_size)
            if self.track_in_use:
                self._stop_using(request_id)  # (a request placed again uses the new engine's blocks)
                self._in_use.setdefault(engine_id, Counter()).update(keys)
                self._using[request_id] = (engine_id, keys)
        session = attached.affinity_key if self.affinity is not None else None
        if session is not None and self.affinity is not None:
            before = self.affinity.get(session, now)
            outcome = "new" if before is None else "kept" if before == engine_id else "moved"
            metrics.child(metrics.AFFINITY_ROUTED, outcome).inc()
            self.affinity.put(session, engine_id, now)
        if self.route_listener is not None and (keys or session is not None):
            self.route_listener(engine_id, block_size, keys or None, session)

    def routed_elsewhere(
        self, engine_id: str, block_size: int, keys: list[int] | None, session: str | None, now: float
    ) -> bool:
        """Another gateway replica sent a request to ``engine_id``: its prompt's ``keys`` (chained
        at ``block_size``) are cached there as if dispatched here, and its session goes there.
        False unless all of it was taken: an engine this fleet does not have (nothing is), or keys
        at another block size than this index keys the engine at (the session still is)."""
        if engine_id not in self.fleet.records:
            return False
        whole = True
        if keys and self.index is not None:
            whole = self.index.record_keys(engine_id, block_size, keys, now)
        if session is not None and self.affinity is not None:
            self.affinity.put(session, engine_id, now)
        return whole

    def observe(self) -> None:
        """Set the index's gauges (at scrape time: they are not kept up to date per write)."""
        if self.index is None:
            return
        metrics.PREFIX_INDEX_BYTES.set(self.index.bytes_used)
        for engine_id in self.index.engines():
            metrics.child(metrics.PREFIX_INDEX_BLOCKS, engine_id).set(self.index.entries(engine_id))


def _scraped_block_size(record: EngineRecord) -> int | None:
    """The block size the engine's scrape reports, when its KV events hash blocks by it."""
    if record.state is None or not record.adapter.scraped_block_size_keys_events:
        return None
    return record.state.block_size
