"""The precise feed: KV events decoded in both encodings, sequence gaps, replay, restarts,
reconnection, and a real simulated engine process keeping the index in step."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.kv_events import (
    END_SEQ,
    Cleared,
    EventDecodeError,
    KVEventFeed,
    KVEventSource,
    KVEventSubscriber,
    Removed,
    Stored,
    decode_batch,
)
from gateway.fleet.prefix_index import PrefixIndex
from gateway.sim.kv_cache import prefix_hashes
from gateway.tokenizer import apply_chat_template, encode
from tests.support.sim_process import async_sim_engine

MODEL = "m"
BS = 16
ROOT = root_key(MODEL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


# -- the two encodings ----------------------------------------------------------------------------


def stored_map(
    tokens: list[int], parent: int | None = None, hashes: list[int] | None = None, **extra: Any
) -> dict[str, Any]:
    """A BlockStored as the simulated engine builds it (its hashes by default: a chain rooted
    at these tokens)."""
    return {
        "type": "BlockStored",
        "block_hashes": prefix_hashes(tokens, BS) if hashes is None else hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def as_array(event: dict[str, Any]) -> list[Any]:
    """The older msgspec array_like encoding: the tag, then the fields in declaration order,
    trailing defaults left out."""
    if event["type"] == "BlockStored":
        names = [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ]
        names += [n for n in ("extra_keys", "group_idx") if n in event]
    elif event["type"] == "BlockRemoved":
        names = ["block_hashes", "medium"]
    else:
        names = []
    return [event["type"], *(event[n] for n in names)]


def test_decode_map_and_array_encodings_alike() -> None:
    tokens = _prompt(300, 3)
    events = [
        stored_map(tokens),
        {"type": "BlockRemoved", "block_hashes": prefix_hashes(tokens, BS)[2:], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    expected = [
        Stored(prefix_hashes(tokens, BS), None, tokens, BS, None, None),
        Removed(prefix_hashes(tokens, BS)[2:]),
        Cleared(),
    ]
    as_map = msgpack.packb([1.0, events, 0])
    legacy = msgpack.packb([1.0, [as_array(e) for e in events]])
    batch_map = msgpack.packb({"ts": 1.0, "events": events, "data_parallel_rank": 0})
    assert decode_batch(as_map) == decode_batch(legacy) == decode_batch(batch_map) == expected


def test_decode_hashes_as_bytes_and_ignored_events() -> None:
    digest = bytes(range(32))
    tokens = _prompt(300, 1)
    events = [
        {**stored_map(tokens), "block_hashes": [digest]},
        {**stored_map(tokens), "medium": "CPU"},  # an offloaded copy: not in the GPU cache
        {**stored_map(tokens), "group_idx": 1},  # another KV-cache group (sliding window)
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "DISK"},
    ]
    decoded = decode_batch(msgpack.packb([0.0, events, 0]))
    assert decoded == [Stored([int.from_bytes(digest[-8:], "big")], None, tokens, BS, None, None)]


def test_decode_lora_salt_and_multimodal_extra_keys() -> None:
    tokens = _prompt(300, 3)
    lora_salted = stored_map(tokens, lora_name="ad", extra_keys=[["ad", "salt-1"], ["ad"], ["ad"]])
    (event,) = decode_batch(msgpack.packb([0.0, [lora_salted]]))
    assert isinstance(event, Stored) and event.lora_name == "ad" and event.cache_salt == "salt-1"
    # an image in block 1: blocks from there on are not text the gateway can hash
    with_image = stored_map(tokens, extra_keys=[None, [["mm-hash", 3]], [["mm-hash", -13]]])
    (event,) = decode_batch(msgpack.packb([0.0, [with_image]]))
    assert isinstance(event, Stored) and len(event.engine_hashes) == 1 and event.token_ids == tokens[:BS]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb("nope"),
        msgpack.packb([0.0, [{"type": "BlockStored"}]]),
    ],
)
def test_undecodable_batches(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


# -- a vLLM-like publisher: PUB + replay ROUTER over a bounded buffer ------------------------------


class FakeEngine:
    """Publishes as vLLM's ZmqEventPublisher does; ``old_replay`` answers replays in the older
    framing (no topic frame); ``lose`` drops batches on the way (they stay in the buffer)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        array: bool = False,
        buffer: int = 10_000,
        replay: bool = True,
        old_replay: bool = False,
    ) -> None:
        self.ctx = ctx
        self.port = _free_port()
        self.replay_port = _free_port() if replay else None
        self.array = array
        self.old_replay = old_replay
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_size = buffer
        self.seq = 0
        self.topic = b"kv@e0@m"
        self.replays: list[int] = []
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.open()

    def open(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        if self.replay_port is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def restart(self) -> None:
        """A new publisher on the same port, numbering from 0 (ZMQ frees a port asynchronously)."""
        await self.close()
        self.seq, self.buffer = 0, []
        for _ in range(100):
            try:
                self.open()
                return
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        self.open()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)

    def source(self, engine_id: str = "e0") -> KVEventSource:
        return KVEventSource(
            engine_id,
            f"tcp://127.0.0.1:{self.port}",
            topic="kv@",
            replay_endpoint=None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}",
        )

    def publish(self, events: list[dict[str, Any]], lose: bool = False) -> int:
        encoded = [as_array(e) for e in events] if self.array else events
        payload = msgpack.packb([time.time(), encoded, 0], use_bin_type=True)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer = [*self.buffer, (seq, payload)][-self.buffer_size :]
        if not lose:
            assert self.pub is not None
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        return seq

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq, payload in self.buffer:
                if seq >= first:
                    head = [client, b""] if self.old_replay else [client, b"", self.topic]
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [client, b"", END_SEQ, b""] if self.old_replay else [client, b"", b"", END_SEQ, b""]
            await self.router.send_multipart(end)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def subscribed(
    engine: FakeEngine, index: PrefixIndex, **options: Any
) -> AsyncIterator[KVEventSubscriber]:
    sub = KVEventSubscriber(engine.source(), index, engine.ctx, **options)
    sub.start()
    await sub.connected.wait()
    await asyncio.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
    try:
        yield sub
    finally:
        await sub.stop()


