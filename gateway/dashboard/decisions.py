"""A bounded ring of recent dispatch decisions, as the serving flow receives them.

Every placement a request gets back from the dispatcher (an engine, or a refusal) passes through
the serving flow, whichever way the dispatcher delivered it (placed at once, or assigned from the
queue later), so the flow feeds the ring and the dispatcher needs no hook. One tuple append per
placement; turning entries into dicts waits until someone reads them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from gateway.serving.call import Call

#: a client may name any model; what the ring keeps of the name is bounded
MAX_MODEL_CHARS = 128

_FIELDS = (
    "at",
    "request_id",
    "client_request_id",
    "model",
    "slo_class",
    "priority",
    "attempt",
    "engine",
    "refused",
    "queue_wait_ms",
    "excluded",
)


class DecisionLog:
    def __init__(self, size: int) -> None:
        self._ring: deque[tuple[Any, ...]] = deque(maxlen=size)
        #: every decision logged since start (the ring keeps the last ``size``)
        self.total = 0

    def add(
        self,
        call: Call,
        attempt: int,
        engine_id: str | None,
        refused: str | None,
        queue_wait_s: float,
        excluded: tuple[str, ...],
    ) -> None:
        """One placement: ``engine_id`` when placed, else ``refused`` (the error code)."""
        self.total += 1
        self._ring.append(
            (
                time.time(),
                call.rid,
                call.client_rid,
                # the client's string for a model not served: bounded, as the ring is kept
                call.request.model[:MAX_MODEL_CHARS],
                call.target.slo_class,
                call.priority,
                attempt,
                engine_id,
                refused,
                round(queue_wait_s * 1000.0, 3),
                excluded,
            )
        )

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The last ``limit`` decisions, newest first."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self._ring):
            if len(out) >= limit:
                break
            item = dict(zip(_FIELDS, entry, strict=True))
            item["excluded"] = list(item["excluded"])
            out.append(item)
        return out

    def __len__(self) -> int:
        return len(self._ring)
