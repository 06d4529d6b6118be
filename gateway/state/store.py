"""The state store seam: what gateway replicas share, and the embedded in-memory default.

A store keeps byte values under string keys, each with a time to live, named groups of members
(sets), and channels that deliver what is published to every subscriber at that moment. That is
all that sharing load across replicas needs (:mod:`gateway.state.replica_load`): each replica
publishes its counts as they change and writes them under its own key, and a replica that dies
without a word drops out when its key expires. :class:`MemoryStore` serves one process (the default, and
several replicas in one test); :class:`gateway.state.redis_store.RedisStore` serves replicas in a
cluster. Both pass the same contract tests (``tests/state/test_state_store.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from typing import Protocol

from gateway import metrics

log = logging.getLogger(__name__)


class StoreError(Exception):
    """The store could not be reached or did not answer in time; what was asked may or may not
    have been done (the caller retries on its next round)."""


class StateStore(Protocol):
    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Set ``key`` to ``value``, gone after ``ttl_s`` seconds unless put again."""
        ...

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, in order; None for a key that is absent or expired."""
        ...

    async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float) -> None:
        """:meth:`put` of each ``(key, value)``, all in one exchange with the store."""
        ...

    def scan(self, prefix: str, batch: int = 512) -> AsyncGenerator[list[tuple[str, bytes]], None]:
        """Every live key that starts with ``prefix``, with its value, a batch of about ``batch``
        at a time (a key put or expiring meanwhile may or may not be in it)."""
        ...

    async def delete(self, key: str) -> None: ...

    async def join(self, group: str, member: str) -> None:
        """Add ``member`` to the set ``group`` (no expiry: members are dropped by :meth:`leave`)."""
        ...

    async def members(self, group: str) -> set[str]: ...

    async def leave(self, group: str, members: Collection[str]) -> None: ...

    async def publish(self, channel: str, message: bytes) -> None:
        """Deliver ``message`` to every subscriber of ``channel`` now (none: it is gone)."""
        ...

    def subscribe(self, channel: str) -> AsyncGenerator[bytes, None]:
        """Messages published to ``channel`` from the moment of subscribing, in order; raises
        :class:`StoreError` when the subscription is lost (subscribe again: what was published
        meanwhile is gone)."""
        ...

    async def close(self) -> None: ...


def check_ttl(ttl_s: float) -> float:
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"a time to live must be a positive number of seconds, not {ttl_s!r}")
    return ttl_s


class MemoryStore:
    """The store of one process: the embedded default, where there is one replica. Expiry is
    judged when a key is read, by ``clock`` (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._values: dict[str, tuple[bytes, float]] = {}
        self._groups: dict[str, set[str]] = {}
        self._subscribers: dict[str, set[asyncio.Queue[bytes]]] = {}

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        self._values[key] = (bytes(value), self.clock() + check_ttl(ttl_s))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        now = self.clock()
        found: list[bytes | None] = []
        for key in keys:
            held = self._values.get(key)
            if held is not None and held[1] <= now:
                del self._values[key]
                held = None
            found.append(None if held is None else held[0])
        return found

    async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float) -> None:
        for key, value in items:
            await self.put(key, value, ttl_s)

    async def scan(self, prefix: str, batch: int = 512) -> AsyncGenerator[list[tuple[str, bytes]], None]:
        keys = [key for key in self._values if key.startswith(prefix)]
        for start in range(0, len(keys), batch):
            part = keys[start : start + batch]
            found = [(k, v) for k, v in zip(part, await self.get_many(part), strict=True) if v is not None]
            if found:
                yield found

    async def delete(self, key: str) -> None:
        self._values.pop(key, None)

    async def join(self, group: str, member: str) -> None:
        self._groups.setdefault(group, set()).add(member)

    async def members(self, group: str) -> set[str]:
        return set(self._groups.get(group, ()))

    async def leave(self, group: str, members: Collection[str]) -> None:
        held = self._groups.get(group)
        if held is not None:
            held.difference_update(members)
            if not held:
                del self._groups[group]

    async def publish(self, channel: str, message: bytes) -> None:
        for queue in self._subscribers.get(channel, ()):
            queue.put_nowait(bytes(message))

    async def subscribe(self, channel: str) -> AsyncGenerator[bytes, None]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._subscribers.setdefault(channel, set()).add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers[channel].discard(queue)

    async def close(self) -> None:
        return None


async def listen(
    store: StateStore,
    channel: str,
    heard: Callable[[bytes], object],
    stopping: Callable[[], bool],
    retry_s: float,
    what: str,
) -> None:
    """Hand every message of ``channel`` to ``heard`` until ``stopping()`` (or cancellation):
    a subscription lost is taken again after ``retry_s`` (what was published meanwhile is gone).
    A failure of ``heard`` on one message is logged (once per subscription) and the next is
    read: it must not cost the subscription, nor the messages published while it is taken again."""
    outage = False  # (the subscription has failed since it last delivered a message)
    while not stopping():
        try:
            async with contextlib.aclosing(store.subscribe(channel)) as messages:
                failed = False
                async for message in messages:
                    if stopping():
                        return
                    if outage:
                        log.info("%s subscription is back", what)
                        outage = False
                    try:
                        heard(message)
                    except Exception:
                        if not failed:
                            log.exception("%s: a message could not be taken", what)
                            failed = True
        except StoreError as exc:
            # counted every time, said once an outage: a Redis that refuses SUBSCRIBE (an ACL
            # without pub/sub, a proxy without it) left replicas sharing nothing, unseen
            metrics.STATE_STORE_ERRORS.inc()
            if not outage:
                log.warning("%s subscription lost (%s); subscribing again every %g s", what, exc, retry_s)
            outage = True
        except Exception:
            metrics.STATE_STORE_ERRORS.inc()
            log.exception("%s subscription failed", what)
            outage = True
        await asyncio.sleep(retry_s)
