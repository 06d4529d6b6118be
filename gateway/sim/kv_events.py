"""KV-cache events over ZMQ, framed as vLLM 0.33 publishes them.

Frames: ``(topic, seq as 8 bytes big-endian, msgpack([ts, [event, ...], dp_rank]))``; each event
is a map tagged by ``"type"`` (BlockStored / BlockRemoved / AllBlocksCleared). Like vLLM, the PUB
socket binds when the endpoint has ``*`` or ``::`` or is ``ipc://``/``inproc://``, and connects
otherwise (then the subscriber binds).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from gateway.sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    import zmq


def event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU"}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "kv", dp_rank: int = 0) -> None:
        import zmq  # (here: an engine that publishes no KV events starts without it)

        self._noblock = zmq.NOBLOCK
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self._topic = topic.encode()
        self._dp_rank = dp_rank
        self._seq = 0

    def publish(self, events: Sequence[KVEvent]) -> None:
        payload = msgpack.packb(
            [time.time(), [event_map(e) for e in events], self._dp_rank], use_bin_type=True
        )
        self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=self._noblock)
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
