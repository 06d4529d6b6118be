"""Every gateway replica's requests on each engine, shared through the state store.

Replicas behind one Service each see only their own requests between two scrapes of an engine's
metrics: two replicas under ``max_engine_load: 2`` put four requests on an engine, and least-load
routing sent both replicas' bursts to the same engine (the peers' "load counted per replica"
complaint). Here each replica writes its in-flight counts per engine under its own key every
``interval_s`` and reads the others'; the fleet adds theirs to its own (:meth:`Fleet.set_remote`),
so routing, ``max_engine_load`` and HyperFlexis's seats count every replica's requests.

What is shared is at most one round old: two replicas placing on one engine within one interval
can still both take its last seat (the limit is exact per replica, and across replicas up to what
the others placed in the last ``interval_s``). A replica that stops deletes its key; one that dies
drops out when its key expires (``ttl_s``). When the store cannot be reached the others' counts
are kept for ``ttl_s``, then dropped: the engines' scrapes still count every replica's requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import orjson

from gateway import metrics
from gateway.fleet.registry import Fleet
from gateway.state.store import StateStore, StoreError
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

#: the version of what a replica writes; a value of another version is not read (replicas of two
#: releases side by side during a rolling update then only miss each other's counts)
FORMAT = 1
#: bounds on what another replica may claim, per engine
MAX_COUNT = 1_000_000
MAX_TOKENS = 1 << 50

Loads = dict[str, tuple[int, int, int]]


def encode(fleet: Fleet) -> bytes:
    """This replica's requests on each engine that has any: count, reserved and running tokens."""
    engines = {
        r.engine_id: (r.in_flight, r.in_flight_tokens, r.running_tokens)
        for r in fleet.records.values()
        if r.in_flight > 0
    }
    return orjson.dumps({"v": FORMAT, "engines": engines})


def decode(value: bytes, known: frozenset[str] | set[str]) -> Loads | None:
    """Another replica's counts, for the engines this fleet knows; None when the value is not one
    this version writes (an engine id, count or token total out of bounds makes all of it so)."""
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("v") != FORMAT or not isinstance(doc.get("engines"), dict):
        return None
    loads: Loads = {}
    for engine_id, entry in doc["engines"].items():
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)):
            return None
        count, tokens, running = entry
        if not (0 <= count <= MAX_COUNT and 0 <= tokens <= MAX_TOKENS and 0 <= running <= MAX_TOKENS):
            return None
        if engine_id in known:
            loads[engine_id] = (count, tokens, running)
    return loads


def add(total: Loads, more: Loads) -> None:
    for engine_id, (count, tokens, running) in more.items():
        held = total.get(engine_id)
        total[engine_id] = (
            (count, tokens, running)
            if held is None
            else (held[0] + count, held[1] + tokens, held[2] + running)
        )


class ReplicaLoad:
    def __init__(
        self,
        fleet: Fleet,
        store: StateStore,
        replica_id: str,
        interval_s: float = 0.1,
        ttl_s: float | None = None,
        namespace: str = "slogate",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.replica_id = replica_id
        self.interval_s = interval_s
        #: long enough that a replica busy for a few rounds is not taken for gone
        self.ttl_s = ttl_s if ttl_s is not None else max(2.0, 5 * interval_s)
        # (one hash tag for every key: one slot on Redis Cluster, so a multi-key read works)
        self.group = f"{{{namespace}}}:replicas"
        self._prefix = f"{{{namespace}}}:load:"
        #: the other replicas whose counts were read in the last round
        self.peers: tuple[str, ...] = ()
        self.errors = 0
        self._known = set(fleet.records)
        self.clock = clock
        self._ok_at = clock()
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    def key(self, replica_id: str) -> str:
        return self._prefix + replica_id

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-load")

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's counts (the others drop them at once)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        try:
            await self.store.delete(self.key(self.replica_id))
            await self.store.leave(self.group, [self.replica_id])
        except StoreError as exc:
            log.warning("could not withdraw this replica's load from the state store: %s", exc)
        finally:
            await self.store.close()

    async def _run(self) -> None:
        while True:
            started = self.clock()
            await self.round()
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    async def round(self) -> None:
        """One exchange: write this replica's counts, read the others', hand them to the fleet.
        Never raises but for cancellation: a failure is counted, logged once per outage, and the
        next round is the retry."""
        try:
            await self._exchange()
        except StoreError as exc:
            self._failed(str(exc))
        except Exception as exc:  # (a bug here must not end the exchange for good)
            log.exception("replica load exchange failed")
            self._failed(f"{type(exc).__name__}: {exc}")
        else:
            if self._failing:
                log.warning("state store reachable again: sharing load with %d replicas", len(self.peers))
            self._failing = False
            self._ok_at = self.clock()
        metrics.REPLICAS.set(len(self.peers) + 1)

    async def _exchange(self) -> None:
        store = self.store
        await store.put(self.key(self.replica_id), encode(self.fleet), self.ttl_s)
        # (every round: a store that restarted, or others that took this replica for gone while
        # it was stalled, learn of it again)
        await store.join(self.group, self.replica_id)
        others = sorted(await store.members(self.group) - {self.replica_id})
        values = await store.get_many([self.key(m) for m in others])
        gone = [m for m, v in zip(others, values, strict=True) if v is None]
        if gone:
            await store.leave(self.group, gone)
        total: Loads = {}
        peers = []
        for member, value in zip(others, values, strict=True):
            if value is None:
                continue
            loads = decode(value, self._known)
            if loads is None:
                log.debug("replica %r wrote a load this version does not read", member)
                continue
            peers.append(member)
            add(total, loads)
        self.peers = tuple(peers)
        self.fleet.set_remote(total)

    def _failed(self, why: str) -> None:
        self.errors += 1
        metrics.STATE_STORE_ERRORS.inc()
        if not self._failing:
            log.warning("state store unreachable (%s): other replicas' load kept for %g s", why, self.ttl_s)
            self._failing = True
        if self.clock() - self._ok_at > self.ttl_s:
            # too old to count on: the engines' scrapes still show the others' requests
            self.peers = ()
            self.fleet.set_remote({})
