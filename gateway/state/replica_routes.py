"""Where every gateway replica sent its requests, shared: the prefix index's dispatch feed and the
session map, as if each replica had made every replica's dispatches.

Behind a Service, a conversation's turns land on replicas in turn. Each replica learned where a
prompt is cached and where a session went only from its own dispatches, so the next turn, sent to
another replica, found neither and went wherever load said: the prompt was prefilled again on a
cold engine (the peers' "replicas that split prefix state"). Here each dispatch with a prompt or a
session is told to the other replicas (the engine, the prompt's chained block keys, the session
key), and each writes it into its own index, as a dispatch of its own (an approximate entry with
the dispatch time to live: what an engine's KV events reported stays precise), and into its
session map. The engines' KV events, where they are published, reach every replica already (each
subscribes); what only the gateways know is where a prompt went before the engine says it cached
it (or for engines that publish no events), and sessions.

Two replicas that dispatch one session at the same moment each hear the other's after their
own: routes carry their dispatch's wall-clock time, and the later (by time, then replica id) is
kept on both, rather than each taking the other's engine. A replica stamps its own dispatch of a
session past any it knows of (a hybrid logical clock), so a decision made after hearing another
replica's wins everywhere even when its clock is behind; a stamp far ahead of the receiver's
clock orders nothing.

Bounded for the replicas that read it: at most ``MAX_KEYS`` leading keys a route and
``MAX_MESSAGE_KEYS`` a message (past that a route goes with its session only, or is dropped and
counted, never queued), and ``MAX_MESSAGE_BYTES`` (a longer batch is sent in parts); a message
longer than that or malformed in any part is not taken at all (counted as rejected).

Write-behind, as the load exchange: routing never waits on the store. What was dispatched within
``push_delay_s`` goes in one message on a channel every replica subscribes to, only while another
replica is known (:class:`~gateway.state.replica_load.ReplicaLoad` finds them). A message lost
(a subscription broken, the store out of reach) costs hints, not correctness: the index's entries
are guesses with a time to live anyway, and the session's next request is routed by load and
recorded again.

A replica that starts (a scale-out, every replica of a rolling update) also learns the sessions
dispatched before it: each dispatch of a session is also written under its own key with the
session map's time to live (write-behind, in the same push; also with no other replica running,
for the one that replaces it), and a starting replica reads them all once, in batches, into its
session map (each aged by its dispatch's time; a session it already routed or heard of is left as
it is). The prefix index is not recovered so: its entries are two-minute guesses, and the
engines' KV events say what they hold.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from gateway import metrics
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.state.store import StateStore, StoreError, listen
from gateway.tasks import DelayedWake, cancel_and_wait
from policies.plugins.affinity import MAX_KEY_CHARS

log = logging.getLogger(__name__)

#: the version of a message; another version's are not read (a rolling update shares nothing
#: between releases until it is done)
FORMAT = 2
#: routes one message carries: more waiting at once are dropped (counted) rather than held
#: without bound behind a store that does not keep up
MAX_ROUTES = 256
#: a prompt's leading block keys one route carries (a match counts leading blocks: the head of a
#: longer prompt is what the others can use); 4,096 blocks of 16 tokens are 65,536 tokens
MAX_KEYS = 4096
#: block keys one message carries, all routes together (about 175 KB of base64): a message must
#: never stall a replica that reads it, nor pass Redis's buffer for a subscriber (32 MB by
#: default); routes past it wait for no message, they are dropped (counted)
MAX_MESSAGE_KEYS = 16_384
#: a message longer than this is not parsed (what the bounds above allow, with room)
MAX_MESSAGE_BYTES = 1 << 20
#: the longest session key taken: what affinity_key makes
MAX_SESSION_CHARS = MAX_KEY_CHARS
#: the largest block size taken (vLLM's are at most a few hundred tokens)
MAX_BLOCK_SIZE = 1 << 16
#: the latest time a route may say it was made (seconds since the epoch: the year 5138)
MAX_STAMP = 1e11
#: a route stamped further ahead of this replica's own clock than this (seconds) is taken but
#: not ordered by: a replica whose clock runs ahead would otherwise win every session it touched
MAX_AHEAD_S = 1.0
#: the longest replica id read (the settings allow 200 characters)
MAX_REPLICA_CHARS = 256
#: entries dropped from the order's memory per dispatch at most (the rest on the next ones)
PRUNE_PER_NOTE = 16
#: how long (seconds) a session's last dispatch is remembered to order it against another
#: replica's: two dispatches of one session cross only within about a push of each other
STAMP_WINDOW_S = 10.0
#: sessions so remembered at most (whatever the rate)
MAX_STAMPS = 65_536
#: sessions waiting to be written for replicas that start later: more at once are not written
#: (those sessions route by load on a replica started meanwhile)
MAX_PENDING_SESSIONS = 4096
#: sessions a starting replica reads at most
MAX_RECOVERED = 100_000

_KEY = np.dtype("<u8")
#: base64 characters of MAX_KEYS packed keys
_PACKED_CHARS = 4 * -(-MAX_KEYS * 8 // 3)


@dataclass(frozen=True, slots=True)
class Route:
    """A dispatch: the engine, the prompt's leading block keys chained at ``block_size`` (None
    without a prompt), the session key (None without one) and when it was made (wall clock of the
    replica that made it: what orders two replicas' dispatches of one session)."""

    engine_id: str
    block_size: int
    keys: list[int] | None
    session: str | None
    stamp: float = 0.0


def encode(replica_id: str, routes: Sequence[Route]) -> bytes:
    """One message: the replica and its routes, each key list packed as little-endian 64-bit
    integers in base64 (4,000 keys are 43 KB so, 80 KB as JSON numbers)."""
    return orjson.dumps(
        {
            "v": FORMAT,
            "r": replica_id,
            "routes": [
                [
                    r.engine_id,
                    r.block_size,
                    None
                    if not r.keys
                    else base64.b64encode(np.asarray(r.keys[:MAX_KEYS], dtype=_KEY).tobytes()).decode(),
                    r.session,
                    r.stamp,
                ]
                for r in routes
            ],
        }
    )


def decode(message: bytes) -> tuple[str, list[Route]] | None:
    """The replica and its routes; None when the message is not one this version writes, is
    longer than the bounds allow, or any route in it is malformed (nothing of it is taken then)."""
    if len(message) > MAX_MESSAGE_BYTES:
        return None
    try:
        doc = orjson.loads(message)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("v") != FORMAT:
        return None
    replica, raw = doc.get("r"), doc.get("routes")
    if not (
        isinstance(replica, str)
        and len(replica) <= MAX_REPLICA_CHARS
        and isinstance(raw, list)
        and len(raw) <= MAX_ROUTES
    ):
        return None
    routes = []
    keys_in_all = 0
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 5):
            return None
        engine_id, block_size, packed, session, stamp = entry
        if not (
            type(stamp) in (int, float)
            and 0 <= stamp <= MAX_STAMP
            and isinstance(engine_id, str)
            and type(block_size) is int
            # (a route without keys says no block size: 0)
            and (1 if packed is not None else 0) <= block_size <= MAX_BLOCK_SIZE
            and (packed is None or (isinstance(packed, str) and len(packed) <= _PACKED_CHARS))
            and (session is None or (isinstance(session, str) and 0 < len(session) <= MAX_SESSION_CHARS))
        ):
            return None
        keys = None
        if packed is not None:
            try:
                data = base64.b64decode(packed, validate=True)
            except (binascii.Error, ValueError):
                return None
            if not data or len(data) % 8:
                return None
            keys_in_all += len(data) // 8
            if keys_in_all > MAX_MESSAGE_KEYS:
                return None
            keys = np.frombuffer(data, dtype=_KEY).tolist()
        if keys is None and session is None:
            return None
        routes.append(Route(engine_id, block_size, keys, session, float(stamp)))
    return replica, routes


