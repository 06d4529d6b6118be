"""A latency histogram with bounded memory for the Locust load test: percentiles within 1 % of the
exact ones, whatever the run's length, and mergeable across Locust workers as plain JSON.

Samples (milliseconds) fall into logarithmic buckets of ratio :data:`RATIO`: every value from 1 µs
to 10^7 ms lands in one of at most ~2,300 buckets, so a run of any length keeps at most that many
counters per histogram (a list of every sample grew by one float per request, on every worker and
again on the master). A percentile is the bucket's geometric middle, clamped to the exact minimum
and maximum, which the histogram also keeps.

No Locust import here: the tests use it without gevent's monkey-patching.
"""

from __future__ import annotations

import math
from typing import Any

#: neighbouring bucket bounds differ by 2 %, so a bucket's middle is within 1 % of any value in it
RATIO = 1.02
_LOG_RATIO = math.log(RATIO)
#: values at or below this (ms) share the lowest bucket: a 1 µs latency is a rounding error
FLOOR_MS = 0.001


class LatencyHistogram:
    """Counts per logarithmic bucket, plus the count, minimum and maximum."""

    __slots__ = ("buckets", "count", "max", "min")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.min = math.inf
        self.max = -math.inf

    @staticmethod
    def _index(value_ms: float) -> int:
        return math.floor(math.log(max(value_ms, FLOOR_MS)) / _LOG_RATIO)

    def add(self, value_ms: float) -> None:
        if not math.isfinite(value_ms):
            return
        index = self._index(value_ms)
        self.buckets[index] = self.buckets.get(index, 0) + 1
        self.count += 1
        self.min = min(self.min, value_ms)
        self.max = max(self.max, value_ms)

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100), nearest-rank as the exact one; None when empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        seen = 0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                middle = RATIO ** (index + 0.5)
                return min(max(middle, self.min), self.max)
        return self.max

    def merge(self, other: LatencyHistogram) -> None:
        for index, n in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + n
        self.count += other.count
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (Locust sends worker data to the master as messages)."""
        return {
            "buckets": {str(i): n for i, n in self.buckets.items()},
            "count": self.count,
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        out = cls()
        out.buckets = {int(i): int(n) for i, n in data["buckets"].items()}
        out.count = int(data["count"])
        if out.count:
            out.min, out.max = float(data["min"]), float(data["max"])
        return out