def _index() -> PrefixIndex:
    index = PrefixIndex(1 << 24, 60.0)
    index.add_engine("e0", MODEL, BS)
    return index


def _hits(index: PrefixIndex, tokens: list[int]) -> int:
    return index.match(PromptBlocks(tokens, ROOT), ["e0"])["e0"]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.mark.parametrize("array", [False, True], ids=["map", "array"])
async def test_events_keep_the_index_in_step(ctx: zmq.asyncio.Context, array: bool) -> None:
    engine = FakeEngine(ctx, array=array)
    index = _index()
    a, b = _prompt(300, 4), _prompt(5000, 2)
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(a[: 2 * BS])])
            engine.publish([stored_map(a[2 * BS :], prefix_hashes(a, BS)[1], prefix_hashes(a, BS)[2:])])
            await until(lambda: _hits(index, a) == 4)
            # the continuation was keyed from the engine's hash of its parent
            engine.publish(
                [
                    stored_map(b),
                    {"type": "BlockRemoved", "block_hashes": prefix_hashes(a, BS)[3:], "medium": "GPU"},
                ]
            )
            await until(lambda: _hits(index, b) == 2)
            assert _hits(index, a) == 3
            engine.publish([{"type": "AllBlocksCleared"}])
            await until(lambda: _hits(index, b) == 0)
            assert sub.stats.resyncs == 0 and sub.last_seq == 3
    finally:
        await engine.close()


@pytest.mark.parametrize("old_replay", [False, True], ids=["replay-with-topic", "replay-without-topic"])
async def test_a_gap_is_filled_by_replay(ctx: zmq.asyncio.Context, old_replay: bool) -> None:
    engine = FakeEngine(ctx, old_replay=old_replay)
    index = _index()
    a, b, c = _prompt(300, 2), _prompt(5000, 2), _prompt(9000, 2)
    try:
        # (a replay that times out is a resync, the one way c could land without b: it did once,
        # with the 2 s default, while the other test worker started vLLM servers)
        async with subscribed(engine, index, replay_timeout_s=30.0) as sub:
            engine.publish([stored_map(a)])
            await until(lambda: _hits(index, a) == 2)
            engine.publish([stored_map(b)], lose=True)  # lost on the way, still in the buffer
            engine.publish([stored_map(c)])
            await until(lambda: _hits(index, c) == 2, timeout=30.0)
            assert _hits(index, b) == 2 and _hits(index, a) == 2
            assert engine.replays == [1] and sub.stats.replayed == 1 and sub.stats.resyncs == 0
    finally:
        await engine.close()


