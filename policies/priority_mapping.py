"""Priority-based SLO mapping (HyperFlexis §5.2, Algorithm 2) as a pure policy with explicit state.

Clients that cannot state TTFT/TPOT targets give a priority ``p`` (0 highest, ``N - 1`` lowest).
The mapper turns it into absolute targets from what the fleet has recently achieved:

1. two sorted sliding windows hold the TTFT (with the request's queue time) and the TPOT of the
   last ``W`` completed requests, plus ``C_i``, how many of them had priority ``i``;
2. eq.(6) picks an index ``base + offset`` with ``base = sum(C_0 .. C_{p-1})`` and
   ``offset = floor((p + 1) / (N + 1) * C_p)``: higher priorities read lower-latency quantiles;
3. the TTFT read there is corrected by the change in queue time since the last assignment at
   this priority, so a transient queue spike does not inflate everyone's targets;
4. both values are clamped to the priority's configured ``[min, max]`` range, with the
   contention rule deciding which floor applies (see :func:`assign`).

Everything is a value: :class:`PriorityMappingState` is frozen and every update returns a new
one (copy-on-write tuples). The caller, e.g. the gateway's classifier, keeps the latest state;
the simulator can keep as many as it likes. Times are seconds.

Interpretations of the paper (it gives the pseudo-code but leaves these open):

* **Index out of range.** ``base + offset`` can equal the window length when priority ``p`` has
  no completions and every entry belongs to higher priorities; the index is clamped to the last
  entry (the slowest recent request), which is the natural quantile for "below everyone else".
* **Queue-time correction** follows Algorithm 2 literally: ``ttft -= q_ref - last_queue_time[p]``
  (in both directions: a reference that queued *less* than the last one raises the TTFT), then
  ``last_queue_time[p] = q_ref``. Before the first assignment at a priority there is no previous
  queue time and the correction is zero.
* **Contention rule** (§5.2 step (5) and the Fig. 6 discussion): if any higher priority
  (``i < p``) has pending requests, the priority's own lower bound ``min(p)`` is enforced
  ("strict lower bound"). Otherwise the floor is relaxed to the lowest floor of any priority
  ``<= p`` (normally priority 0's), so an uncontended low-priority request can get a target as
  tight as the window shows the fleet can deliver ("assigns tighter SLOs to low-priority
  requests to minimize their latency" while underloaded), but never tighter than anything a
  higher priority could be promised ("without undermining priority ordering"). The upper bound
  ``max(p)`` always holds: under contention targets relax "up to their configured maximum".
  The rule applies to TTFT and TPOT alike.
* **Underloaded** also means that nothing waits for an engine (``backlog``, the caller's
  queue): the relaxed floor is for a fleet with room. A priority alone on a busy fleet
  otherwise kept taking targets as tight as priority 0's, and the dispatcher sized every turn
  for them (eq.(5) budgets against the tightest target that arrives): on the priority ramp
  (one engine, the lowest priority alone at 15 QPS of long prompts) the turns shrank until that
  priority overloaded the engine by itself, 33 misses in its first 30 s (none with its own
  floor) and 118 queued requests shed as infeasible over the run (70).
* **Empty window.** Before any completion is observed the priority gets the midpoint of its
  ranges. With the ±25 % ranges of HyperFlexis §7.3 the midpoint is exactly the Table 1 target
  the range was built around.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class PriorityBounds:
    """The allowed target range of one priority level, seconds; ``0 < min <= max``."""

    ttft_min_s: float
    ttft_max_s: float
    tpot_min_s: float
    tpot_max_s: float

    def __post_init__(self) -> None:
        for label, low, high in (
            ("ttft", self.ttft_min_s, self.ttft_max_s),
            ("tpot", self.tpot_min_s, self.tpot_max_s),
        ):
            if not 0.0 < low <= high:
                raise ValueError(f"{label} bounds must satisfy 0 < min <= max, got [{low}, {high}]")

    @property
    def ttft_mid_s(self) -> float:
        return (self.ttft_min_s + self.ttft_max_s) / 2.0

    @property
    def tpot_mid_s(self) -> float:
        return (self.tpot_min_s + self.tpot_max_s) / 2.0


@dataclass(frozen=True, slots=True)
class PriorityMappingConfig:
    """``levels[p]`` bounds priority ``p`` (0 highest); ``window`` is W, completions remembered."""

    levels: tuple[PriorityBounds, ...]
    window: int

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("at least one priority level is required")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def num_levels(self) -> int:
        return len(self.levels)


@dataclass(frozen=True, slots=True)
class WindowEntry:
    """One window entry in insertion order; ``seq`` makes equal latencies distinguishable."""

    seq: int
    priority: int
    ttft_s: float
    queue_time_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class PriorityMappingState:
    """Everything Algorithm 2 remembers. Never mutate; every function returns a new state.

    * ``ttft_records``: ``(ttft_s, queue_time_s, seq)`` sorted ascending (the paper's sorted TTFT
      window, carrying the reference request's queue time for the spike correction);
    * ``tpot_records``: ``(tpot_s, seq)`` sorted ascending;
    * ``order``: the same completions oldest first, so the oldest can be dropped beyond W;
    * ``counts``: ``C_i`` per priority for the completions in the window;
    * ``last_queue_time``: queue time of the reference used at the last assignment per priority,
      ``None`` before the first one;
    * ``pending``: requests per priority the caller counts as pending, i.e. not yet answered
      (contention rule; see :func:`set_pending`).
    """

    config: PriorityMappingConfig
    ttft_records: tuple[tuple[float, float, int], ...] = ()
    tpot_records: tuple[tuple[float, int], ...] = ()
    order: tuple[WindowEntry, ...] = ()
    counts: tuple[int, ...] = ()
    last_queue_time: tuple[float | None, ...] = ()
    pending: tuple[int, ...] = ()
    next_seq: int = 0

    @property
    def size(self) -> int:
        """Completions currently in the window (``<= config.window``)."""
        return len(self.order)


@dataclass(frozen=True, slots=True)
class MappedSlo:
    """What :func:`assign` decided for one request.

    ``index`` is the eq.(6) window position used (``None`` for the empty-window default);
    ``queue_correction_s`` is what was subtracted from the window TTFT; ``contended`` says
    whether the level's own floor applied (strict): a higher priority had pending requests, or
    requests waited for an engine (``backlog``), when it was assigned.
    """

    priority: int
    ttft_s: float
    tpot_s: float
    index: int | None
    queue_correction_s: float
    contended: bool


def initial_state(config: PriorityMappingConfig) -> PriorityMappingState:
    """An empty window for ``config``: no completions, nothing pending."""
    n = config.num_levels
    return PriorityMappingState(
        config=config,
        counts=(0,) * n,
        last_queue_time=(None,) * n,
        pending=(0,) * n,
    )


def _check_priority(state: PriorityMappingState, priority: int) -> None:
    if not 0 <= priority < state.config.num_levels:
        raise ValueError(f"priority must be in [0, {state.config.num_levels - 1}], got {priority}")


def observe_completion(
    state: PriorityMappingState, priority: int, ttft_s: float, tpot_s: float, queue_time_s: float
) -> PriorityMappingState:
    """Add one completed request to the windows, dropping the oldest beyond W.

    ``ttft_s`` is the measured time to first token (arrival to first byte, seconds) and includes
    ``queue_time_s``, the time it waited in the gateway before dispatch. ``tpot_s`` is the mean
    time per output token after the first; callers skip requests that produced fewer than two
    tokens (no TPOT) rather than invent one, because both windows must hold the same requests.
    Negative or non-finite values raise ``ValueError``. Cost: O(log W) search + O(W) copy.
    """
    _check_priority(state, priority)
    for label, value in (("ttft_s", ttft_s), ("tpot_s", tpot_s), ("queue_time_s", queue_time_s)):
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"{label} must be finite and >= 0, got {value}")
    seq = state.next_seq
    entry = WindowEntry(seq, priority, ttft_s, queue_time_s, tpot_s)
    ttft_records = list(state.ttft_records)
    tpot_records = list(state.tpot_records)
    insort(ttft_records, (ttft_s, queue_time_s, seq))
    insort(tpot_records, (tpot_s, seq))
    order = (*state.order, entry)
    counts = list(state.counts)
    counts[priority] += 1
    while len(order) > state.config.window:
        oldest, order = order[0], order[1:]
        # entries are unique by seq, so bisect lands exactly on the one to drop
        del ttft_records[bisect_left(ttft_records, (oldest.ttft_s, oldest.queue_time_s, oldest.seq))]
        del tpot_records[bisect_left(tpot_records, (oldest.tpot_s, oldest.seq))]
        counts[oldest.priority] -= 1
    return replace(
        state,
        ttft_records=tuple(ttft_records),
        tpot_records=tuple(tpot_records),
        order=order,
        counts=tuple(counts),
        next_seq=seq + 1,
    )


def set_pending(
    state: PriorityMappingState, pending: Mapping[int, int] | Sequence[int]
) -> PriorityMappingState:
    """Replace the pending request counts per priority (the paper's "higher-priority requests are
    pending", which it does not define further).

    Accepts a sequence indexed by priority or a mapping ``priority -> count``; priorities not
    given count as zero. The caller decides what pending means and must update the counts before
    the :func:`assign` calls they should affect; the gateway counts a request from classification
    until it leaves, queued or running. Only "is anything of a higher priority pending" matters.
    """
    n = state.config.num_levels
    counts = [0] * n
    items = pending.items() if isinstance(pending, Mapping) else enumerate(pending)
    for priority, count in items:
        if not 0 <= priority < n:
            raise ValueError(f"pending priority must be in [0, {n - 1}], got {priority}")
        if count < 0:
            raise ValueError(f"pending count for priority {priority} must be >= 0, got {count}")
        counts[priority] = count
    return replace(state, pending=tuple(counts))


def priority_index(priority: int, counts: Sequence[int]) -> int:
    """Eq.(6): ``base + offset`` into the sorted window for ``priority`` given ``C_i`` counts.

    ``base`` skips the window share of every higher priority; ``offset`` places the request at
    fraction ``(p + 1) / (N + 1)`` of its own priority's share. Not clamped to the window.
    """
    n = len(counts)
    base = sum(counts[:priority])
    # integer floor of (p + 1) * C_p / (N + 1): exact, no float rounding at the boundaries
    offset = ((priority + 1) * counts[priority]) // (n + 1)
    return base + offset


def _clamp(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


def assign(
    state: PriorityMappingState, priority: int, backlog: bool = False
) -> tuple[MappedSlo, PriorityMappingState]:
    """Algorithm 2: targets for a new request at ``priority`` and the state after it.

    Only ``last_queue_time[priority]`` changes in the returned state (when the window is not
    empty). ``backlog``: requests wait for an engine (the fleet is not underloaded: the level's
    own floor applies as under contention). See the module docstring for the contention rule and
    the empty-window default.
    """
    _check_priority(state, priority)
    bounds = state.config.levels[priority]
    contended = backlog or any(count > 0 for count in state.pending[:priority])
    if contended:
        ttft_floor, tpot_floor = bounds.ttft_min_s, bounds.tpot_min_s
    else:
        # relaxed: as tight as the tightest floor at or above this priority, not tighter
        ttft_floor = min(level.ttft_min_s for level in state.config.levels[: priority + 1])
        tpot_floor = min(level.tpot_min_s for level in state.config.levels[: priority + 1])

    if not state.order:
        mapped = MappedSlo(priority, bounds.ttft_mid_s, bounds.tpot_mid_s, None, 0.0, contended)
        return mapped, state

    index = min(priority_index(priority, state.counts), state.size - 1)
    ttft, queue_time, _ = state.ttft_records[index]
    tpot, _ = state.tpot_records[index]
    last = state.last_queue_time[priority]
    correction = 0.0 if last is None else queue_time - last
    ttft -= correction
    last_queue_time = list(state.last_queue_time)
    last_queue_time[priority] = queue_time

    mapped = MappedSlo(
        priority=priority,
        ttft_s=_clamp(ttft, ttft_floor, bounds.ttft_max_s),
        tpot_s=_clamp(tpot, tpot_floor, bounds.tpot_max_s),
        index=index,
        queue_correction_s=correction,
        contended=contended,
    )
    return mapped, replace(state, last_queue_time=tuple(last_queue_time))
