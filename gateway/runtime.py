"""Process-wide care of a long-running gateway: the garbage collector and the event loop's health.

A gateway with thousands of queued requests holds a few hundred thousand tracked objects; with
CPython's default thresholds (700 allocations) full collections then land inside dispatch calls
and relays, and scanning the objects that live as long as the process (modules, settings,
profiles) is wasted work. Before serving, those are frozen out of the collector, and
the young generation is collected less often (each collection costs about the same, so fewer
collections cost less); reference cycles are still freed, only in larger batches.

Whatever holds the loop (a collection, a long dispatch call, a parse) stalls every stream at
once, and no per-request metric shows it: :class:`GcPauses` times each collection and
:class:`LoopLagProbe` measures how late a periodic timer runs, both exported as histograms.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from gateway import metrics

#: allocations between young collections (CPython's default: 700)
YOUNG_THRESHOLD = 20_000
#: how often the lag probe's timer is set (seconds): a stall shorter than this may fall between
#: two timers, one longer always delays one
LAG_INTERVAL_S = 0.25


def tune_gc() -> None:
    """Freeze everything alive now (start-up state) and collect the young generation less often.
    Idempotent; called once the gateway has started, and by benchmarks that measure its loop."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


class GcPauses:
    """Times every garbage collection of the process while installed: the longest and the total
    since :meth:`reset`, and (with ``export``) each one into ``slogate_gc_pause_seconds``."""

    def __init__(self, export: bool = False) -> None:
        self.export = export
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self._started = 0.0
        self._children = [metrics.GC_PAUSE.labels(str(g)) for g in range(3)] if export else []

    def install(self) -> GcPauses:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        while self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def reset(self) -> None:
        self.count, self.total_s, self.longest_s = 0, 0.0, 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # (called by the interpreter around each collection, in whichever thread allocated: plain
        # arithmetic, and the histogram child's own lock)
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.count += 1
        self.total_s += pause
        if pause > self.longest_s:
            self.longest_s = pause
        if self.export:
            generation = info.get("generation", 2)
            self._children[generation if generation in (0, 1, 2) else 2].observe(pause)


_process_pauses: GcPauses | None = None


def export_gc_pauses() -> GcPauses:
    """Export the process's collections as ``slogate_gc_pause_seconds`` (once per process)."""
    global _process_pauses
    if _process_pauses is None:
        _process_pauses = GcPauses(export=True)
    return _process_pauses.install()


class LoopLagProbe:
    """Sets a timer every ``interval_s`` and records how late it ran in
    ``slogate_event_loop_lag_seconds``. A callback, not a task: a wake costs one timer handle."""

    def __init__(self, interval_s: float = LAG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._observe = metrics.EVENT_LOOP_LAG.observe
        #: the latest lag measured (seconds), for tests and the status page
        self.last_s = 0.0

    def start(self) -> None:
        if self._handle is None:
            self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        self._due = time.monotonic() + self.interval_s
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        # (libuv rounds timers to whole milliseconds and may run one up to a millisecond early)
        self.last_s = max(0.0, time.monotonic() - self._due)
        self._observe(self.last_s)
        self._arm()