@pytest.mark.parametrize("replay", [True, False], ids=["buffer-too-short", "no-replay-socket"])
async def test_an_unfillable_gap_resyncs(ctx: zmq.asyncio.Context, replay: bool) -> None:
    engine = FakeEngine(ctx, buffer=1, replay=replay)
    index = _index()
    a, lost, c = _prompt(300, 2), _prompt(5000, 2), _prompt(9000, 2)
    guessed = PromptBlocks(_prompt(20000, 2), ROOT)
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(a)])
            await until(lambda: _hits(index, a) == 2)
            index.record_dispatch("e0", guessed, time.monotonic())
            engine.publish([stored_map(lost)], lose=True)
            engine.publish([stored_map(lost[:BS])], lose=True)  # pushes the lost one out of the buffer
            engine.publish([stored_map(c)])
            await until(lambda: _hits(index, c) == 2)
            # what the events said before the gap is dropped (it may have been undone in it);
            # the gateway's own dispatch guesses stay
            assert _hits(index, a) == 0 and _hits(index, lost) == 0
            assert index.match(guessed, ["e0"]) == {"e0": 2}
            assert sub.stats.resyncs == 1 and sub.stats.replayed == 0
    finally:
        await engine.close()


async def test_first_batch_replays_what_the_engine_already_holds(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx)
    early = _prompt(300, 3)
    engine.publish([stored_map(early)])  # before the gateway subscribed
    engine.publish([{"type": "BlockRemoved", "block_hashes": prefix_hashes(early, BS)[2:], "medium": "GPU"}])
    index = _index()
    try:
        async with subscribed(engine, index) as sub:
            later = _prompt(5000, 1)
            engine.publish([stored_map(later)])
            await until(lambda: _hits(index, later) == 1)
            assert _hits(index, early) == 2 and engine.replays == [0] and sub.last_seq == 2
    finally:
        await engine.close()


async def test_a_restarted_engine_empties_its_entries(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    a, b = _prompt(300, 2), _prompt(5000, 2)
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(a)])
            engine.publish([stored_map(b[:BS])])
            await until(lambda: sub.last_seq == 1)
            # the engine restarts: a new publisher on the same port, numbering from 0 again
            await engine.restart()
            await asyncio.sleep(1.0)  # ZMQ reconnects the subscriber by itself
            engine.publish([stored_map(b)])
            await until(lambda: _hits(index, b) == 2)
            assert _hits(index, a) == 0 and sub.stats.restarts == 1
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("refused", "old_goes_on"),
    [(True, False), (True, True), (False, False)],
    ids=["refused", "refused-then-the-old-process-published", "partition"],
)
async def test_a_restart_numbered_past_the_old_process_is_known_by_a_refused_connection(
    ctx: zmq.asyncio.Context, refused: bool, old_goes_on: bool
) -> None:
    """The new process published more batches than the old one had before the subscriber saw
    one: its number is above the last one seen, and the gap was filled from the new process's
    buffer on top of the old process's entries (credit for blocks it no longer holds). Once the
    engine refused a connection that no gap has explained (nothing listened: its process
    ended; the old one may still publish a batch in order after its listener closed), such a
    gap is a restart; otherwise (a partition, a timeout) it stays a gap to fill."""
    engine = FakeEngine(ctx)
    index = _index()
    old, new = _prompt(300, 2), _prompt(5000, 2)
    refused_at = [0.0]
    try:
        async with subscribed(engine, index, refused_at=lambda: refused_at[0]) as sub:
            engine.publish([stored_map(old)])
            await until(lambda: _hits(index, old) == 2)
            if old_goes_on:
                refused_at[0] = time.monotonic()
                engine.publish([stored_map(old[:BS])])  # (in order, after the refusal)
                await until(lambda: sub.last_seq == 1)
            await engine.restart()
            await asyncio.sleep(1.0)  # ZMQ reconnects the subscriber by itself
            for _ in range(3):  # published while the subscriber was away
                engine.publish([stored_map(new[:BS])], lose=True)
            if refused and not old_goes_on:
                refused_at[0] = time.monotonic()
            engine.publish([stored_map(new)])
            await until(lambda: _hits(index, new) == 2)
            assert _hits(index, old) == (0 if refused else 2)
            assert sub.stats.restarts == (1 if refused else 0)
    finally:
        await engine.close()


