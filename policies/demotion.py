"""Which queued requests to serve last under overload: Moore-Hodgson per SLO band.

Under sustained overload some requests will miss their TTFT whatever the dispatcher does; which
ones decides the attainment. Serving each class in deadline order then makes every request wait
until its deadline is near, so the queue goes late as a whole; serving the shortest first (WSPT)
meets more of them but starves a class's long requests even when there is room for all of them.
Moore and Hodgson's rule (minimise the number of late jobs on one machine) does both: walk the
requests in deadline order, and whenever the one just added would finish late, give up the
longest request walked so far. Nothing is given up while the band keeps up.

Here, per band of requests with the same targets and priority (an SLO class at one level), the
"machine" is the fleet's measured drain rate of that band, in predicted service seconds per second
(:class:`BandRates`): a request's share of it is its predicted engine time divided by that rate.
What is given up is *demoted*, not refused: the queue serves it after every request that can still
be on time (:class:`policies.queue_order.LateLast`), so spare capacity still reaches it.

Who calls it: the dispatch core, at most every few tenths of a second per model while a queue is
non-empty (:meth:`gateway.dispatch.core.DispatchCore`). Pure and clock-free: times are passed in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping

#: (priority, ttft_slo, tpot_slo): requests that share them compete for one band's drain rate
Band = tuple[float, float, float]
#: (band, last feasible start, predicted service seconds, admission seq, request id)
Row = tuple[Band, float, float, int, str]


def longest_to_demote(
    rows: Iterable[Row], now: float, rates: Mapping[Band, float], rate_share: float = 1.0
) -> set[str]:
    """The request ids to serve after every other: per band, Moore-Hodgson over its requests,
    each taking ``share = service / (rate_share * rate)`` of the band's drain and due by its last
    feasible start plus that share, walked in order of due time (``rate_share`` < 1 plans with a
    margin: the measured rate is an average, and a request planned right at its last feasible
    start misses on any delay).

    A row whose last feasible start is before ``now`` is late already and left out (the queue
    moves it behind the rest by itself). A band without a positive rate demotes nothing.
    """
    bands: dict[Band, list[tuple[float, float, int, str]]] = {}
    for band, last_start, service_s, seq, request_id in rows:
        if last_start >= now:
            bands.setdefault(band, []).append((last_start, service_s, seq, request_id))
    demoted: set[str] = set()
    for band, members in bands.items():
        rate = rate_share * rates.get(band, 0.0)
        if not rate > 0.0:
            continue
        jobs = sorted(
            (last_start + service_s / rate, service_s / rate, seq, rid)
            for last_start, service_s, seq, rid in members
        )
        finish = now
        kept: list[tuple[float, int, str]] = []  # max-heap on share: (-share, seq, id)
        for due, share, seq, request_id in jobs:
            heapq.heappush(kept, (-share, seq, request_id))
            finish += share
            if finish > due:
                negative_share, _, longest = heapq.heappop(kept)
                finish += negative_share
                demoted.add(longest)
    return demoted


class BandRates:
    """Each band's measured drain rate: predicted service seconds dispatched per second, an
    exponential average over the intervals in which the band had requests waiting (an idle
    band's low dispatch says nothing of what the fleet could drain).

    :meth:`dispatched` adds a request's predicted service as it leaves the queue;
    :meth:`close` ends an interval at ``now`` with the bands that are waiting from then on.
    """

    def __init__(self, time_constant_s: float = 5.0) -> None:
        if not (time_constant_s > 0 and math.isfinite(time_constant_s)):
            raise ValueError(f"time_constant_s must be a finite number > 0, got {time_constant_s}")
        self.time_constant_s = time_constant_s
        self.rates: dict[Band, float] = {}
        self._served: dict[Band, float] = {}
        self._waiting: frozenset[Band] = frozenset()
        self._since = -math.inf

    def dispatched(self, band: Band, service_s: float) -> None:
        if band in self._waiting:
            self._served[band] = self._served.get(band, 0.0) + service_s

    def close(self, now: float, waiting: Iterable[Band]) -> None:
        span = now - self._since
        if span > 0 and math.isfinite(span):
            weight = 1.0 - math.exp(-span / self.time_constant_s)
            rates = self.rates
            for band in self._waiting:
                sample = self._served.get(band, 0.0) / span
                held = rates.get(band)
                rates[band] = sample if held is None else held + weight * (sample - held)
        self._served = {}
        self._waiting = frozenset(waiting)
        self._since = now
        # a band that waits no more keeps its rate: it drains at about the same pace when it
        # queues again, and the first interval of a new backlog is not a fair sample
