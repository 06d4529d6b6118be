"""The fleet registry: every engine the gateway knows, its health and its shadow of in-flight work.

The monitor writes scraped state and health here; the dispatch path writes the shadow counts
(``in_flight``) the moment it sends or finishes a request, so decisions never wait for the next
scrape. Policies only ever see the immutable :class:`FleetSnapshot` built from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.engines import EngineAdapter
from policies.api import EngineSnapshot, EngineState, FleetSnapshot


@dataclass(slots=True)
class RunningEntry:
    """One request this gateway has in flight on an engine (the dispatcher's shadow of it)."""

    prompt_tokens: int
    max_tokens: int
    tpot_slo: float
    dispatched_at: float
    generated: int = 0
    prefilled: bool = False


@dataclass(slots=True)
class EngineRecord:
    """Mutable, gateway-private view of one engine. Only the event loop thread touches it."""

    adapter: EngineAdapter
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    state: EngineState | None = None
    state_at: float = 0.0
    in_flight_at_scrape: int = 0
    in_flight: int = 0
    in_flight_tokens: int = 0
    last_error: str = ""
    running: dict[str, RunningEntry] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        return self.adapter.engine_id

    @property
    def model(self) -> str:
        return self.adapter.config.model

    def in_flight_tokens_since_scrape(self) -> int:
        """KV tokens reserved by requests dispatched after the last scrape (not yet in its usage)."""
        return sum(
            r.prompt_tokens + r.max_tokens for r in self.running.values() if r.dispatched_at > self.state_at
        )


class Fleet:
    """Registry of engines keyed by engine id."""

    def __init__(self, adapters: Iterable[EngineAdapter], stale_after_s: float) -> None:
        self.records: dict[str, EngineRecord] = {a.engine_id: EngineRecord(a) for a in adapters}
        self.stale_after_s = stale_after_s
        #: models configured on any engine; fixed for the life of the registry
        self.served_models: frozenset[str] = frozenset(r.model for r in self.records.values())
        self._snapshot: FleetSnapshot | None = None

    # -- reads -----------------------------------------------------------------------------------

    def models(self) -> set[str]:
        return set(self.served_models)

    def healthy_models(self) -> set[str]:
        return {r.model for r in self.records.values() if r.healthy}

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        """Immutable view for policies; rebuilt only when something changed since the last one.

        Staleness is evaluated at build time; the monitor invalidates the cache on every scrape
        tick, so a snapshot is never more stale than one monitor interval.
        """
        if self._snapshot is not None:
            return self._snapshot
        now = time.monotonic() if now is None else now
        engines = tuple(
            EngineSnapshot(
                engine_id=r.engine_id,
                model=r.model,
                role=r.adapter.role,
                healthy=r.healthy,
                stale=r.state is None or now - r.state_at > self.stale_after_s,
                weight=r.adapter.config.weight,
                in_flight=r.in_flight,
                in_flight_tokens=r.in_flight_tokens,
                in_flight_at_scrape=r.in_flight_at_scrape,
                state=r.state,
                accepts_priority=r.adapter.accepts_priority,
            )
            for r in self.records.values()
        )
        self._snapshot = FleetSnapshot(engines, now)
        return self._snapshot

    def invalidate(self) -> None:
        self._snapshot = None

    # -- shadow state, written by the dispatch path -----------------------------------------------

    def on_dispatch(self, engine_id: str, request_id: str, entry: RunningEntry) -> None:
        record = self.records[engine_id]
        record.in_flight += 1
        record.in_flight_tokens += entry.prompt_tokens + entry.max_tokens
        record.running[request_id] = entry
        self._snapshot = None

    def on_finish(self, engine_id: str, request_id: str) -> RunningEntry | None:
        record = self.records[engine_id]
        entry = record.running.pop(request_id, None)
        if entry is not None:
            record.in_flight -= 1
            record.in_flight_tokens -= entry.prompt_tokens + entry.max_tokens
            self._snapshot = None
        return entry

    # -- health and state, written by the monitor and by data-path failures -----------------------

    def record_state(self, engine_id: str, state: EngineState | None, now: float) -> None:
        record = self.records[engine_id]
        record.state = state
        record.state_at = now
        record.in_flight_at_scrape = record.in_flight
        self._snapshot = None

    def record_health(
        self, engine_id: str, ok: bool, eject_after: int, readmit_after: int, error: str = ""
    ) -> bool:
        """Update consecutive counters; returns True when the healthy flag flipped."""
        record = self.records[engine_id]
        before = record.healthy
        if ok:
            record.consecutive_failures = 0
            record.consecutive_successes += 1
            if not record.healthy and record.consecutive_successes >= readmit_after:
                record.healthy = True
        else:
            record.consecutive_successes = 0
            record.consecutive_failures += 1
            record.last_error = error
            if record.healthy and record.consecutive_failures >= eject_after:
                record.healthy = False
        if record.healthy != before:
            self._snapshot = None
            return True
        return False

    def eject(self, engine_id: str, error: str) -> None:
        """The data path could not connect: take the engine out at once; the monitor re-admits it."""
        record = self.records[engine_id]
        record.healthy = False
        record.consecutive_successes = 0
        record.last_error = error
        self._snapshot = None