class ReplicaRoutes:
    """This replica's dispatches out, the others' in (see the module's docstring)."""

    def __init__(
        self,
        routing: PrefixRouting,
        store: StateStore,
        replica_id: str,
        has_peers: Callable[[], bool],
        push_delay_s: float = 0.002,
        namespace: str = "slogate",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sessions_ttl_s: float = 600.0,
        max_sessions: int = 100_000,
    ) -> None:
        self.routing = routing
        self.store = store
        self.replica_id = replica_id
        self.has_peers = has_peers
        self.push_delay_s = push_delay_s
        self.clock = clock
        self.wall = wall
        self.channel = f"{{{namespace}}}:routes"
        #: where each session's last dispatch is written, for the replicas that start later
        self.session_prefix = f"{{{namespace}}}:session:"
        self.sessions_ttl_s = sessions_ttl_s
        #: sessions each replica may add to the store per ``sessions_ttl_s`` (a token bucket; the
        #: affinity map's own bound): client-chosen session ids sprayed at thousands a second
        #: made millions of keys, on a Redis that evicts none or that evicted real sessions for them
        self.max_sessions = max_sessions
        self._budget = float(max_sessions)
        self._budget_at = clock()
        #: sessions this replica wrote within ``sessions_ttl_s`` (rewriting one adds no key)
        self._written: OrderedDict[str, float] = OrderedDict()
        #: sessions dispatched here since the last push: (engine, stamp)
        self._sessions: dict[str, tuple[str, float]] = {}
        # (how its own messages begin: encode writes these keys first, in this order)
        self._own = orjson.dumps({"v": FORMAT, "r": replica_id})[:-1] + b","
        self._pending: list[Route] = []
        self._pending_keys = 0
        #: each session's latest dispatch known here, within STAMP_WINDOW_S: (its stamp, the
        #: replica that made it, when it was noted on ``clock``)
        self._stamps: OrderedDict[str, tuple[float, str, float]] = OrderedDict()
        self._warned_ahead: set[str] = set()
        self._pushes = DelayedWake(push_delay_s)
        #: the session writes' own turn: a slow pipeline of writes must not hold the pushes back
        #: (routes waiting meanwhile passed MAX_ROUTES and were dropped, PUBLISH healthy)
        self._writes = DelayedWake(push_delay_s)
        self._started = False
        self._tasks: list[asyncio.Task[object]] = []
        self._stopping = False
        self._failing = False
        #: the session writes' own (a store may take PUBLISH and refuse SET: full, or an ACL)
        self._sessions_failing = False

    def start(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._started = True
        self.routing.route_listener = self._routed
        self._tasks = [
            loop.create_task(self._run(), name="replica-routes"),
            loop.create_task(self._write(), name="replica-routes-sessions"),
            loop.create_task(self._listen(), name="replica-routes-listen"),
        ]
        if self.routing.affinity is not None:
            self._tasks.append(loop.create_task(self.recover_sessions(), name="replica-routes-recover"))

    async def stop(self) -> None:
        """Stop sharing (what waited to be sent is not: the others route it by load). The store is
        the load exchange's, closed there."""
        tasks, self._tasks = self._tasks, []
        self._stopping = True
        if self.routing.route_listener == self._routed:
            self.routing.route_listener = None
        await cancel_and_wait(*tasks)

    # -- this replica's dispatches out ----------------------------------------------------------

    def _routed(self, engine_id: str, block_size: int, keys: list[int] | None, session: str | None) -> None:
        """A dispatch here (the router calls this on the request's path: an append and at most one
        timer per push)."""
        if not self._started:
            return
        peers = self.has_peers()
        if keys is not None and len(keys) > MAX_KEYS:
            keys = keys[:MAX_KEYS]
        count = 0 if keys is None else len(keys)
        if self._pending_keys + count > MAX_MESSAGE_KEYS and session is not None:
            keys, count = None, 0  # (the session costs no key: it goes without them)
        told = peers and len(self._pending) < MAX_ROUTES and self._pending_keys + count <= MAX_MESSAGE_KEYS
        if peers and not told:
            metrics.child(metrics.REPLICA_ROUTES, "dropped").inc()
        if not told and session is None:
            return
        stamp = self.wall()
        if session is not None:
            # later than any dispatch of the session known here, whatever this clock says: what
            # this replica decides after hearing another's must win on every replica
            known = self._known(session)
            if known is not None and known[0] >= stamp:
                stamp = math.nextafter(known[0], math.inf)
            self._note(session, stamp, self.replica_id)
            if (len(self._sessions) < MAX_PENDING_SESSIONS or session in self._sessions) and self._may_write(
                session
            ):
                self._sessions[session] = (engine_id, stamp)
                self._writes.poke()
        if told:
            self._pending.append(Route(engine_id, block_size, keys, session, stamp))
            self._pending_keys += count
            self._pushes.poke()

    def _may_write(self, session: str) -> bool:
        """Whether ``session`` is written to the store: one this replica wrote within its TTL
        always (its key is there already), a new one while the budget lasts."""
        now = self.clock()
        written = self._written.get(session)
        if written is None or now - written >= self.sessions_ttl_s:
            refill = (now - self._budget_at) * self.max_sessions / self.sessions_ttl_s
            self._budget, self._budget_at = min(float(self.max_sessions), self._budget + refill), now
            if self._budget < 1.0:
                metrics.child(metrics.REPLICA_ROUTES, "unwritten").inc()
                return False
            self._budget -= 1.0
        self._written[session] = now
        self._written.move_to_end(session)
        if len(self._written) > self.max_sessions:
            self._written.popitem(last=False)
        return True

    async def _run(self) -> None:
        while not self._stopping:
            await self._pushes.wait()
            routes, self._pending, self._pending_keys = self._pending, [], 0
            if routes:
                await self.push(routes)

    async def _write(self) -> None:
        while not self._stopping:
            await self._writes.wait()
            sessions, self._sessions = self._sessions, {}
            if sessions:
                await self.write_sessions(sessions)

    async def push(self, routes: list[Route]) -> None:
        """Publish ``routes``; never raises but for cancellation (a failure is counted and logged
        once per outage: those routes are lost, the next push is not held back)."""
        message = encode(self.replica_id, routes)
        if len(message) > MAX_MESSAGE_BYTES:
            # (long engine ids and sessions that JSON escapes: the receivers would refuse it whole)
            if len(routes) == 1:
                metrics.child(metrics.REPLICA_ROUTES, "dropped").inc()
                return
            half = len(routes) // 2
            await self.push(routes[:half])
            await self.push(routes[half:])
            return
        try:
            await self.store.publish(self.channel, message)
        except StoreError as exc:
            self._failed(str(exc))
        except Exception as exc:  # (a bug here must not end the sharing for good)
            log.exception("sharing routes with the other replicas failed")
            self._failed(f"{type(exc).__name__}: {exc}")
        else:
            metrics.child(metrics.REPLICA_ROUTES, "sent").inc(len(routes))
            if self._failing:
                log.warning("state store reachable again: sharing routes with the other replicas")
            self._failing = False

    async def write_sessions(self, sessions: dict[str, tuple[str, float]]) -> None:
        """Write each session's last dispatch here under its own key, for replicas that start
        later; never raises but for cancellation (a failure is counted and logged once per
        outage: those sessions route by load on a replica started meanwhile)."""
        items = [
            (self.session_prefix + session, orjson.dumps([engine_id, stamp, self.replica_id]))
            for session, (engine_id, stamp) in sessions.items()
        ]
        try:
            await self.store.put_many(items, self.sessions_ttl_s)
        except Exception as exc:  # (a store error; or a bug, which must not end the sharing)
            metrics.STATE_STORE_ERRORS.inc()
            if not isinstance(exc, StoreError):
                log.exception("writing sessions for the replicas that start later failed")
            elif not self._sessions_failing:
                log.warning(
                    "sessions are not written for the replicas that start later (%s): those route "
                    "their sessions by load",
                    exc,
                )
            self._sessions_failing = True
        else:
            if self._sessions_failing:
                log.warning("sessions are written for the replicas that start later again")
            self._sessions_failing = False

    async def recover_sessions(self) -> int:
        """Read the sessions other replicas (or this one's predecessor) dispatched into this
        one's session map, once, at start; returns how many were taken. A session this replica
        already routed or heard of is left as it is; one whose engine this replica lacks, or
        whose time to live is over, is skipped; a malformed entry is skipped (counted as
        rejected). Never raises but for cancellation (the store out of reach: nothing is)."""
        affinity = self.routing.affinity
        if affinity is None:
            return 0
        taken = 0
        records = self.routing.fleet.records
        prefix = len(self.session_prefix)
        # at most half the session map: the sessions this replica routes meanwhile (its own, the
        # freshest) must not be pushed out of it by older ones read from the store
        most = min(MAX_RECOVERED, getattr(affinity, "max_entries", MAX_RECOVERED) // 2)
        try:
            async for batch in self.store.scan(self.session_prefix):
                now, wall = self.clock(), self.wall()
                for key, value in batch:
                    session = key[prefix:]
                    route = _stored_session(value)
                    if route is None or not 0 < len(session) <= MAX_SESSION_CHARS:
                        metrics.child(metrics.REPLICA_ROUTES, "rejected").inc()
                        continue
                    engine_id, stamp, replica = route
                    age = max(0.0, wall - stamp)
                    if engine_id not in records or age >= self.sessions_ttl_s or affinity.get(session, now):
                        continue
                    # (a stamp far ahead of this clock is taken but orders nothing, as when heard)
                    if stamp <= wall + MAX_AHEAD_S and not self._note(session, stamp, replica):
                        continue
                    self.routing.routed_elsewhere(engine_id, 0, None, session, now - age)
                    taken += 1
                    if taken >= most:
                        break
                if taken >= most:
                    break
        except StoreError as exc:
            log.warning("sessions dispatched before this replica started were not read (%s)", exc)
        except Exception:  # (a bug: the replica serves all the same, its sessions routed by load)
            log.exception("reading the sessions dispatched before this replica started failed")
        if taken:
            metrics.child(metrics.REPLICA_ROUTES, "recovered").inc(taken)
            log.info("%d sessions dispatched before this replica started were taken", taken)
        return taken

    def _known(self, session: str) -> tuple[float, str, float] | None:
        """The latest dispatch of ``session`` noted within the window: (stamp, replica, noted at)."""
        known = self._stamps.get(session)
        return known if known is not None and known[2] > self.clock() - STAMP_WINDOW_S else None

    def _note(self, session: str, stamp: float, replica: str) -> bool:
        """Note a dispatch of ``session`` stamped ``stamp`` by ``replica``; False when a later one
        (by stamp, then replica id) is known: the two replicas that dispatched one session at
        once compare the same two stamps, so both keep the same engine for it (the later)."""
        now = self.clock()
        stamps = self._stamps
        # (noted in order of ``now``: the oldest first, a few per call whatever piled up)
        for _ in range(PRUNE_PER_NOTE):
            if not stamps:
                break
            first_session, first = next(iter(stamps.items()))
            full = len(stamps) >= MAX_STAMPS and session not in stamps
            if first[2] > now - STAMP_WINDOW_S and not full:
                break
            del stamps[first_session]
        known = self._known(session)
        if known is not None and (known[0], known[1]) > (stamp, replica):
            return False
        stamps[session] = (stamp, replica, now)
        stamps.move_to_end(session)
        return True

    def _warn_ahead(self, replica: str, by_s: float) -> None:
        if replica not in self._warned_ahead and len(self._warned_ahead) < 64:
            self._warned_ahead.add(replica)
            log.warning(
                "replica %r stamps its routes %.1f s ahead of this replica's clock: its sessions are "
                "taken but not ordered against the others' (synchronise the clocks)",
                replica,
                by_s,
            )

    def _failed(self, why: str) -> None:
        metrics.STATE_STORE_ERRORS.inc()
        if not self._failing:
            log.warning("state store unreachable (%s): routes are not shared meanwhile", why)
            self._failing = True

    # -- the others' dispatches in --------------------------------------------------------------

    async def _listen(self) -> None:
        await listen(self.store, self.channel, self.heard, lambda: self._stopping, 0.5, "replica routes")

    def heard(self, message: bytes) -> int:
        """Take another replica's routes; returns how many were taken whole (the others were
        skipped, in part or in whole: an engine this replica does not have, or keys at another
        block size than this one's index keys that engine at)."""
        if message.startswith(self._own):
            return 0  # (every replica hears its own messages too: not parsed)
        decoded = decode(message)
        if decoded is None:
            metrics.child(metrics.REPLICA_ROUTES, "rejected").inc()
            return 0
        now = self.clock()
        replica = decoded[0]
        ahead = self.wall() + MAX_AHEAD_S
        known_engines = self.routing.fleet.records
        taken = 0
        for route in decoded[1]:
            session = route.session
            superseded = False
            if session is not None and route.engine_id in known_engines:
                if route.stamp > ahead:
                    self._warn_ahead(replica, route.stamp - ahead + MAX_AHEAD_S)
                elif not self._note(session, route.stamp, replica):
                    session, superseded = None, True  # (a later dispatch of it is known here)
            whole = self.routing.routed_elsewhere(route.engine_id, route.block_size, route.keys, session, now)
            if whole and not superseded:
                taken += 1
        if taken:
            metrics.child(metrics.REPLICA_ROUTES, "taken").inc(taken)
        if taken < len(decoded[1]):
            metrics.child(metrics.REPLICA_ROUTES, "skipped").inc(len(decoded[1]) - taken)
        return taken


def _stored_session(value: bytes) -> tuple[str, float, str] | None:
    """A session's stored dispatch: (engine, stamp, replica); None when it is not one this
    version writes."""
    if len(value) > 4 * (MAX_REPLICA_CHARS + MAX_SESSION_CHARS):
        return None
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(doc, list) and len(doc) == 3):
        return None
    engine_id, stamp, replica = doc
    if not (
        isinstance(engine_id, str)
        and type(stamp) in (int, float)
        and 0 <= stamp <= MAX_STAMP
        and isinstance(replica, str)
        and len(replica) <= MAX_REPLICA_CHARS
    ):
        return None
    return engine_id, float(stamp), replica
