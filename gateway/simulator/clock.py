"""A virtual clock: events run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class EventQueue:
    """Callbacks at virtual times. ``now`` is the time of the event being run.

    A *daemon* event (a periodic scrape, an autoscaler's tick) reschedules itself for as long as
    the run lasts and moves no request on by itself: :meth:`run` ends once only daemon events
    are left, as a run with nothing left to do, rather than running them forever."""

    __slots__ = ("_heap", "_live", "_seq", "events", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...], bool]] = []
        self._seq = 0
        #: events pending that are not daemons
        self._live = 0
        self.now = 0.0
        #: events run so far (the simulator's unit of work)
        self.events = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any, daemon: bool = False) -> None:
        """Run ``fn(*args)`` at ``when`` (never before the current time)."""
        self._seq += 1
        self._live += not daemon
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args, daemon))

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at the current time, after the events already due now."""
        self.at(self.now, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until no event but daemons is left, the next is after ``until``,
        or ``stop()``."""
        heap = self._heap
        pop = heapq.heappop
        while self._live and heap[0][0] <= until:
            when, _, fn, args, daemon = pop(heap)
            self._live -= not daemon
            self.now = when
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return
