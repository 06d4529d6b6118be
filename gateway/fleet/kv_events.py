"""The precise feed of the prefix index: engines' KV-cache events over ZMQ.

vLLM (and SGLang, llm-d's simulator, slogate's own simulated engine) publish every change to
their prefix cache on a ZMQ PUB socket: frames ``(topic, seq as 8 bytes big-endian, payload)``,
the payload a msgpack ``EventBatch`` (``[ts, events, dp_rank]``, or the same as a map) of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, each a map tagged by ``"type"``
(current vLLM) or a positional array led by the tag (older vLLM, llm-d's default). Block hashes
are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) or digests (bytes).

One :class:`KVEventSubscriber` per engine keeps the index in step:

- ``BlockStored`` is re-hashed from its ``token_ids`` with the gateway's chain (the engine's own
  hashes may be salted or random per process), chained from the gateway key of the block its
  ``parent_block_hash`` names; ``BlockRemoved`` and ``AllBlocksCleared`` drop entries. Only the
  GPU tier counts as cached (``medium`` GPU or absent) and only the first KV-cache group: a CPU
  or disk copy still needs a load, and other groups (sliding-window layers) hold other blocks.
  Blocks whose extra keys carry multimodal identifiers or prompt-embedding digests are not
  indexed, nor anything after them: the gateway hashes text tokens only and would mistake one
  image's placeholder tokens for another's.
- Sequence numbers must follow each other. A gap asks the engine's replay socket (vLLM's
  ``replay_endpoint``: a ROUTER that resends buffered batches from a given sequence number) for
  what was missed; if the replay cannot fill the gap, or there is no replay socket, the engine's
  precise entries are dropped (a resync) and the index carries on from the next batch. A number
  going backwards means the engine restarted: its cache is empty, and so is its part of the
  index. The first batch after (re)subscribing asks for the replay of everything the engine
  still buffers, so a gateway started after its engines learns what they already hold.
- Socket errors close the sockets and reconnect after an exponential backoff (ZMQ also
  reconnects its TCP transport on its own, with the same bounds); heartbeats find a dead peer.
  A message over ``MAX_MESSAGE_BYTES`` makes ZMQ drop the connection and never make it again,
  so a lost connection also replaces the socket (the batch is then a gap like any other).

Everything runs on the event loop (``zmq.asyncio``), which owns the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.fleet.block_hash import external_hash
from gateway.fleet.prefix_index import PrefixIndex
from gateway.tasks import cancel_and_wait

log = logging.getLogger("slogate.fleet")

#: the sequence number vLLM's replay socket ends a replay with (-1 as 8 signed bytes)
END_SEQ = b"\xff" * 8
#: replayed batches applied between two yields to the event loop
REPLAY_SLICE = 32
#: the largest message a KV-event socket takes, bytes: a batch is one engine step's events, and
#: a step that stores a 128k-token prompt is about 1 MB of msgpack (its token ids); without a
#: bound, one frame could take all the gateway's memory
MAX_MESSAGE_BYTES = 8 << 20
#: the most a replay may bring, bytes: past it the replay is given up (a resync, as a replay that
#: times out): held whole, the replays of a fleet's engines after a gateway's start could take
#: gigabytes at once (vLLM keeps 10,000 batches of each)
MAX_REPLAY_BYTES = 64 << 20
#: messages a subscriber's socket queues while the gateway is busy (with MAX_MESSAGE_BYTES, the
#: most one engine's stream can hold in memory; a step's batch is a few KB)
RECEIVE_QUEUE = 2_000
_GPU_MEDIA = (None, "GPU")


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch in either encoding."""


@dataclass(frozen=True, slots=True)
class Stored:
    engine_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    engine_hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared

