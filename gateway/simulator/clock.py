"""A virtual clock: events run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class EventQueue:
    """Callbacks at virtual times. ``now`` is the time of the event being run."""

    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        #: events run so far (the simulator's unit of work)
        self.events = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` (never before the current time)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at the current time, after the events already due now."""
        self.at(self.now, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until none is left, the next is after ``until``, or ``stop()``."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            when, _, fn, args = pop(heap)
            self.now = when
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return
