"""The Redis state store: what gateway replicas in a cluster share (see :mod:`gateway.state.store`).

Every call is one command with a deadline: a store that does not answer within ``timeout_s``
raises :class:`StoreError` and the caller goes on with what it has (sharing load is best effort;
the engines' own metrics still show every replica's requests at each scrape). One server (or a
primary): the client is not a Redis Cluster one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Collection, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from gateway.state.store import StoreError, check_ttl

T = TypeVar("T")


def server_of(url: str) -> str:
    """``url`` without its credentials and query: scheme, host, port and database, or the socket's
    path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


#: a subscription pings its server this often while it hears nothing else, and is lost when it
#: hears nothing at all (not even the pings' answers) for this long
SUBSCRIPTION_PING_S = 5.0
SUBSCRIPTION_SILENT_S = 3 * SUBSCRIPTION_PING_S


class RedisStore:
    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        # (imported here: only a gateway configured for Redis loads the client)
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        self._errors = (OSError, TimeoutError, RedisError)

        self.url = url
        #: the server as messages name it: no user, password or query (redis-py takes a password
        #: as ?password= too)
        self.where = server_of(url)
        self.timeout_s = timeout_s
        self._client: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # a connection the server or a proxy closed while idle is found before it is used
            health_check_interval=30,
            # (and one gone half-open is found by the kernel, not only by a command's timeout)
            socket_keepalive=True,
            # one attempt: the caller's next round is the retry
            retry_on_timeout=False,
        )

    def __repr__(self) -> str:
        return f"RedisStore({self.where!r})"

    async def _call(self, what: Awaitable[T], bounded: bool = False) -> T:
        """``what``, within ``timeout_s`` (``bounded``: it has a shorter bound of its own)."""
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            if bounded:
                return await what
            # (a deadline on this task, not wait_for's task per command: a third of its cost)
            async with asyncio.timeout(self.timeout_s):
                return await what
        except asyncio.CancelledError as exc:
            # In a task whose cancellation was consumed earlier (a stop after a cancelled start),
            # the timeouts of early Python 3.11 releases end in CancelledError rather than
            # TimeoutError (3.11.7's compare with the count at entry): a cancellation nobody asked
            # for during this call is the store's delay.
            if task is None or task.cancelling() > cancelling:
                raise
            raise StoreError(f"redis at {self.where}: no answer within {self.timeout_s:g} s") from exc
        except self._errors as exc:  # (connection, timeout, protocol, auth, READONLY replica)
            # (a cancellation asked during this call, not one a task consumed earlier: a stop
            # that runs in a task whose start was cancelled still meets store errors as such)
            if task is not None and task.cancelling() > cancelling:
                # the client turned the caller's cancellation into an error of its own (a read cut
                # short): a stop must not read as a store outage, and the caller's loop must end
                raise asyncio.CancelledError from exc
            why = str(exc) or type(exc).__name__
            raise StoreError(f"redis at {self.where}: {why}") from exc

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        milliseconds = max(1, round(check_ttl(ttl_s) * 1000))
        await self._call(self._client.set(key, value, px=milliseconds))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = await self._call(self._client.mget(list(keys)))
        return list(values)

    async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float) -> None:
        if not items:
            return
        milliseconds = max(1, round(check_ttl(ttl_s) * 1000))
        pipe = self._client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, px=milliseconds)
        await self._call(pipe.execute())

    async def scan(self, prefix: str, batch: int = 512) -> AsyncGenerator[list[tuple[str, bytes]], None]:
        # (the prefix as a pattern: its glob characters escaped, so it matches only itself)
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        cursor: Any = 0
        while True:
            cursor, keys = await self._call(self._client.scan(cursor, match=pattern, count=batch))
            if keys:
                names = [k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k) for k in keys]
                values = await self._call(self._client.mget(keys))
                found = [(k, v) for k, v in zip(names, values, strict=True) if v is not None]
                if found:
                    yield found
            if not int(cursor):
                return

    async def delete(self, key: str) -> None:
        await self._call(self._client.delete(key))

    async def join(self, group: str, member: str) -> None:
        await self._call(self._client.sadd(group, member))

    async def members(self, group: str) -> set[str]:
        found = await self._call(self._client.smembers(group))
        return {m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m) for m in found}

    async def leave(self, group: str, members: Collection[str]) -> None:
        if members:
            await self._call(self._client.srem(group, *members))

    async def publish(self, channel: str, message: bytes) -> None:
        await self._call(self._client.publish(channel, message))

    async def subscribe(self, channel: str) -> AsyncGenerator[bytes, None]:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        loop = asyncio.get_running_loop()
        try:
            await self._call(pubsub.subscribe(channel))
            heard_at = next_ping = loop.time()
            while True:
                # (a bounded wait, not listen(): a read past socket_timeout is an error there,
                # and a quiet channel is not one)
                # (bounded by its own timeout: no deadline of ours around each read, a timer fewer)
                message = await self._call(
                    pubsub.get_message(ignore_subscribe_messages=True, timeout=self.timeout_s / 2),
                    bounded=True,
                )
                now = loop.time()
                if message is not None:
                    heard_at = now
                    if message.get("type") == "message":
                        data = message["data"]
                        yield data if isinstance(data, bytes) else str(data).encode()
                        continue
                # A connection gone half-open (its server moved, packets dropped) reads as a quiet
                # channel, and redis-py's own health check sends a PING without waiting for its
                # answer: the subscription went silent until the kernel gave up, many minutes
                # later. Our pings' answers, or any message, say it lives.
                if now - heard_at > SUBSCRIPTION_SILENT_S:
                    raise StoreError(
                        f"the subscription to {channel} at {self.where} answered nothing for "
                        f"{SUBSCRIPTION_SILENT_S:g} s"
                    )
                if now >= next_ping:
                    next_ping = now + SUBSCRIPTION_PING_S
                    await self._call(pubsub.ping(b"slogate"))
        finally:
            with contextlib.suppress(Exception):  # (closing what may already be broken)
                await asyncio.wait_for(pubsub.aclose(), self.timeout_s)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s)
        except Exception:  # (closing what may already be broken: nothing left to tell)
            return
