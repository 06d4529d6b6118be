"""Which queued requests to serve last under overload: Moore-Hodgson per SLO band.

Under sustained overload some requests will miss their TTFT whatever the dispatcher does; which
ones decides the attainment. Serving each class in arrival order then makes every request wait
until its deadline is near, so the queue goes late as a whole; serving the shortest first (WSPT)
meets more of them but starves a class's long requests even when there is room for all of them.
Moore and Hodgson's rule (minimise the number of late jobs on one machine) does both: walk the
requests in the order they will be served, and whenever the one just added would start late, give
up the longest request walked so far (if that saves it; else the newcomer). Nothing is given up
while the band keeps up.

Here, per band (requests with the same targets at one priority level), the "machine" is the
fleet's measured drain rate of that band, in predicted engine seconds per second
(:class:`BandRates`): a request's share of it is its predicted engine time divided by that rate.
A request's engine time is what it adds to a batching engine
(:func:`policies.queue_order.marginal_service_s`): its prefill, and per output token what one
more sequence adds to a decode step. Charged a whole step per output token instead (a step's
fixed cost, which the batch shares), the rule gave up short prompts with long answers and kept
the long prompts that were the engine's real load.
What is given up is *demoted*, not refused: the queue order serves it after every request of its
level that can still be on time (:class:`policies.queue_order.SloTpot`), so spare capacity still
reaches it.

Who calls it: the dispatch core, at most every few tenths of a second per model while a queue is
non-empty (:meth:`gateway.dispatch.core.DispatchCore.step`). Pure and clock-free: times are passed
in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterable, Mapping
from functools import lru_cache

#: (priority, TTFT target, TPOT target): requests that share them compete for one band's drain
Band = tuple[int, float, float]
#: (band, rank within the band in serving order, last feasible start, predicted engine seconds,
#: request id)
Row = tuple[Band, tuple[float, ...], float, float, str]
#: a row without its band, as :func:`demote_in_bands` takes them grouped by band
Member = tuple[tuple[float, ...], float, float, str]


@lru_cache(maxsize=4096)
def band_of(priority: int, ttft_slo: float, tpot_slo: float) -> Band:
    """The band of a request with these targets: the targets to two significant digits (mapped
    and explicit targets vary a little from request to request, and a band of one never learns
    a drain rate), at its priority level. Cached: the dispatcher asks on every placement."""
    return (priority, float(f"{ttft_slo:.2g}"), float(f"{tpot_slo:.2g}"))


def longest_to_demote(
    rows: Iterable[Row], now: float, rates: Mapping[Band, float], rate_share: float = 1.0
) -> set[str]:
    """The request ids to serve after every other of their level: per band, its requests walked
    in rank order (the order the queue serves them), each taking ``share = service /
    (rate_share * rate)`` of the band's drain. When one would start after its last feasible
    start, the longest walked so far is given up if that lets it start in time, else the
    newcomer itself. In order of due time (last start + share) this is Moore-Hodgson, and keeps
    as many on time as any choice could. ``rate_share`` < 1 plans with a margin: the measured
    rate is an average, and a request planned right at its last feasible start misses on any
    delay.

    A row whose last feasible start is before ``now`` is late already and left out (the queue
    moves it behind the rest by itself). A band without a positive rate demotes nothing.
    """
    bands: dict[Band, list[Member]] = {}
    for band, rank, last_start, service_s, request_id in rows:
        bands.setdefault(band, []).append((rank, last_start, service_s, request_id))
    return demote_in_bands(bands, now, rates, rate_share)


def demote_in_bands(
    bands: Mapping[Band, list[Member]],
    now: float,
    rates: Mapping[Band, float],
    rate_share: float = 1.0,
    queued: Container[str] | None = None,
) -> set[str]:
    """:func:`longest_to_demote` over rows already grouped by band (each band's members as
    ``(rank, last feasible start, service, request id)``, in any order). Members late at ``now``,
    and with ``queued`` those whose id is not in it, are left out."""
    demoted: set[str] = set()
    for band, all_members in bands.items():
        rate = rate_share * rates.get(band, 0.0)
        if not rate > 0.0:
            continue
        if queued is None:
            members = [m for m in all_members if m[1] >= now]
        else:
            members = [m for m in all_members if m[1] >= now and m[3] in queued]
        members.sort()
        start = now  # when the next one kept would start
        # max-heap of the kept on share, the newest first among equals: (-share, -index, id)
        kept: list[tuple[float, int, str]] = []
        for index, (_, last_start, service_s, request_id) in enumerate(members):
            share = service_s / rate
            if start <= last_start:
                heapq.heappush(kept, (-share, -index, request_id))
                start += share
                continue
            if kept and -kept[0][0] > share and start + kept[0][0] <= last_start:
                # giving up the longest kept (longer than this one) lets this one start in time
                longest_share = -kept[0][0]
                _, _, longest = heapq.heapreplace(kept, (-share, -index, request_id))
                demoted.add(longest)
                start += share - longest_share
            else:
                demoted.add(request_id)
    return demoted


class BandRates:
    """Each band's measured drain rate: predicted engine seconds dispatched per second,
    averaged over the intervals in which the band had requests waiting (an idle band's low
    dispatch says nothing of what the fleet could drain): a running mean over the first
    intervals, then an exponential average over ``time_constant_s``.

    :meth:`dispatched` adds a request's predicted engine time as it leaves the queue;
    :meth:`close` ends an interval at ``now`` with the bands that are waiting from then on. A
    band that has not waited for ``FORGET_AFTER`` time constants is forgotten (bands come and go
    with the SLO classes and priority levels that clients ask for).
    """

    FORGET_AFTER = 20.0

    def __init__(self, time_constant_s: float = 5.0) -> None:
        if not (time_constant_s > 0 and math.isfinite(time_constant_s)):
            raise ValueError(f"time_constant_s must be a finite number > 0, got {time_constant_s}")
        self.time_constant_s = time_constant_s
        self.rates: dict[Band, float] = {}
        self._samples: dict[Band, int] = {}
        self._last_waiting: dict[Band, float] = {}
        self._served: dict[Band, float] = {}
        self._waiting: frozenset[Band] = frozenset()
        self._since = -math.inf

    def dispatched(self, band: Band, service_s: float) -> None:
        if band in self._waiting:
            self._served[band] = self._served.get(band, 0.0) + service_s

    def close(self, now: float, waiting: Iterable[Band], max_span: float = math.inf) -> None:
        """End the interval at ``now``; one longer than ``max_span`` counts for nothing (its
        caller stopped planning: an empty queue, so the band did not wait all along)."""
        span = now - self._since
        if 0 < span <= max_span and math.isfinite(span):
            decay = 1.0 - math.exp(-span / self.time_constant_s)
            rates, samples = self.rates, self._samples
            for band in self._waiting:
                sample = self._served.get(band, 0.0) / span
                n = samples.get(band, 0) + 1
                samples[band] = n
                held = rates.get(band, 0.0)
                rates[band] = held + max(decay, 1.0 / n) * (sample - held)
        self._served = {}
        self._waiting = frozenset(waiting)
        self._since = now
        for band in self._waiting:
            self._last_waiting[band] = now
        if len(self._last_waiting) > len(self._waiting):
            horizon = now - self.FORGET_AFTER * self.time_constant_s
            for band in [b for b, t in self._last_waiting.items() if t < horizon]:
                del self._last_waiting[band]
                self.rates.pop(band, None)
                self._samples.pop(band, None)
