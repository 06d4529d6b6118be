"""The smallest (or largest) value seen in a sliding time window, in O(1) amortised per update."""

from __future__ import annotations

import math
from collections import deque


class WindowMin:
    """Minimum of the values added in the last ``window_s`` seconds (``math.inf`` when none).

    A monotonic deque: a new value drops every older one that is not smaller, since those can
    never be the minimum again; expired ones leave from the front.
    """

    __slots__ = ("_items", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        items = self._items
        while items and items[-1][1] >= value:
            items.pop()
        items.append((now, value))
        horizon = now - self.window_s
        while items[0][0] < horizon:  # expire here too: reads may be rare (every worker parked)
            items.popleft()

    def min(self, now: float) -> float:
        items = self._items
        horizon = now - self.window_s
        while items and items[0][0] < horizon:
            items.popleft()
        return items[0][1] if items else math.inf


class WindowMax:
    """Maximum of the values added in the last ``window_s`` seconds (0 when none): a
    :class:`WindowMin` of their negations."""

    __slots__ = ("_min",)

    def __init__(self, window_s: float) -> None:
        self._min = WindowMin(window_s)

    def add(self, value: float, now: float) -> None:
        self._min.add(-value, now)

    def max(self, now: float) -> float:
        low = self._min.min(now)
        return 0.0 if low == math.inf else -low
