"""The dispatch floor: the least a placement costs on ``slogate bench dispatch``'s harness.

A dispatcher that knows nothing: requests wait first come, first served, and each goes to any
engine with a free slot. It reserves and releases through the same :class:`Fleet` (its shadow
state and change listeners) and hands placements to waiting clients through futures, as the real
loop does, so what ``slogate bench dispatch`` measures for it is what the harness and that
bookkeeping cost. What the real dispatchers spend above it is their own decisions' cost (SLO
classes, queue orders, ranking, HyperFlexis's turns), not the event loop's or the harness's.
Not a routing policy: it reads no engine state and serves no SLO.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable

from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from policies.api import RequestView


def _nothing() -> None:
    return None


class FloorCore:
    """First come, first served onto any free slot (``slots`` per engine)."""

    def __init__(self, fleet: Fleet, slots: int) -> None:
        self.fleet = fleet
        self.waiting: collections.deque[tuple[str, RunningEntry]] = collections.deque()
        self.free: collections.deque[str] = collections.deque(e for e in fleet.records for _ in range(slots))
        self.outbox: list[tuple[str, EngineRecord]] = []
        self.wake: Callable[[], None] = _nothing
        fleet.listeners.append(self._on_engine_change)

    def queued(self, model: str | None = None) -> int:
        return len(self.waiting)

    def submit(self, request_id: str, entry: RunningEntry) -> EngineRecord | None:
        if self.free and not self.waiting:
            return self._reserve(request_id, entry)
        self.waiting.append((request_id, entry))
        return None

    def step(self, now: float) -> None:
        while self.waiting and self.free:
            request_id, entry = self.waiting.popleft()
            self.outbox.append((request_id, self._reserve(request_id, entry)))

    def next_wake(self, now: float | None = None) -> float:
        return math.inf  # (no timers: only releases wake it)

    def _reserve(self, request_id: str, entry: RunningEntry) -> EngineRecord:
        engine_id = self.free.popleft()
        self.fleet.reserve(engine_id, request_id, entry)
        return self.fleet.records[engine_id]

    def _on_engine_change(self, engine_id: str, what: str) -> None:
        if what == "release":
            self.free.append(engine_id)
            if self.waiting:
                self.wake()


class FloorLoop:
    """Drives :class:`FloorCore` as :class:`gateway.dispatch.loop.DispatchLoop` drives the real
    core: one task woken by an event, futures for the requests that wait."""

    def __init__(self, fleet: Fleet, slots: int) -> None:
        self.fleet = fleet
        self.core = FloorCore(fleet, slots)
        self._event = asyncio.Event()
        self.core.wake = self._event.set
        self._futures: dict[str, asyncio.Future[EngineRecord]] = {}
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatch-floor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def place(
        self, view: RequestView, ttft_slo: float, tpot_slo: float, slo_class: str, entry: RunningEntry
    ) -> EngineRecord:
        record = self.core.submit(view.request_id, entry)
        if record is not None:
            return record
        future: asyncio.Future[EngineRecord] = asyncio.get_running_loop().create_future()
        self._futures[view.request_id] = future
        try:
            return await future
        finally:
            self._futures.pop(view.request_id, None)

    def release(self, engine_id: str, request_id: str) -> None:
        self.fleet.release(engine_id, request_id)

    async def _run(self) -> None:
        while True:
            await self._event.wait()
            self._event.clear()
            self.core.step(0.0)
            self.steps += 1
            self._deliver()

    def _deliver(self) -> None:
        outbox, self.core.outbox = self.core.outbox, []
        for request_id, record in outbox:
            future = self._futures.get(request_id)
            if future is None or future.done():
                self.release(record.engine_id, request_id)  # its client left meanwhile
            else:
                future.set_result(record)
