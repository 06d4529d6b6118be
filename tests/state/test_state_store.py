"""One contract for every state store: the in-memory default and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import pytest

from gateway.state.redis_store import RedisStore
from gateway.state.store import MemoryStore, StateStore, StoreError, listen
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    made: StateStore
    if request.param == "memory":
        made = MemoryStore()
    else:  # (the server only for these: the memory cases run without one)
        made = RedisStore(request.getfixturevalue("redis_server").url)
        await made._client.flushdb()
    yield made
    await made.close()


async def test_put_then_get_many_in_order_with_none_for_absent(store: StateStore) -> None:
    await store.put("{t}:a", b"one", 10)
    await store.put("{t}:b", b"\x00\xff binary", 10)
    assert await store.get_many(["{t}:b", "{t}:missing", "{t}:a"]) == [b"\x00\xff binary", None, b"one"]
    assert await store.get_many([]) == []


async def test_put_replaces_and_delete_removes(store: StateStore) -> None:
    await store.put("{t}:k", b"old", 10)
    await store.put("{t}:k", b"new", 10)
    assert await store.get_many(["{t}:k"]) == [b"new"]
    await store.delete("{t}:k")
    await store.delete("{t}:k")  # (twice: nothing to delete is not an error)
    assert await store.get_many(["{t}:k"]) == [None]


async def test_a_value_expires_after_its_ttl_unless_put_again(store: StateStore) -> None:
    await store.put("{t}:short", b"x", 0.15)
    await store.put("{t}:kept", b"y", 0.15)
    await asyncio.sleep(0.1)
    await store.put("{t}:kept", b"y", 0.15)
    await asyncio.sleep(0.1)
    assert await store.get_many(["{t}:short", "{t}:kept"]) == [None, b"y"]


async def test_groups_join_list_and_leave(store: StateStore) -> None:
    assert await store.members("{t}:g") == set()
    await store.join("{t}:g", "a")
    await store.join("{t}:g", "b")
    await store.join("{t}:g", "a")
    assert await store.members("{t}:g") == {"a", "b"}
    await store.leave("{t}:g", ["a", "absent"])
    await store.leave("{t}:g", [])
    assert await store.members("{t}:g") == {"b"}


async def test_put_many_then_scan_finds_every_live_key_of_the_prefix_and_only_those(
    store: StateStore,
) -> None:
    items = [(f"{{t}}:s:{i}", f"v{i}".encode()) for i in range(1200)]
    items.append(("{t}:s:odd*[key]?\\", b"glob characters in the name"))
    await store.put_many(items, 10)
    await store.put_many([], 10)
    await store.put("{t}:other", b"not in the prefix", 10)
    await store.put("{t}:s*", b"a prefix's glob read as a pattern would take it", 10)
    await store.put_many([("{t}:s:gone", b"x")], 0.05)
    await asyncio.sleep(0.1)
    found: dict[str, bytes] = {}
    batches = 0
    async for batch in store.scan("{t}:s:", batch=100):
        batches += 1
        for key, value in batch:
            # (SCAN may return a key twice when the table resizes meanwhile: the same value)
            assert found.setdefault(key, value) == value
    assert found == dict(items) and batches > 1
    assert [b async for b in store.scan("{t}:s*")] == [
        [("{t}:s*", b"a prefix's glob read as a pattern would take it")]
    ]
    assert [b async for b in store.scan("{t}:none:")] == []


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf"), float("nan")])
async def test_a_ttl_must_be_positive_and_finite(store: StateStore, ttl: float) -> None:
    with pytest.raises(ValueError):
        await store.put("{t}:k", b"x", ttl)


async def test_an_unreachable_redis_raises_store_error_within_its_timeout() -> None:
    server = RedisServer()  # (never started: nothing listens on its port)
    store = RedisStore(server.url, timeout_s=0.3)
    started = asyncio.get_running_loop().time()
    with pytest.raises(StoreError) as caught:
        await store.get_many(["{t}:k"])
    assert asyncio.get_running_loop().time() - started < 2.0
    assert str(server.port) in str(caught.value)
    await store.close()


async def test_a_redis_password_never_shows_in_errors_or_repr() -> None:
    server = RedisServer()
    store = RedisStore(f"redis://:hunter2secret@127.0.0.1:{server.port}/0", timeout_s=0.3)
    with pytest.raises(StoreError) as caught:
        await store.put("{t}:k", b"x", 1)
    assert "hunter2secret" not in str(caught.value)
    assert "hunter2secret" not in repr(store)
    await store.close()


async def _next(messages: AsyncIterator[bytes]) -> bytes:
    return await asyncio.wait_for(anext(messages), 2.0)


async def _subscribed(store: StateStore, channel: str) -> AsyncIterator[bytes]:
    """A subscription to ``channel`` once it hears what is published there (a probe, published
    until one comes through: no sleep to guess it by; later probes may follow)."""
    messages = store.subscribe(channel)
    probe = asyncio.ensure_future(_next(messages))
    for _ in range(200):
        await store.publish(channel, b"probe")
        await asyncio.sleep(0.01)
        if probe.done():
            break
    assert await probe == b"probe"
    return messages


async def test_a_subscriber_gets_what_is_published_after_it_subscribed_in_order(store: StateStore) -> None:
    await store.publish("{t}:ch", b"before anyone listens")
    messages = await _subscribed(store, "{t}:ch")
    await store.publish("{t}:ch", b"ready")
    while (message := await _next(messages)) != b"ready":  # (the probes published meanwhile)
        assert message == b"probe"
    await store.publish("{t}:other", b"elsewhere")
    for i in range(3):
        await store.publish("{t}:ch", b"m%d \x00\xff" % i)
    assert [await _next(messages) for _ in range(3)] == [b"m0 \x00\xff", b"m1 \x00\xff", b"m2 \x00\xff"]
    await messages.aclose()  # type: ignore[attr-defined]


async def test_a_subscription_lost_with_its_server_raises_store_error() -> None:
    with RedisServer() as server:
        store = RedisStore(server.url, timeout_s=0.3)
        # (subscribed for sure: a SUBSCRIBE that failed would raise the same)
        messages = await _subscribed(store, "{t}:ch")
        while True:  # (the probes published meanwhile)
            waiting = asyncio.ensure_future(anext(messages))
            await asyncio.sleep(0.05)
            if not waiting.done():
                break
            assert waiting.result() == b"probe"
        server.stop()
        with pytest.raises(StoreError):
            await asyncio.wait_for(waiting, 5.0)
        await store.close()


async def test_a_store_that_does_not_answer_is_a_store_error_even_in_a_task_cancelled_before() -> None:
    """A stop runs in a task whose start was cancelled (its cancellation consumed): there, Python
    3.11's timeouts end in CancelledError. A store that does not answer is still a StoreError;
    a cancellation asked during the call is still a cancellation."""

    async def answers_all_but_set(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # (a server that takes the connection's set-up and then never answers a SET)
        while chunk := await reader.read(65536):
            if b"PING" in chunk.upper():
                writer.write(b"+PONG\r\n")
            elif b"SET" not in chunk.upper().replace(b"SETINFO", b""):
                writer.write(b"+OK\r\n" * chunk.count(b"*"))

    server = await asyncio.start_server(answers_all_but_set, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)

    async def stop_after_a_cancelled_start() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # (consumed: cancelling() stays 1)
            await asyncio.sleep(10)
        try:
            await store.put("{t}:k", b"x", 1)
        except StoreError:
            return "store error"
        return "answered"

    task = asyncio.ensure_future(stop_after_a_cancelled_start())
    await asyncio.sleep(0.01)
    task.cancel()
    assert await asyncio.wait_for(task, 5.0) == "store error"

    asked = asyncio.ensure_future(store.put("{t}:k", b"x", 1))
    await asyncio.sleep(0.05)
    asked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asked
    await store.close()
    server.close()


async def test_listen_keeps_its_subscription_when_one_message_cannot_be_taken(store: StateStore) -> None:
    taken: list[bytes] = []
    subscriptions = 0
    subscribe = store.subscribe

    def counted(channel: str) -> Any:
        nonlocal subscriptions
        subscriptions += 1
        return subscribe(channel)

    store.subscribe = counted  # type: ignore[method-assign]

    def heard(message: bytes) -> None:
        if message == b"bad":
            raise ValueError("a message this listener cannot take")
        taken.append(message)

    stop = False
    listener = asyncio.create_task(listen(store, "{t}:listen", heard, lambda: stop, 5.0, "test"))
    try:
        # (subscribed on the server too once a probe comes back: no sleep to guess it by)
        async with asyncio.timeout(5):
            while not taken:
                await store.publish("{t}:listen", b"probe")
                await asyncio.sleep(0.01)
        taken.clear()
        for message in (b"one", b"bad", b"two"):
            await store.publish("{t}:listen", message)
        async with asyncio.timeout(2):
            while [m for m in taken if m != b"probe"] != [b"one", b"two"]:
                await asyncio.sleep(0.005)
        assert subscriptions == 1
    finally:
        stop = True
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_a_subscription_that_keeps_failing_is_said_once_and_counted_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Redis that refuses SUBSCRIBE (an ACL without pub/sub, a proxy without it) left the
    replicas sharing no route or session, retried forever at debug level: nobody saw it."""
    from gateway import metrics

    class Refusing(MemoryStore):
        refusals = 0

        async def subscribe(self, channel: str) -> AsyncGenerator[bytes, None]:
            self.refusals += 1
            raise StoreError("NOPERM this user has no permissions to access the channel")
            yield b""  # (a generator, as the store's)

    store = Refusing()
    before = metrics.REGISTRY.get_sample_value("slogate_state_store_errors_total") or 0.0
    caplog.set_level(logging.DEBUG, logger="gateway.state.store")
    stop = False
    listener = asyncio.create_task(listen(store, "{t}:ch", lambda m: None, lambda: stop, 0.01, "routes"))
    try:
        while store.refusals < 5:
            await asyncio.sleep(0.01)
    finally:
        stop = True
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    warned = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "subscription lost" in r.getMessage()
    ]
    assert len(warned) == 1 and "NOPERM" in warned[0].getMessage()
    after = metrics.REGISTRY.get_sample_value("slogate_state_store_errors_total") or 0.0
    assert after - before >= 5


