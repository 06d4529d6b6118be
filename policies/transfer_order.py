"""Order of KV transfers waiting for the same link (into the same decode engine): MFS's reverse
multi-level queue, and FIFO with the same interface for comparison.

What it decides: which waiting transfer goes next when the link can take one.

From what: each waiting transfer's KV size (tokens), when it joined the queue, and its deadline
(the moment its KV must have arrived for the request to meet its TTFT: explicit, or ``None``);
the link's speed in KV tokens per second and its background load ``rho``; the time ``now``.

How (MFS §4, Defer-and-Promote):

* **Reverse multi-level queue** (§4.2). ``K`` strict-priority levels, 0 the highest. Unlike MLFQ,
  which demotes as flows age, a transfer starts in the lowest level (deferred) and climbs only
  when its urgency demands it, so transfers with loose deadlines do not take the link before
  those that need it now.
* **Minimal Link Utilisation** (§4.3): ``MLU(t) = size_rem / (time_rem * B * (1 - rho))``, the
  smallest share of the residual link a transfer needs to finish by its deadline (> 1: it cannot;
  a deadline already past counts as infinitely urgent).
* **Geometric thresholds** (§4.3): ``Q_i = U * E^-i`` for ``1 <= i <= K - 1`` (``E = 4``,
  ``U = 0.5``), equal ratios between neighbouring levels (the spacing that minimises the worst
  relative quantisation error). A transfer with ``MLU >= Q_1`` belongs in level 0, with
  ``Q_{i+1} <= MLU < Q_i`` in level ``i``, below ``Q_{K-1}`` in the lowest level ``K - 1``.
* **Monotonic promotion** (§4.3): a transfer's level only ever goes up (its level is the highest
  it has qualified for). While a transfer waits its MLU only grows (same size, less time), so
  evaluating it at every decision point, as :meth:`Rmlq.pop` does, equals continuous promotion;
  :meth:`Rmlq.promote` exists for callers that also update periodically (MFS §4.5).
* **The top level is kept for explicit deadlines** (§4.5: MFS reserves the highest priority for
  deadline-explicit last-stage flows). Without a deadline there is no MLU: such a transfer stays
  deferred in the lowest level and moves only when no transfer with a deadline is waiting ahead
  of it there (the link stays work-conserving, so it is never starved of an idle link).

Within a level, transfers go in the order they joined (a hardware priority queue is FIFO). A
transfer that has started is not preempted (the link carries whole transfers; MFS promotes only
at message granularity, §4.3).

Pure: the queue is an immutable value passed in and returned; no I/O, no clock, no ``gateway``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

#: MFS §4.3's empirical threshold parameters
DEFAULT_E = 4.0
DEFAULT_U = 0.5
DEFAULT_LEVELS = 4


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """A finished prefill whose KV waits to move."""

    request_id: str
    #: KV tokens to move
    tokens: int
    #: when its KV must have arrived (absolute, the caller's clock); None: no explicit deadline
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class QueuedTransfer:
    request: TransferRequest
    enqueued_at: float
    #: order of joining (FIFO within a level)
    seq: int
    #: 0 is the highest level
    level: int


@dataclass(frozen=True, slots=True)
class TransferQueue:
    """The waiting transfers of one link; ``next_seq`` numbers the next one to join."""

    entries: tuple[QueuedTransfer, ...] = ()
    next_seq: int = 0

    def __len__(self) -> int:
        return len(self.entries)


class TransferOrder(Protocol):
    """An order over one link's waiting transfers; every method returns a new queue."""

    def push(self, queue: TransferQueue, request: TransferRequest, now: float) -> TransferQueue: ...

    def pop(self, queue: TransferQueue, now: float) -> tuple[QueuedTransfer | None, TransferQueue]: ...


@dataclass(frozen=True, slots=True)
class LinkParams:
    #: the link's speed, KV tokens per second (B)
    tokens_per_s: float
    #: the fraction of it other traffic takes (rho, 0..1)
    load: float = 0.0


