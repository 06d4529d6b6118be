"""Session affinity: the session key, the state-store seam that remembers where a session went,
and the scorer that prefers that engine.

A session's next request usually repeats its whole history as the prompt, so the engine that
served the last one holds most of it in cache. The router looks the session up before it routes
(``RequestView.affinity``) and records where the request went after; the scorer only reads.

The store is a seam: :class:`AffinityStore` is all the router needs, :class:`MemoryAffinityStore`
is the one-gateway implementation. It is synchronous on purpose (routing never waits on I/O): a
shared one for several gateway replicas keeps a local copy like this one and exchanges changes
with Redis in the background (write-behind, a subscription for the others' writes), where a
lookup missing another replica's latest write only costs one cache miss.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from policies.api import EngineSnapshot, RequestView
from policies.plugins.cache_aware import ImbalanceGuard
from policies.registry import register

#: session ids and user names longer than this are keyed by a digest (bounded memory per entry)
_MAX_KEY_PART = 128
#: the longest key :func:`affinity_key` makes: tenant, separator, source, session id or user
MAX_KEY_CHARS = 2 * _MAX_KEY_PART + 3


def _part(value: str) -> str:
    if len(value) <= _MAX_KEY_PART:
        return value
    return "#" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def affinity_key(tenant: str, session_id: str | None = None, user: str | None = None) -> str | None:
    """The session key of a request: ``x-session-id`` if the client sent one, else the body's
    ``user``; None when there is neither. Session ids and users are client-chosen, so they are
    scoped by tenant: two tenants' "alice" are two sessions. The source is part of the key, so a
    session id can never equal a user name.

    The API key is no session: an application usually sends all its users' traffic with one
    key, and keyed by it, every request of that application was one "session" that the
    affinity scorer held on one engine until the imbalance guard let go (9 of 12 concurrent
    requests on one of 4 engines). Requests that share a prompt prefix without a session still
    meet through the prefix index."""
    if session_id:
        return f"{_part(tenant)}\x1fs:{_part(session_id)}"
    if user:
        return f"{_part(tenant)}\x1fu:{_part(user)}"
    return None


class AffinityStore(Protocol):
    """Where sessions last went. ``now`` is the caller's monotonic clock: the store reads none."""

    def get(self, key: str, now: float) -> str | None:
        """The engine ``key`` was last sent to, if that was within the TTL."""
        ...

    def put(self, key: str, engine_id: str, now: float) -> None:
        """``key`` was just sent to ``engine_id``."""
        ...


class MemoryAffinityStore:
    """Session -> (engine, last use), for one gateway process, in two least-recently-used
    segments: a session seen once is on probation (half the bound), one seen again is protected
    (the other half). Session keys are the clients' own: one client sending every request with
    a new id pushed every other session out of a single LRU; here it churns only the probation
    half, and sessions that came back keep their engines. A protected session pushed out goes
    back on probation, the least recently used of which is forgotten (it then routes like a new
    one). An entry expires ``ttl_s`` after the session's last request: an engine's cache turns
    over in minutes, after which sticking to it buys nothing.
    """

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 2:
            raise ValueError(f"max_entries must be >= 2, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._probation_max = max_entries // 2
        self._protected_max = max_entries - self._probation_max
        self._probation: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._protected: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def get(self, key: str, now: float) -> str | None:
        segment = self._protected if key in self._protected else self._probation
        entry = segment.get(key)
        if entry is None:
            return None
        engine_id, last = entry
        if now - last > self.ttl_s:
            del segment[key]
            return None
        return engine_id

    def put(self, key: str, engine_id: str, now: float) -> None:
        protected, probation = self._protected, self._probation
        if key in protected or probation.pop(key, None) is not None:
            protected[key] = (engine_id, now)
            protected.move_to_end(key)
            if len(protected) > self._protected_max:
                demoted, entry = protected.popitem(last=False)
                probation[demoted] = entry
        else:
            probation[key] = (engine_id, now)
        while len(probation) > self._probation_max:
            probation.popitem(last=False)


@register("scorer", "session_affinity")
class SessionAffinity:
    """1 for the engine the request's session last went to (``RequestView.affinity``), 0 for
    the others (all 0 for a request without a session, a new or expired one, or one whose
    engine is not a candidate now).

    With the imbalance guard (``max_spread`` requests, ``max_ratio``; ``max_spread: null`` turns
    it off) the session's engine scores 0 while it is over the bound: the session keeps its
    engine while that engine is not overloaded, and load decides otherwise.
    """

    def __init__(self, max_spread: float | None = 8.0, max_ratio: float = 1.5) -> None:
        self.guard = None if max_spread is None else ImbalanceGuard(max_spread, max_ratio)

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        affinity = request.affinity
        target = None if affinity is None else affinity.engine_id
        scores = [1.0 if e.engine_id == target else 0.0 for e in engines]
        if target is None or self.guard is None or not any(scores):
            return scores
        return [0.0 if over else s for s, over in zip(scores, self.guard.over(engines), strict=True)]