async def test_a_subscription_whose_server_went_silent_is_lost_not_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection gone half-open read as a quiet channel: redis-py's health check sends a
    PING without waiting for its answer, so route and session sharing stopped, unseen, until the
    kernel gave up many minutes later. A frozen server (SIGSTOP) holds its connections open and
    answers nothing, as a half-open one does."""
    import os
    import signal
    import time

    from gateway.state import redis_store

    monkeypatch.setattr(redis_store, "SUBSCRIPTION_PING_S", 0.1)
    monkeypatch.setattr(redis_store, "SUBSCRIPTION_SILENT_S", 0.5)
    with RedisServer() as server:
        store = RedisStore(server.url, timeout_s=0.3)
        messages = await _subscribed(store, "{t}:ch")
        # a quiet channel on a live server stays subscribed: the pings are answered
        quiet = asyncio.ensure_future(anext(messages))
        await asyncio.sleep(1.0)
        while quiet.done():  # (the probes published meanwhile)
            assert quiet.result() == b"probe"
            quiet = asyncio.ensure_future(anext(messages))
            await asyncio.sleep(1.0)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreError, match="answered nothing"):
                await asyncio.wait_for(quiet, 5.0)
            assert time.monotonic() - started < 2.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await store.close()


def test_a_local_redis_whose_port_was_taken_meanwhile_starts_on_another() -> None:
    """Its port is chosen free, then released for redis-server to bind: if another server took it
    meanwhile, ours failed to bind while the other answered its PING, and tests talked to (and
    flushed) another process's server."""
    from gateway.state.local_redis import server_pid

    with RedisServer() as first:
        second = RedisServer()
        second.port = first.port  # (taken between the choice and the bind)
        try:
            second.start()
            assert second.port != first.port and second.pid is not None
            assert server_pid(second.port) == second.pid and server_pid(first.port) == first.pid
        finally:
            second.stop()
