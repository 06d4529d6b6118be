"""Arrival processes: seeded streams of request times at a given mean rate.

Each process yields inter-arrival gaps (:meth:`ArrivalProcess.gaps`); :func:`arrival_times` turns
them into times and stops at a count or a horizon. The first request arrives one gap after the
start, as in the original :func:`~gateway.experiments.workload.poisson_workload`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import cycle, pairwise
from pathlib import Path
from typing import Protocol


class ArrivalProcess(Protocol):
    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        """Endless inter-arrival gaps (seconds) whose mean is ``1 / rate``."""
        ...


@dataclass(frozen=True, slots=True)
class Poisson:
    """Exponential gaps: coefficient of variation 1, no memory."""

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        _check_rate(rate)
        while True:
            yield rng.expovariate(rate)


@dataclass(frozen=True, slots=True)
class Gamma:
    """Gamma gaps with coefficient of variation ``cv`` (std / mean of the gap).

    Shape ``k = 1 / cv²`` and scale ``1 / (rate · k)`` keep the mean gap at ``1 / rate`` whatever
    the cv; cv > 1 gives bursts (many short gaps, a few very long ones), cv = 1 is Poisson and
    cv < 1 is more regular than Poisson.
    """

    cv: float

    def __post_init__(self) -> None:
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"gamma arrivals: cv must be a positive number, got {self.cv!r}")

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        _check_rate(rate)
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (rate * shape)
        while True:
            yield rng.gammavariate(shape, scale)


@dataclass(frozen=True, slots=True)
class Trace:
    """The gaps between a trace's timestamps, replayed in order and repeated once used up.

    With ``rescale`` every gap is multiplied by one factor so the mean rate becomes the requested
    one (the trace's shape, bursts and lulls, is kept); without it ``rate`` is ignored and the
    trace's own rate is used. The rng is not consulted: a trace is the same for every seed, so
    seeds change only what rides on it (tasks, lengths).
    """

    intervals: tuple[float, ...]
    rescale: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        if not self.intervals:
            raise ValueError(f"trace {self.source}: needs at least two timestamps")
        if sum(self.intervals) <= 0:
            raise ValueError(f"trace {self.source}: all timestamps are equal (zero duration)")

    @classmethod
    def from_times(cls, times: list[float], rescale: bool = True, source: str = "") -> Trace:
        ordered = sorted(times)
        return cls(tuple(b - a for a, b in pairwise(ordered)), rescale, source)

    @classmethod
    def from_file(cls, path: Path, rescale: bool = True) -> Trace:
        return cls.from_times(read_trace(path), rescale, str(path))

    @property
    def rate(self) -> float:
        """The trace's own mean arrival rate (requests per second)."""
        return len(self.intervals) / sum(self.intervals)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        factor = 1.0
        if self.rescale:
            _check_rate(rate)
            factor = self.rate / rate
        for gap in cycle(self.intervals):
            yield gap * factor


def read_trace(path: Path) -> list[float]:
    """Timestamps in seconds, one per line: the first comma- or space-separated field of each line;
    blank lines and ``#`` comments are skipped, a header line naming the column is allowed."""
    times: list[float] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"trace {path}: cannot read: {exc}") from exc
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        field = text.replace(",", " ").split()[0]
        try:
            value = float(field)
        except ValueError:
            if not times:  # a CSV header such as "timestamp_s,..."
                continue
            raise ValueError(f"trace {path}:{number}: not a timestamp: {field!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"trace {path}:{number}: not a finite timestamp: {field!r}")
        times.append(value)
    if len(times) < 2:
        raise ValueError(f"trace {path}: needs at least two timestamps, found {len(times)}")
    return times


def arrival_times(
    process: ArrivalProcess,
    rng: random.Random,
    rate: float,
    *,
    count: int | None = None,
    until: float | None = None,
    start: float = 0.0,
) -> list[float]:
    """Times of up to ``count`` arrivals that fall before ``until`` (either may be None, not both)."""
    if count is None and until is None:
        raise ValueError("arrival_times: give count, until or both")
    times: list[float] = []
    if count is not None and count <= 0:
        return times
    t = start
    for gap in process.gaps(rng, rate):
        t += gap
        if until is not None and t >= until:
            break
        times.append(t)
        if count is not None and len(times) >= count:
            break
    return times


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a positive number, got {rate!r}")