async def test_a_sequence_frame_of_the_wrong_length_is_a_decode_error_not_a_restart(
    ctx: zmq.asyncio.Context,
) -> None:
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    a = _prompt(300, 2)
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(a)])
            engine.publish([stored_map(a[:BS])])
            await until(lambda: sub.last_seq == 1)
            assert engine.pub is not None
            payload = msgpack.packb([time.time(), [stored_map(_prompt(900, 1))], 0], use_bin_type=True)
            engine.pub.send_multipart([engine.topic, b"\x00", payload])  # (one byte: "seq 0")
            await until(lambda: sub.stats.decode_errors == 1)
            assert sub.stats.restarts == 0 and _hits(index, a) == 2 and sub.last_seq == 1
    finally:
        await engine.close()


async def test_undecodable_batch_resyncs_and_a_socket_error_reconnects(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    a, b = _prompt(300, 2), _prompt(5000, 2)
    try:
        async with subscribed(engine, index, backoff_s=(0.01, 0.05)) as sub:
            engine.publish([stored_map(a)])
            await until(lambda: _hits(index, a) == 2)
            assert engine.pub is not None
            engine.pub.send_multipart([engine.topic, (1).to_bytes(8, "big"), b"\xc1"])
            engine.seq = 2
            await until(lambda: sub.stats.decode_errors == 1)
            assert _hits(index, a) == 0 and sub.stats.resyncs == 1
            # a broken socket: the subscriber closes it and connects again after its backoff
            assert sub._sub is not None
            sub._sub.close(linger=0)
            await until(lambda: sub.stats.reconnects == 1 and sub.connected.is_set())
            await asyncio.sleep(0.3)
            engine.publish([stored_map(b)])
            await until(lambda: _hits(index, b) == 2)
    finally:
        await engine.close()


async def test_feed_stops_cleanly(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx)
    index = _index()
    feed = KVEventFeed(index, [engine.source()])
    feed.start()
    deadline = time.monotonic() + 5.0
    while any(s._sub is None for s in feed.subscribers.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # (until each subscriber has its socket: else nothing is checked)
    tasks = [s._task for s in feed.subscribers.values()]
    sockets = [s._sub for s in feed.subscribers.values()]
    assert tasks and all(t is not None and not t.done() for t in tasks)
    assert sockets and all(sock is not None and not sock.closed for sock in sockets)
    await asyncio.wait_for(feed.stop(), 2.0)
    # (stop() sets the attributes to None whatever happened: the task and socket themselves)
    assert all(t is not None and t.cancelled() for t in tasks)
    assert all(sock is not None and sock.closed for sock in sockets)
    await engine.close()


# -- a real simulated engine ------------------------------------------------------------------------


async def test_a_sim_engine_s_events_keep_the_index_in_step() -> None:
    """The simulated engine as a process: a chat completion's prompt, rendered with the chat
    template the engine applies, is found cached once the engine reports it; a prefix-cache
    reset empties it; a prompt the engine had to evict goes."""
    port = _free_port()
    args = ("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "10", "--num-gpu-blocks", "24")
    async with async_sim_engine(*args, "--kv-events-endpoint", f"tcp://*:{port}") as proc:
        index = _index()
        feed = KVEventFeed(index, [KVEventSource("e0", f"tcp://127.0.0.1:{port}")])
        feed.start()
        try:
            await feed.subscribers["e0"].connected.wait()
            await asyncio.sleep(0.5)
            messages = [
                {"role": "system", "content": "you are a helpful assistant " * 12},
                {"role": "user", "content": "what is the capital of france"},
            ]
            tokens = encode(apply_chat_template(messages))
            full = len(tokens) // BS
            assert full >= 4
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "messages": messages, "max_tokens": 2}
                async with s.post(proc.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                await until(lambda: _hits(index, tokens) == full)
                # another prompt that needs most of the 24 blocks: the engine evicts the first
                other = list(range(1000, 1000 + 22 * BS))
                async with s.post(
                    proc.url + "/v1/completions", json={"model": MODEL, "prompt": other, "max_tokens": 1}
                ) as r:
                    assert r.status == 200
                await until(lambda: _hits(index, other) == 22)
                assert _hits(index, tokens) < full
                async with s.post(proc.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
                await until(lambda: _hits(index, other) == 0)
            assert feed.subscribers["e0"].stats.resyncs == 0
        finally:
            await feed.stop()


# -- a broken engine's events, and a long replay ---------------------------------------------------


async def test_a_malformed_event_drops_what_the_events_said_and_the_feed_goes_on(
    ctx: zmq.asyncio.Context,
) -> None:
    """A negative token id or a float block hash raised a plain ValueError from inside the index:
    the batch was left half applied (its removal lost for good, the index claiming a block the
    engine evicted), nothing was counted, and the subscription was torn down and rebuilt."""
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    held = _prompt(300, 2)
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(held)])
            await until(lambda: _hits(index, held) == 2)
            bad = {**stored_map(_prompt(7000, 1)), "token_ids": [-1] * BS}
            engine.publish(
                [bad, {"type": "BlockRemoved", "block_hashes": prefix_hashes(held, BS), "medium": "GPU"}]
            )
            await until(lambda: sub.stats.decode_errors == 1)
            assert sub.stats.resyncs == 1 and _hits(index, held) == 0  # dropped, not half-applied
            engine.publish([{"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"}])
            await until(lambda: sub.stats.decode_errors == 2)
            later = _prompt(9000, 1)
            engine.publish([stored_map(later)])  # the same subscription carries on
            await until(lambda: _hits(index, later) == 1)
            assert sub.last_seq == 3
    finally:
        await engine.close()


async def test_a_long_replay_does_not_hold_the_event_loop(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first batch seen replays what the engine still buffers: thousands of batches applied
    in one go held every stream the gateway relays for as long."""
    index = _index()
    sub = KVEventSubscriber(
        KVEventSource("e0", "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2"), index, ctx
    )
    batches = [
        (seq, msgpack.packb([0.0, [stored_map(_prompt(100_000 + seq * 8 * BS, 8))], None]))
        for seq in range(1_500)
    ]

    async def replay(start: int) -> list[tuple[int, bytes]]:
        return batches[start:]

    monkeypatch.setattr(sub, "replay", replay)
    replaying = False
    turns = 0  # the other tasks' turns while the replay runs: none when it holds the loop
    stop = asyncio.Event()

    async def other_work() -> None:
        nonlocal turns
        while not stop.is_set():
            await asyncio.sleep(0)
            turns += replaying

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    replaying = True
    await sub.on_batch(1_500, msgpack.packb([0.0, [], None]))
    replaying = False
    stop.set()
    await task
    assert sub.last_seq == 1_500 and _hits(index, _prompt(100_000, 8)) == 8
    # one turn per slice of REPLAY_SLICE batches, whatever the machine's speed
    assert turns >= 1_500 // 32 - 2, turns


async def test_a_refused_connection_reaches_the_engine_s_subscriber() -> None:
    """The engine's adapter notes a refused connection (its health check here; the data path's
    too); the feed the gateway builds reads it for that engine, not for the others."""
    import aiohttp

    from gateway.dispatch.build import kv_event_feed
    from gateway.engines import adapter_for
    from gateway.fleet.prefix_routing import PrefixRouting
    from gateway.fleet.registry import Fleet
    from gateway.settings import EngineConfig, Settings

    first = _free_port()  # (nothing listens there; one port each: one server is one engine)
    closed = [first, next(p for p in iter(_free_port, None) if p != first)]
    engines = [
        {"url": f"http://127.0.0.1:{closed[i]}", "kind": "sim", "model": MODEL, "name": f"{MODEL}-{i}"}
        for i in range(2)
    ]
    engines[0]["kv_events_endpoint"] = "tcp://127.0.0.1:9"
    async with aiohttp.ClientSession() as session:
        adapters = [adapter_for(EngineConfig.model_validate(e), session, 1.0) for e in engines]
        fleet = Fleet(adapters, 3.0)
        feed = kv_event_feed(Settings(engines=engines), PrefixRouting(fleet, _index(), None, False))
        assert feed is not None and list(feed.subscribers) == [f"{MODEL}-0"]
        try:
            subscriber = feed.subscribers[f"{MODEL}-0"]
            assert subscriber.refused_at() == 0.0
            before = time.monotonic()
            assert await adapters[0].health() is False
            assert subscriber.refused_at() >= before
        finally:
            feed.context.term()


@pytest.mark.parametrize(("kind", "indexed"), [("sglang", 2), ("vllm", 0)])
def test_sglang_s_page_size_is_read_from_its_events_not_its_scrape(kind: str, indexed: int) -> None:
    """SGLang's scrape says block size 1 (token granularity, for capacity) whatever its page
    size, and its events carry the page size: taken as the engine's reported size, the 1
    refused every event of a paged cache. vLLM's scraped size is its events' own."""
    from gateway.dispatch.offline import fleet_of
    from gateway.fleet.kv_events import apply_events
    from gateway.fleet.prefix_routing import PrefixRouting
    from gateway.settings import EngineConfig
    from policies.api import EngineState

    config = EngineConfig(url="http://127.0.0.1:1", kind=kind, model=MODEL, name="e0")  # type: ignore[arg-type]
    fleet = fleet_of([config], 3.0)
    index = PrefixIndex(1 << 24, 60.0)
    PrefixRouting(fleet, index, None, False)
    fleet.record_state("e0", EngineState(block_size=1, num_gpu_blocks=65536), time.monotonic())
    tokens = _prompt(300, 2)
    events = decode_batch(msgpack.packb([time.time(), [stored_map(tokens)], 0], use_bin_type=True))
    apply_events(index, "e0", events, time.monotonic())  # (page size 16: BS)
    assert _hits(index, tokens) == indexed


async def test_a_backlog_of_live_batches_does_not_hold_the_event_loop(ctx: zmq.asyncio.Context) -> None:
    """A frame already queued is received without yielding: batches published while the
    subscriber was busy (a replay, a busy spell of the gateway) were applied back to back, a
    stall of every stream the gateway relays."""
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    try:
        async with subscribed(engine, index) as sub:
            engine.publish([stored_map(_prompt(300, 1))])
            await until(lambda: sub.last_seq == 0)
            turns = 0
            stop = asyncio.Event()

            async def other_work() -> None:
                nonlocal turns
                while not stop.is_set():
                    await asyncio.sleep(0)
                    turns += 0 < sub.last_seq < 2_000

            task = asyncio.create_task(other_work())
            for i in range(2_000):  # (no await between: all queued before the subscriber reads)
                engine.publish([stored_map(_prompt(10_000 + i * BS, 1))])
            await until(lambda: sub.last_seq == 2_000)
            stop.set()
            await task
            assert _hits(index, _prompt(10_000 + 1_999 * BS, 1)) == 1
            # one turn per slice of REPLAY_SLICE batches, whatever the machine's speed
            assert turns >= 2_000 // 32 - 2, turns
    finally:
        await engine.close()


def test_a_page_size_only_events_said_is_learnt_again_after_a_restart_and_is_bounded() -> None:
    """SGLang's scrape never says its page size: the first event's was kept for good, so an
    engine restarted with another page size had every event refused (counted as mismatches)
    until the gateway restarted; and one event claiming 2**40 did the same at once."""
    tokens = _prompt(300, 4)
    index = PrefixIndex(1 << 24, 60.0)
    index.add_engine("e0", MODEL)  # (no size known: the default until something says)
    assert index.stored("e0", prefix_hashes(tokens, 1)[:4], None, tokens[:4], 1, 0.0) == 4
    assert index.block_size("e0") == 1
    assert index.stored("e0", prefix_hashes(tokens, BS), None, tokens, BS, 0.0) == 0  # (a mismatch)
    index.cleared("e0")  # the engine restarted (its numbering began again) with pages of BS
    assert index.stored("e0", prefix_hashes(tokens, BS), None, tokens, BS, 0.0) == 4
    assert index.block_size("e0") == BS and _hits(index, tokens) == 4
    # a size the scrape said stays whatever is cleared
    scraped = PrefixIndex(1 << 24, 60.0)
    scraped.add_engine("e0", MODEL, BS)
    scraped.cleared("e0")
    assert scraped.stored("e0", prefix_hashes(tokens, 1)[:4], None, tokens[:4], 1, 0.0) == 0
    # after a clear (a cache reset), an event of the size held settles it again: one of another
    # size after it is a mismatch, not a switch that drops every key
    index.cleared("e0")
    assert index.stored("e0", prefix_hashes(tokens, BS), None, tokens, BS, 0.0) == 4
    assert index.stored("e0", prefix_hashes(tokens, 1)[:4], None, tokens[:4], 1, 0.0) == 0
    assert index.block_size("e0") == BS and _hits(index, tokens) == 4
    # no size past any engine's is taken from an event
    odd = PrefixIndex(1 << 24, 60.0)
    odd.add_engine("e0", MODEL)
    assert odd.stored("e0", [1], None, tokens, 2**40, 0.0) == 0 and odd.block_size("e0") == 16


async def test_an_oversized_message_loses_one_batch_not_the_feed(ctx: zmq.asyncio.Context) -> None:
    """A frame over the subscriber's bound is not taken into memory; ZMQ then drops the
    connection and never makes it again, so the subscriber makes a new one: the batches after
    it arrive, and the lost one is a gap like any other (filled from the replay buffer, or a
    resync)."""
    engine = FakeEngine(ctx, replay=False)
    index = _index()
    a, b = _prompt(300, 2), _prompt(5000, 2)
    try:
        async with subscribed(engine, index, backoff_s=(0.01, 0.05), max_message_bytes=4096) as sub:
            engine.publish([stored_map(a)])
            await until(lambda: _hits(index, a) == 2)
            assert engine.pub is not None
            engine.pub.send_multipart([engine.topic, (1).to_bytes(8, "big"), b"\x00" * 10_000])
            engine.seq = 2
            await until(lambda: sub.stats.reconnects == 1 and sub.connected.is_set())
            await asyncio.sleep(0.3)  # (the new subscription reaches the publisher)
            engine.publish([stored_map(b)])
            await until(lambda: _hits(index, b) == 2)
            assert sub.stats.resyncs == 1 and _hits(index, a) == 0 and sub.last_seq == 2
    finally:
        await engine.close()


def test_events_the_index_cannot_use_are_skipped_not_the_whole_batch() -> None:
    """An event kind a newer engine adds raised: the batch was thrown away whole (its valid
    events too) and the engine's precise index with it, batch after batch, for good. An adapter's
    blocks named by id alone were indexed as the base model's, drawing its requests to an engine
    holding none of their KV; a clear of the CPU tier cleared the GPU's blocks."""
    from gateway.fleet.kv_events import apply_events

    index = _index()
    first, second, adapter = _prompt(300, 3), _prompt(600, 3), _prompt(900, 3)
    events = decode_batch(
        msgpack.packb(
            [
                time.time(),
                [
                    stored_map(first),
                    {"type": "BlockUpdated", "block_hashes": [1]},
                    stored_map(adapter, lora_id=7),
                    {"type": "AllBlocksCleared", "medium": "CPU"},
                    stored_map(second),
                ],
                0,
            ],
            use_bin_type=True,
        )
    )
    apply_events(index, "e0", events, time.monotonic())
    assert (_hits(index, first), _hits(index, second), _hits(index, adapter)) == (3, 3, 0)