def mlu(tokens: int, deadline: float, now: float, link: LinkParams) -> float:
    """MFS §4.3's Minimal Link Utilisation of ``tokens`` due at ``deadline``; inf when due or
    the link has no residual capacity."""
    residual = link.tokens_per_s * (1.0 - link.load)
    remaining = deadline - now
    if tokens <= 0:
        return 0.0
    if remaining <= 0 or residual <= 0:
        return math.inf
    return tokens / (remaining * residual)


def thresholds(levels: int, e: float = DEFAULT_E, u: float = DEFAULT_U) -> tuple[float, ...]:
    """``Q_1 > Q_2 > ... > Q_{K-1}`` with ``Q_i = U * E^-i`` (MFS §4.3)."""
    return tuple(u * e ** (-i) for i in range(1, levels))


@dataclass(frozen=True, slots=True)
class Rmlq:
    """MFS's reverse multi-level queue with MLU promotion (see the module docstring)."""

    link: LinkParams
    levels: int = DEFAULT_LEVELS
    e: float = DEFAULT_E
    u: float = DEFAULT_U

    def __post_init__(self) -> None:
        if self.levels < 2:
            raise ValueError("an RMLQ needs at least 2 levels")
        if self.e <= 1 or self.u <= 0:
            raise ValueError("RMLQ thresholds need E > 1 and U > 0")

    @property
    def lowest(self) -> int:
        return self.levels - 1

    def level_for(self, request: TransferRequest, now: float) -> int:
        """The level the transfer qualifies for now (lowest without a deadline)."""
        if request.deadline is None:
            return self.lowest
        urgency = mlu(request.tokens, request.deadline, now, self.link)
        for level, bar in enumerate(thresholds(self.levels, self.e, self.u)):
            if urgency >= bar:
                return level
        return self.lowest

    def promote(self, queue: TransferQueue, now: float) -> TransferQueue:
        """Every waiting transfer raised to the level it qualifies for now, never lowered."""
        changed = False
        entries = []
        for entry in queue.entries:
            level = min(entry.level, self.level_for(entry.request, now))
            if level != entry.level:
                entry = replace(entry, level=level)
                changed = True
            entries.append(entry)
        return replace(queue, entries=tuple(entries)) if changed else queue

    def push(self, queue: TransferQueue, request: TransferRequest, now: float) -> TransferQueue:
        """Join deferred (the lowest level), promoted at once as far as the MLU demands."""
        entry = QueuedTransfer(request, now, queue.next_seq, self.lowest)
        entry = replace(entry, level=min(entry.level, self.level_for(request, now)))
        return TransferQueue((*queue.entries, entry), queue.next_seq + 1)

    def pop(self, queue: TransferQueue, now: float) -> tuple[QueuedTransfer | None, TransferQueue]:
        """The next transfer: highest level after promotion at ``now``, first come within it."""
        if not queue.entries:
            return None, queue
        queue = self.promote(queue, now)
        chosen = min(queue.entries, key=lambda q: (q.level, q.seq))
        rest = tuple(q for q in queue.entries if q is not chosen)
        return chosen, replace(queue, entries=rest)


@dataclass(frozen=True, slots=True)
class Fifo:
    """Transfers in the order they joined (one level; the baseline)."""

    def push(self, queue: TransferQueue, request: TransferRequest, now: float) -> TransferQueue:
        entry = QueuedTransfer(request, now, queue.next_seq, 0)
        return TransferQueue((*queue.entries, entry), queue.next_seq + 1)

    def pop(self, queue: TransferQueue, now: float) -> tuple[QueuedTransfer | None, TransferQueue]:
        if not queue.entries:
            return None, queue
        chosen = min(queue.entries, key=lambda q: q.seq)
        rest = tuple(q for q in queue.entries if q is not chosen)
        return chosen, replace(queue, entries=rest)


def make_transfer_order(name: str, link: LinkParams, levels: int = DEFAULT_LEVELS) -> TransferOrder:
    """``rmlq`` or ``fifo``."""
    if name == "rmlq":
        return Rmlq(link, levels)
    if name == "fifo":
        return Fifo()
    raise ValueError(f"unknown transfer order {name!r}; use rmlq or fifo")
