"""Every gateway replica's requests on each engine, shared through the state store.

Replicas behind one Service each see only their own requests between two scrapes of an engine's
metrics: two replicas under ``max_engine_load: 2`` put four requests on an engine, and least-load
routing sent both replicas' bursts to the same engine (the peers' "load counted per replica"
complaint). Here each replica tells the others its in-flight counts per engine as they change,
and the fleet adds theirs to its own (:meth:`Fleet.update_remote`), so routing, ``max_engine_load``
and HyperFlexis's seats count every replica's requests.

Two paths, one message. A reservation or a release here schedules a push within ``push_delay_s``
(what changed meanwhile goes in one message): the replica's counts are written under its own key
and published on a channel every replica subscribes to, so the others hear of a placement within
about a round trip. Every ``interval_s`` a full round writes them again and reads every replica's
key: what a lost subscription missed, and replicas that died (their key expired) or stopped (they
delete it), are put right there. Messages carry a sequence number per replica, so an old message
never undoes a newer read.

What a replica knows of the others is at most a push (``push_delay_s`` plus a round trip) old
while the subscription holds, at most ``interval_s`` old when it does not: two replicas placing on
one engine within that window can both take its last seat (the limit is exact per replica). When
the store cannot be reached the others' counts are kept for ``ttl_s``, then dropped: the engines'
scrapes still count every replica's requests.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from gateway import metrics
from gateway.fleet.registry import Fleet
from gateway.state.store import StateStore, StoreError, listen
from gateway.tasks import DelayedWake, cancel_and_wait

log = logging.getLogger(__name__)

#: the version of what a replica writes; a value of another version is not read (replicas of two
#: releases side by side during a rolling update then only miss each other's counts)
FORMAT = 1
#: how far past its key a replica's pushes may be numbered by the next full round (one push per
#: push delay at most): a message numbered further is not believed over the key
MAX_SEQ_AHEAD = 1_000_000
#: bounds on what another replica may claim, per engine
MAX_COUNT = 1_000_000
MAX_TOKENS = 1 << 50
#: the largest load message taken (one engine's entry is tens of bytes: room for 100,000 busy
#: engines) and the most replicas a round reads (group members are read back from the store,
#: which anything with access to it may write: each became a key of one MGET, every round)
MAX_MESSAGE_BYTES = 8 << 20
MAX_REPLICAS = 1024

Loads = dict[str, tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class Said:
    """One replica's message: who, which life of it (a random id per process), its number in that
    life, and its counts for the engines this fleet knows."""

    replica: str
    life: str
    seq: int
    loads: Loads


def encode(fleet: Fleet | None, replica_id: str, life: str, seq: int) -> bytes:
    """What a replica says of itself: its requests on each engine that has any (count, reserved
    and running tokens; none for ``fleet`` None: it is leaving), numbered ``seq`` in its ``life``."""
    engines = (
        {}
        if fleet is None
        else {
            r.engine_id: (r.in_flight, r.in_flight_tokens, r.running_tokens)
            for r in fleet.records.values()
            if r.in_flight > 0
        }
    )
    return orjson.dumps({"v": FORMAT, "r": replica_id, "i": life, "seq": seq, "engines": engines})


def decode(value: bytes, known: frozenset[str] | set[str]) -> Said | None:
    """The message, with its counts for the engines this fleet knows; None when the value is not
    one this version writes (a count or token total out of bounds makes all of it so)."""
    if len(value) > MAX_MESSAGE_BYTES:
        return None
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("v") != FORMAT:
        return None
    replica, life, seq, engines = doc.get("r"), doc.get("i"), doc.get("seq"), doc.get("engines")
    if not (
        isinstance(replica, str) and isinstance(life, str) and type(seq) is int and isinstance(engines, dict)
    ):
        return None
    loads: Loads = {}
    for engine_id, entry in engines.items():
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)):
            return None
        count, tokens, running = entry
        if not (0 <= count <= MAX_COUNT and 0 <= tokens <= MAX_TOKENS and 0 <= running <= MAX_TOKENS):
            return None
        if engine_id in known:
            loads[engine_id] = (count, tokens, running)
    return Said(replica, life, seq, loads)


class ReplicaLoad:
    def __init__(
        self,
        fleet: Fleet,
        store: StateStore,
        replica_id: str,
        interval_s: float = 0.5,
        push_delay_s: float = 0.002,
        store_timeout_s: float = 0.5,
        namespace: str = "slogate",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.push_delay_s = push_delay_s
        #: long enough that a replica busy for a few rounds, or whose store is slow (a full round
        #: is six commands, each up to ``store_timeout_s``), is not taken for gone
        self.ttl_s = max(2.0, 5 * interval_s, 8 * store_timeout_s)
        # (one hash tag for every key: a cluster client would need them in one slot for a multi-key
        # read; Redis Cluster itself is not supported)
        self.group = f"{{{namespace}}}:replicas"
        self.channel = f"{{{namespace}}}:load-changes"
        self._prefix = f"{{{namespace}}}:load:"
        #: this process's life: messages are ordered by number within a life; a message of
        #: another life of a replica (restarted under its name, as a pod's container is) is newer
        #: than what was held when it comes, and a full round's key wins over any other life
        self.life = secrets.token_hex(8)
        # (how its own messages begin: encode writes these keys first, in this order)
        self._own = orjson.dumps({"v": FORMAT, "r": replica_id, "i": self.life})[:-1] + b","
        #: the other replicas whose counts are counted
        self.peers: tuple[str, ...] = ()
        self.errors = 0
        self.clock = clock
        self._known = set(fleet.records)
        #: what each other replica last said
        self._others: dict[str, Said] = {}
        self._total: Loads = {}
        self._seq = 0
        self._twin_warned = False
        self._ok_at = clock()
        self._failing = False
        self._pushes = DelayedWake(push_delay_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def has_peers(self) -> bool:
        """Whether another replica is known now (what :mod:`gateway.state.replica_routes` asks
        before it tells anyone of a dispatch)."""
        return bool(self.peers)

    def key(self, replica_id: str) -> str:
        return self._prefix + replica_id

    def start(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self.fleet.load_listener = self._pushes.poke
        self._tasks = [
            loop.create_task(self._run(), name="replica-load"),
            loop.create_task(self._listen(), name="replica-load-listen"),
        ]

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's counts (the others drop them at once)."""
        tasks, self._tasks = self._tasks, []
        # (the loops end on this too, should a cancellation be swallowed on the way)
        self._stopping = True
        if self.fleet.load_listener == self._pushes.poke:
            self.fleet.load_listener = None
        await cancel_and_wait(*tasks)
        try:
            await self.store.delete(self.key(self.replica_id))
            await self.store.leave(self.group, [self.replica_id])
            self._seq += 1
            await self.store.publish(self.channel, encode(None, self.replica_id, self.life, self._seq))
        except StoreError as exc:
            log.warning("could not withdraw this replica's load from the state store: %s", exc)
        finally:
            await self.store.close()

    # -- this replica's counts out --------------------------------------------------------------

    async def _run(self) -> None:
        next_full = self.clock()
        while not self._stopping:
            # (a reservation or a release here pokes: pushed within push_delay_s)
            await self._pushes.wait(next_full - self.clock())
            full = self.clock() >= next_full
            if full:
                next_full = self.clock() + self.interval_s
            await self.round(full)

    async def round(self, full: bool = True) -> None:
        """Push this replica's counts; with ``full``, read every replica's too. Never raises but
        for cancellation: a failure is counted, logged once per outage, and the next round is the
        retry."""
        try:
            await self._push(full)
            if full:
                await self._read_all()
        except StoreError as exc:
            self._failed(str(exc))
        except Exception as exc:  # (a bug here must not end the exchange for good)
            log.exception("replica load exchange failed")
            self._failed(f"{type(exc).__name__}: {exc}")
        else:
            if full:
                if self._failing:
                    log.warning("state store reachable again: sharing load with %d replicas", len(self.peers))
                self._failing = False
                self._ok_at = self.clock()
        metrics.REPLICAS.set(len(self.peers) + 1)

    async def _push(self, full: bool) -> None:
        """Publish this replica's counts; on a full round, write them under its key as well (the
        key is what a replica that missed a message, or starts, reads: at most a round old)."""
        self._seq += 1
        value = encode(self.fleet, self.replica_id, self.life, self._seq)
        if full:
            await self.store.put(self.key(self.replica_id), value, self.ttl_s)
        await self.store.publish(self.channel, value)

    # -- the others' counts in ------------------------------------------------------------------

    async def _read_all(self) -> None:
        store = self.store
        # (every round: a store that restarted, or others that took this replica for gone while
        # it was stalled, learn of it again)
        await store.join(self.group, self.replica_id)
        members = await store.members(self.group) - {self.replica_id}
        # (past the bound, the peers already heard first: junk members that sort first must not
        # push real peers out of the read)
        known = sorted(members.intersection(self._others))
        others = (known + sorted(members.difference(self._others)))[:MAX_REPLICAS]
        values = await store.get_many([self.key(m) for m in others])
        gone = [m for m, v in zip(others, values, strict=True) if v is None]
        if gone:
            await store.leave(self.group, gone)
        heard: dict[str, Said] = {}
        for member, value in zip(others, values, strict=True):
            said = None if value is None else decode(value, self._known)
            if said is None or said.replica != member:
                continue
            held = self._others.get(member)
            # a message of the key's life numbered past it (not implausibly far) is newer: pushes
            # are not written to the key; one of another life is not: a replica writes its key
            # first thing in a life, so the key holds its latest life, and a message claiming
            # another is old or not its own
            if (
                held is not None
                and held.life == said.life
                and said.seq < held.seq <= said.seq + MAX_SEQ_AHEAD
            ):
                heard[member] = held
            else:
                heard[member] = said
        self._others = heard
        self._apply(set(self._total).union(*(said.loads for said in heard.values())))

    async def _listen(self) -> None:
        await listen(
            self.store,
            self.channel,
            self._heard,
            lambda: self._stopping,
            min(1.0, self.interval_s),
            "replica load",
        )

    def _heard(self, message: bytes) -> None:
        if message.startswith(self._own):
            return  # (every replica hears its own messages too: not parsed)
        said = decode(message, self._known)
        if said is None:
            return
        if said.replica == self.replica_id:
            if not self._twin_warned:
                self._twin_warned = True
                log.warning(
                    "another gateway process calls itself %r too: their loads cannot be told apart; "
                    "give each replica its own replica_id",
                    self.replica_id,
                )
            return
        held = self._others.get(said.replica)
        if held is not None and held.life == said.life and held.seq >= said.seq:
            return  # (an older message of the same life)
        self._others[said.replica] = said
        self._apply(set(said.loads) | (set(held.loads) if held is not None else set()))

    def _apply(self, engines: set[str]) -> None:
        """Recount the others' requests on ``engines`` (those some replica's news named) and hand
        what changed to the fleet."""
        changes: Loads = {}
        for engine_id in engines:
            total = (0, 0, 0)
            for said in self._others.values():
                held = said.loads.get(engine_id)
                if held is not None:
                    total = (total[0] + held[0], total[1] + held[1], total[2] + held[2])
            if self._total.get(engine_id, (0, 0, 0)) != total:
                changes[engine_id] = total
                if total == (0, 0, 0):
                    self._total.pop(engine_id, None)
                else:
                    self._total[engine_id] = total
        self.peers = tuple(sorted(self._others))
        if changes:
            self.fleet.update_remote(changes, self.clock())

    def _failed(self, why: str) -> None:
        self.errors += 1
        metrics.STATE_STORE_ERRORS.inc()
        if not self._failing:
            log.warning("state store unreachable (%s): other replicas' load kept for %g s", why, self.ttl_s)
            self._failing = True
        if self.clock() - self._ok_at > self.ttl_s and self._others:
            # too old to count on: the engines' scrapes still show the others' requests
            self._others = {}
            self._apply(set(self._total))
            self.peers = ()