#: positional fields of the array ("array_like") encoding, after the tag
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(raw: Any) -> dict[str, Any]:
    """One event as a map, from either encoding."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(raw[0], ())
        # msgspec's array_like encoding with omit_defaults leaves trailing defaults out
        return {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    raise EventDecodeError(f"an event is a map or a tagged array, not {type(raw).__name__}")


def _salt(extra: Any, lora_name: str | None) -> str | None:
    """The ``cache_salt`` among the first block's extra keys: vLLM lists the LoRA name first,
    then multimodal pairs, then the salt (a string), then prompt-embedding digests (bytes)."""
    if not isinstance(extra, list | tuple):
        return None
    strings = [x for x in extra if isinstance(x, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else None


def _text_only_blocks(extra_keys: Any) -> int | None:
    """How many leading blocks carry no multimodal or prompt-embedding key (None: all of them).
    A tuple or list entry is an ``(identifier, offset)`` pair, bytes an embeddings digest."""
    if not isinstance(extra_keys, list | tuple):
        return None
    for i, extra in enumerate(extra_keys):
        if isinstance(extra, list | tuple) and any(isinstance(x, list | tuple | bytes) for x in extra):
            return i
    return None


def decode_event(raw: Any) -> Event | None:
    """One event, or None for an event the index ignores (another tier or KV-cache group)."""
    ev = _fields(raw)
    kind = ev.get("type")
    if kind == "AllBlocksCleared":
        # (a clear of another tier, the CPU offload's, leaves the GPU's blocks where they are)
        return Cleared() if ev.get("medium") in _GPU_MEDIA else None
    if kind not in ("BlockStored", "BlockRemoved"):
        # (a kind a newer engine adds: skipped, as llm-d does; raised, every batch carrying one
        # was thrown away whole, and the engine's precise index with it, for good)
        return None
    if ev.get("medium") not in _GPU_MEDIA or ev.get("group_idx") not in (None, 0):
        return None
    try:
        hashes = [external_hash(h) for h in ev["block_hashes"]]
        if kind == "BlockRemoved":
            return Removed(hashes)
        parent_raw = ev.get("parent_block_hash")
        token_ids = ev["token_ids"]
        block_size = ev["block_size"]
        if not isinstance(token_ids, list) or not isinstance(block_size, int) or block_size < 1:
            raise EventDecodeError("BlockStored needs token_ids (a list) and block_size (an int >= 1)")
        lora = ev.get("lora_name")
        lora_name = lora if isinstance(lora, str) else None
        if lora_name is None and ev.get("lora_id") not in (None, 0):
            # an adapter's blocks named by id alone (older vLLM, SGLang): rooted as the base
            # model's they drew the base model's requests to an engine holding none of its KV;
            # the gateway keys requests by adapter name, so these cannot be matched: skipped
            return None
        extra_keys = ev.get("extra_keys")
        keep = _text_only_blocks(extra_keys)
        if keep is not None:
            hashes = hashes[:keep]
            token_ids = token_ids[: keep * block_size]
        salt = None
        if parent_raw is None and isinstance(extra_keys, list | tuple) and extra_keys:
            salt = _salt(extra_keys[0], lora_name)
        return Stored(
            hashes,
            None if parent_raw is None else external_hash(parent_raw),
            token_ids,
            block_size,
            lora_name,
            salt,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise EventDecodeError(f"malformed {kind}: {exc!r}") from None


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch, in order, in either encoding of the batch and its events."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        raw_events = batch.get("events")
    elif isinstance(batch, list | tuple) and len(batch) >= 2:
        raw_events = batch[1]
    else:
        raise EventDecodeError("an event batch is [ts, events, dp_rank] or a map with 'events'")
    if not isinstance(raw_events, list):
        raise EventDecodeError("an event batch's events are a list")
    events: list[Event] = []
    for raw in raw_events:
        event = decode_event(raw)
        if event is not None:
            events.append(event)
    return events


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """Where one engine publishes its KV events.

    ``endpoint``: the engine's PUB address as the gateway reaches it (``tcp://engine:5557``).
    ``bind``: the engine connects instead (its own endpoint names a host, not ``*``), so the
    gateway binds ``endpoint``. ``topic``: subscription prefix (``""``: everything).
    ``replay_endpoint``: the engine's replay ROUTER, when it has one.
    """

    engine_id: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    bind: bool = False


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    #: gaps that the replay filled
    replayed: int = 0
    #: gaps (or undecodable batches) after which the engine's precise entries were dropped
    resyncs: int = 0
    #: sequence numbers that went backwards: the engine restarted
    restarts: int = 0
    decode_errors: int = 0
    reconnects: int = 0


@dataclass(slots=True)
class _Backoff:
    low: float
    high: float
    current: float = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.low

    def next(self) -> float:
        # full jitter: subscribers of engines that went down together do not retry in step
        delay = random.uniform(self.low, self.current)
        self.current = min(self.high, self.current * 2)
        return delay

    def reset(self) -> None:
        self.current = self.low


class KVEventSubscriber:
    """Keeps one engine's part of the index in step with the engine's KV events."""

    def __init__(
        self,
        source: KVEventSource,
        index: PrefixIndex,
        context: zmq.asyncio.Context,
        *,
        replay_timeout_s: float = 2.0,
        backoff_s: tuple[float, float] = (0.1, 5.0),
        clock: Callable[[], float] = time.monotonic,
        refused_at: Callable[[], float] = lambda: 0.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.source = source
        self.max_message_bytes = max_message_bytes
        self.index = index
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.stats = SubscriberStats()
        #: the last sequence number applied (None: nothing yet, or the engine restarted)
        self.last_seq: int | None = None
        #: when (``clock``) the engine last refused a connection (0: never known)
        self.refused_at = refused_at
        #: the latest refusal a first batch, a restart or a gap has accounted for
        self._refusal_judged = 0.0
        self._backoff = _Backoff(*backoff_s)
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        #: the SUB socket's monitor, and what closes the SUB socket when its connection is lost
        self._monitor: zmq.asyncio.Socket | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        #: set once the SUB socket is connected (tests wait for it; ZMQ drops what a subscriber
        #: misses before its subscription reaches the publisher)
        self.connected = asyncio.Event()

    @property
    def engine_id(self) -> str:
        return self.source.engine_id

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.engine_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self._close()

    async def _run(self) -> None:
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stop()
                # a socket closed under the subscriber cancels its pending receive
                self._reconnecting("socket closed")
            except Exception as exc:  # a socket or a bug: reconnect rather than stop for good
                self._reconnecting(f"{type(exc).__name__}: {exc}")
            self._close()
            await asyncio.sleep(self._backoff.next())

    def _reconnecting(self, reason: str) -> None:
        self.stats.reconnects += 1
        log.warning(
            "KV events of %s: %s; reconnecting", self.engine_id, reason, extra={"engine": self.engine_id}
        )

    def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._sub is not None and self._monitor is not None and not self._sub.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for sock in (self._sub, self._replay, self._monitor):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = self._monitor = None
        self.connected.clear()

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # ZMQ's own reconnection of the transport, with the same bounds as ours
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._backoff.low * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._backoff.high * 1000))
        # ZMTP heartbeats: a publisher that vanished without closing is noticed within seconds
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return sock

    async def _session(self) -> None:
        sub = self._sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        if self.source.bind:
            # (a connection this side drops is the engine's to make again, and it does)
            sub.bind(self.source.endpoint)
        else:
            monitor = self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._watcher = asyncio.create_task(self._watch(sub, monitor), name=f"kv-watch:{self.engine_id}")
            sub.connect(self.source.endpoint)
        self.connected.set()
        taken = 0
        while True:
            frames = await sub.recv_multipart()
            taken += 1
            if taken % REPLAY_SLICE == 0:
                # a frame already queued is received without yielding: a backlog (batches published
                # during a replay or a busy spell, up to RCVHWM) was applied in one go, a stall of
                # every stream the gateway relays
                await asyncio.sleep(0)
            self._backoff.reset()
            if len(frames) == 3:
                _topic, seq_bytes, payload = frames
            elif len(frames) == 2:  # a publisher without a topic frame
                seq_bytes, payload = frames
            else:
                self.stats.decode_errors += 1
                continue
            if len(seq_bytes) != 8:  # (a short frame read as a small number looked like a restart)
                self.stats.decode_errors += 1
                continue
            await self.on_batch(int.from_bytes(seq_bytes, "big"), payload)

    async def _watch(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Close ``sub`` when its connection is lost: its pending receive ends and the session is
        made again. After an oversized message ZMQ never reconnects, and the feed went silent."""
        try:
            await monitor.recv_multipart()
        except zmq.ZMQError:
            return  # (the monitor closed: the session is ending anyway)
        if not sub.closed:
            sub.close(linger=0)

    # -- sequence numbers, replay, resync --------------------------------------------------------

    async def on_batch(self, seq: int, payload: bytes) -> None:
        """One batch from the live stream, in order of arrival."""
        last = self.last_seq
        refused = self.refused_at()
        unexplained = refused > self._refusal_judged
        if last is None or seq != last + 1:
            self._refusal_judged = refused  # (what a first batch, a restart or a gap settles)
        if last is not None and (seq <= last or (seq > last + 1 and unexplained)):
            # the publisher's numbering started again: the engine restarted with an empty cache.
            # A gap says so too once the engine refused a connection that no gap or restart has
            # explained yet (nothing listened: its process ended; the old one may still have
            # published a few batches in order after its listener closed): a new process may
            # publish more batches than the old one had before the subscriber sees one (ZMQ
            # drops what is sent while it reconnects), and the gap filled from the new process's
            # buffer kept the old process's entries, credit for blocks it no longer holds. (A
            # gap after a partition or a timeout is filled as any other: the cache is as it was.)
            self.stats.restarts += 1
            self.index.cleared(self.engine_id)
            last = self.last_seq = None
        if last is None:
            if seq > 0 and self.source.replay_endpoint is not None:
                # first batch seen: what the engine still buffers tells what it already holds
                await self._apply_run(_contiguous_before(await self.replay(0) or [], seq))
        elif seq > last + 1:
            await self._fill_gap(last + 1, seq)
        self._apply(seq, payload)

    async def _fill_gap(self, start: int, seq: int) -> None:
        missed = await self.replay(start) if self.source.replay_endpoint is not None else None
        run = _contiguous_before(missed or [], seq, start)
        if len(run) == seq - start:
            self.stats.replayed += 1
            await self._apply_run(run)
            return
        self.stats.resyncs += 1
        log.info(
            "KV events of %s: batches %d-%d lost; dropping what its events said",
            self.engine_id,
            start,
            seq - 1,
            extra={"engine": self.engine_id},
        )
        self.index.drop_precise(self.engine_id)

    async def _apply_run(self, run: list[tuple[int, bytes]]) -> None:
        """Apply replayed batches in order, yielding to the event loop between slices: an engine's
        buffer holds thousands of batches (1,000 of 21 events took 0.5 s), and every stream the
        gateway relays would stall for as long."""
        for i, (seq, payload) in enumerate(run):
            if i and i % REPLAY_SLICE == 0:
                await asyncio.sleep(0)
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.stats.batches += 1
        try:
            events = decode_batch(payload)
            apply_events(self.index, self.engine_id, events, self.clock())
        except (EventDecodeError, ValueError, TypeError, OverflowError) as exc:
            # what this batch changed is unknown, so everything the events said may be wrong
            self.stats.decode_errors += 1
            self.stats.resyncs += 1
            log.warning(
                "KV events of %s: batch %d undecodable (%s); dropping what its events said",
                self.engine_id,
                seq,
                exc,
                extra={"engine": self.engine_id},
            )
            self.index.drop_precise(self.engine_id)

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the engine's replay socket for every buffered batch from ``start``; None when it
        does not answer in time (the socket is then replaced: a late answer must not be read as
        the next replay's)."""
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return None
        if self._replay is None:
            # DEALER, not REQ: a request that times out leaves a REQ socket stuck mid-exchange
            self._replay = self._socket(zmq.DEALER)
            self._replay.connect(endpoint)
        sock = self._replay
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        held = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or held > MAX_REPLAY_BYTES or not await sock.poll(remaining * 1000):
                sock.close(linger=0)
                self._replay = None
                return None
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the ROUTER's delimiter
            # current vLLM: (topic, seq, payload); older releases: (seq, payload)
            if len(frames) == 3:
                seq_bytes, payload = frames[1], frames[2]
            elif len(frames) == 2:
                seq_bytes, payload = frames
            else:
                continue
            if seq_bytes == END_SEQ:
                return got
            held += len(payload)
            got.append((int.from_bytes(seq_bytes, "big"), payload))


def _contiguous_before(
    batches: Iterable[tuple[int, bytes]], seq: int, start: int | None = None
) -> list[tuple[int, bytes]]:
    """Replayed batches that lead up to ``seq`` without a hole, in order: from ``start`` on (a
    gap: the caller checks the run reaches ``seq``), or else the run that ends right before
    ``seq`` (a first subscription: what came before a hole in the engine's buffer could have
    been undone in the hole, so it is left out)."""
    by_seq = {s: p for s, p in batches if s < seq}
    run: list[tuple[int, bytes]] = []
    if start is not None:
        s = start
        while s in by_seq:
            run.append((s, by_seq[s]))
            s += 1
        return run
    s = seq - 1
    while s in by_seq:
        run.append((s, by_seq[s]))
        s -= 1
    return run[::-1]


def apply_events(index: PrefixIndex, engine_id: str, events: Sequence[Event], now: float) -> None:
    """Write one batch's events into the index, in order."""
    for event in events:
        if isinstance(event, Stored):
            index.stored(
                engine_id,
                event.engine_hashes,
                event.parent,
                event.token_ids,
                event.block_size,
                now,
                event.lora_name,
                event.cache_salt,
            )
        elif isinstance(event, Removed):
            index.removed(engine_id, event.engine_hashes)
        else:
            index.cleared(engine_id)


class KVEventFeed:
    """Subscribers for every engine that publishes KV events; one ZMQ context, stopped together."""

    def __init__(
        self,
        index: PrefixIndex,
        sources: Iterable[KVEventSource],
        refused_at: Callable[[str], float] | None = None,
        **options: Any,
    ) -> None:
        """``refused_at(engine_id)``: when a connection to the engine was last refused (the
        clock of the subscribers' ``clock`` option, monotonic by default)."""
        self.index = index
        self.context = zmq.asyncio.Context()
        self.subscribers = {
            s.engine_id: KVEventSubscriber(s, index, self.context, **options) for s in sources
        }
        if refused_at is not None:
            for engine_id, subscriber in self.subscribers.items():
                subscriber.refused_at = functools.partial(refused_at, engine_id)

    def start(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.subscribers.values()))
        self.context.term()
