"""The Responses API store (vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``), bounded.

vLLM keeps every stored response, the messages its prompt was rendered from and a background
stream's events in dicts it never empties. The sim keeps them in one LRU of ``capacity`` entries
(a retrieve or a continuation refreshes one; a background response is stored when it starts,
another when it ends), so a long run cannot grow without bound. ``capacity`` 0 is the store off,
vLLM's default: nothing is kept, ``store: true`` is ignored and every look-up misses.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.responses_messages import Message

#: what ``--responses-store-size`` defaults to
DEFAULT_CAPACITY = 4096


@dataclass(slots=True, eq=False)
class StoredResponse:
    """One response: ``body`` is what a retrieve answers (a cancel changes its status)."""

    id: str
    body: dict[str, Any]
    messages: list[Message]
    #: a background response's generation (a cancel stops it)
    task: asyncio.Task[None] | None = None
    #: a background stream's events so far, each one SSE event, for replay by sequence number
    events: list[bytes] | None = None
    #: set when ``events`` grows or the generation ends
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def finish(self, entry: StoredResponse, body: dict[str, Any]) -> None:
        """Store ``entry``'s final response, unless a cancel came first (the response stored
        under its id was cancelled: vLLM keeps that one)."""
        current = self._entries.get(entry.id)
        if current is not None and current.body.get("status") == "cancelled":
            return
        entry.body = body
        self.put(entry)
