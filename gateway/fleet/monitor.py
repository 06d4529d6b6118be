"""The fleet monitor: health checks and metric scrapes for every engine on an interval.

One task per engine so a slow engine never delays the others. A failed health check or scrape
counts towards ejection; enough consecutive successes re-admit the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway import metrics
from gateway.fleet.registry import EngineRecord, Fleet

log = logging.getLogger("slogate.fleet")


class FleetMonitor:
    def __init__(
        self,
        fleet: Fleet,
        interval_s: float,
        eject_after_failures: int,
        readmit_after_successes: int,
    ) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.eject_after = eject_after_failures
        self.readmit_after = readmit_after_successes
        self._tasks: list[asyncio.Task[None]] = []
        self.first_round = asyncio.Event()
        self._pending_first = len(fleet.records)
        #: called after every check (the dispatch loop re-syncs with fresh engine state)
        self.on_tick: Callable[[], None] | None = None
        if not self._pending_first:
            self.first_round.set()

    def start(self) -> None:
        for record in self.fleet.records.values():
            self._tasks.append(asyncio.create_task(self._watch(record), name=f"monitor:{record.engine_id}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def check_once(self, record: EngineRecord) -> None:
        """One health check, and a scrape when healthy. Never raises."""
        engine_id = record.engine_id
        ok = await record.adapter.health()
        error = "" if ok else "health check failed"
        if ok:
            try:
                state = await record.adapter.scrape()
                self.fleet.record_state(engine_id, state, time.monotonic())
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                ok, error = False, f"metrics scrape failed: {exc!r}"
        flipped = self.fleet.record_health(engine_id, ok, self.eject_after, self.readmit_after, error)
        if flipped:
            level = logging.INFO if record.healthy else logging.WARNING
            log.log(
                level,
                "engine %s is now %s",
                engine_id,
                "healthy" if record.healthy else "ejected",
                extra={"engine": engine_id, "reason": error},
            )
        metrics.ENGINE_HEALTHY.labels(engine_id).set(1.0 if record.healthy else 0.0)
        if record.state is not None:
            metrics.ENGINE_WAITING.labels(engine_id).set(record.state.num_waiting)
            metrics.ENGINE_RUNNING.labels(engine_id).set(record.state.num_running)
            metrics.ENGINE_KV_USAGE.labels(engine_id).set(record.state.kv_usage)
        metrics.ENGINE_IN_FLIGHT.labels(engine_id).set(record.in_flight)

    async def _watch(self, record: EngineRecord) -> None:
        first = True
        while True:
            started = time.monotonic()
            try:
                await self.check_once(record)
            except Exception:  # a bug here must not silently stop monitoring this engine
                log.exception("monitor tick failed for %s", record.engine_id)
            if first:
                first = False
                self._pending_first -= 1
                if self._pending_first <= 0:
                    self.first_round.set()
            self.fleet.invalidate()  # re-evaluate staleness at least once per interval
            if self.on_tick is not None:
                self.on_tick()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
