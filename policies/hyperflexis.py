"""HyperFlexis SLO-aware dispatcher (paper §5.1, Algorithm 1), as a pure function.

Each call looks at the queue (already in the profile's queue order) and at every worker's shadow
state, and for each worker whose *maturity time* has come it:

1. computes a token budget: min(free KV tokens, eq.(5) budget for the tightest TTFT/TPOT);
2. scans a prefix of the queue and admits a request when its probability of meeting its TTFT
   (``admission_probability``) is at least ``theta`` and its prompt fits the remaining budget;
3. updates the worker's shadow and its next maturity time ``now + E_p + (E_p / relax)·E_d`` with
   ``relax = min TPOT - E_d``: the worker can take more once the prefill it was just given has
   been amortised by the time decoding saves against the tightest TPOT. On a chunked-prefill
   engine the prompts ride in decode steps, so a turn lasts at least ``E_p + E_d``; with the lax
   TPOTs of the 4-task set the paper's term is smaller than that, and using it over-dispatched
   (Experiment A at 50 QPS: 50 % attainment with it, 79-81 % with the floor; round robin 40 %).

It returns the assignments, every touched worker's new maturity time (explicit state the caller
keeps and passes back) and when to call again if nothing else happens. A worker that took nothing
is not polled: its maturity is ``inf`` (wait for an event: an arrival, a completion or first token
on it, a scrape) or the moment a candidate it skipped turns late. The caller calls again on those
events; they change the queue and the shadows.

Interpretation of ``calculate_p`` (the paper gives only its inputs): the chance that the request's
first token arrives before its deadline, modelled as a logistic in the remaining slack
``t_remaining = arrival + TTFT - (now + expected prefill)`` with a spread that grows with the
worker's utilisation (a busier worker's predictions are less certain). Requests with no slack get
p < 0.5 and wait for a better worker. Requests that can no longer meet their TTFT on any worker
(even an idle one, dispatched now) are *late*: they take whatever budget the feasible ones left
(``late_backfill``), and a worker with nothing else to do takes the head of the queue
(``idle_backfill``). Late requests are served late rather than never: under overload, skipping
them left engines idle while they aged in the queue (engines x makespan 4.6x round robin's at
120 QPS in Experiment A) and then timed them out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

from policies.api import RequestView
from policies.latency_fit import Coeffs, maturity_time, predict_decode, token_budget
from policies.queue_order import OrderContext, QueuedRequest


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request the gateway has placed on a worker and not seen finish (the shadow)."""

    prompt_tokens: int
    generated: int
    tpot_slo: float
    prefilled: bool


#: the share of eq.(2)'s one-sequence step below which no engine meets a TPOT (an engine that
#: makes several tokens a step, speculative decoding, meets targets below one step's time; and
#: before its fit converges the prior's step may be longer than the engine's)
TPOT_FLOOR_SHARE = 0.25


def tpot_floor(decode: Coeffs) -> float:
    """TPOT targets below this are not planned for: a quarter of eq.(2)'s step with one sequence
    and no context (:data:`TPOT_FLOOR_SHARE`), faster than the engine decodes at all. Holding its
    other work back cannot meet such a target, and planning for it did that for nothing: a stream
    claiming 1 ms (x-slo-tpot-ms: 1) left its engine an eq.(5) budget of nothing and a hold of
    max_hold_s per turn, one request a second, for as long as it ran."""
    floor = TPOT_FLOOR_SHARE * predict_decode(decode, 0, 1)
    return floor if floor > 0.0 else 0.0  # (a degenerate fit, or NaN: every target is planned)


class RunningLoad(NamedTuple):
    """What Algorithm 1 reads of a worker's running requests, summed: the same decisions as the
    requests themselves (eq.(1) and eq.(2) depend on these sums only), without one object per
    running request on every turn."""

    #: running requests
    requests: int = 0
    #: sum of prompt + generated tokens (the decode batch's current length)
    context_tokens: int = 0
    #: running requests whose first token has not come yet, their prompt tokens, and the sum of
    #: their squares (eq.(1)'s terms)
    waiting: int = 0
    waiting_tokens: int = 0
    waiting_squares: int = 0
    #: the tightest TPOT among them that the engine can meet at all (:func:`tpot_floor`;
    #: ``inf`` when none runs)
    min_tpot: float = math.inf
    #: the laxest TPOT among them (0 when none runs)
    max_tpot: float = 0.0

    @classmethod
    def of(cls, running: Iterable[RunningRequest], tpot_floor: float = 0.0) -> RunningLoad:
        """The sums of ``running``; its tightest TPOT among those not below ``tpot_floor``
        (:func:`tpot_floor`)."""
        count = context = waiting = waiting_tokens = waiting_squares = 0
        min_tpot, max_tpot = math.inf, 0.0
        for r in running:
            count += 1
            context += r.prompt_tokens + r.generated
            if not r.prefilled:
                waiting += 1
                waiting_tokens += r.prompt_tokens
                waiting_squares += r.prompt_tokens * r.prompt_tokens
            if tpot_floor <= r.tpot_slo < min_tpot:
                min_tpot = r.tpot_slo
            if r.tpot_slo > max_tpot:
                max_tpot = r.tpot_slo
        return cls(count, context, waiting, waiting_tokens, waiting_squares, min_tpot, max_tpot)


@dataclass(slots=True)
class WorkerView:
    """One engine as the dispatcher sees it. ``maturity`` is the dispatcher's own state.

    Its running requests are given either one by one (``running``) or summed (``load``, which
    then wins): the gateway keeps the sums as requests come and go.

    Read-only by contract, not frozen: a frozen one cost 2.6x as much to make, and the gateway
    makes one per worker per turn (two per placement in the saturated loop, one to two per
    request at low load). :func:`dispatch` never writes to one (tests/policies/test_hyperflexis.py)."""

    engine_id: str
    prefill_coeffs: Coeffs
    decode_coeffs: Coeffs
    running: tuple[RunningRequest, ...] = ()
    free_kv_tokens: int = 1 << 30
    max_num_seqs: int = 256
    maturity: float = 0.0
    load: RunningLoad | None = None
    #: LoRA adapters the engine has loaded
    adapters: frozenset[str] = frozenset()
    #: for a look during the worker's hold (an arrival to an empty queue, no worker mature), the
    #: prompt tokens the hold's turn and earlier joins took: the turn's eq.(5) budget less those
    #: is what the arrival may use (``None``: a turn of its own)
    joining: int | None = None


class _Shadow:
    """A worker's running requests during one dispatch call (its load, plus what it took)."""

    __slots__ = (
        "context_tokens",
        "count",
        "kv_taken",
        "max_tpot",
        "min_tpot",
        "prefill_taken",
        "taken",
        "tpot_floor",
        "waiting",
        "waiting_squares",
        "waiting_tokens",
    )

    def __init__(self, worker: WorkerView) -> None:
        self.tpot_floor = tpot_floor(worker.decode_coeffs)
        load = worker.load if worker.load is not None else RunningLoad.of(worker.running, self.tpot_floor)
        self.count = load.requests
        self.context_tokens = load.context_tokens
        self.waiting = load.waiting
        self.waiting_tokens = load.waiting_tokens
        self.waiting_squares = load.waiting_squares
        self.min_tpot = load.min_tpot
        self.max_tpot = load.max_tpot
        #: what this worker's earlier looks in the same call took: requests, KV, prefill tokens
        #: (a join counts what its hold took before it)
        self.taken = 0
        self.kv_taken = 0
        self.prefill_taken = worker.joining or 0

    def add(self, prompt_tokens: int, tpot_slo: float, kv_tokens: int = 0) -> None:
        """A request just taken (``prompt_tokens`` to prefill, ``kv_tokens`` of room): nothing
        generated, waiting for its prefill."""
        self.taken += 1
        self.kv_taken += kv_tokens
        self.prefill_taken += prompt_tokens
        self.count += 1
        self.context_tokens += prompt_tokens
        self.waiting += 1
        self.waiting_tokens += prompt_tokens
        self.waiting_squares += prompt_tokens * prompt_tokens
        if self.tpot_floor <= tpot_slo < self.min_tpot:
            self.min_tpot = tpot_slo

    def decode_step(self, coeffs: Coeffs) -> float:
        """Eq.(2) over what runs (0 when nothing does)."""
        if not self.count:
            return 0.0
        return predict_decode(coeffs, self.context_tokens, self.count)

    def prefill(self, coeffs: Coeffs) -> float:
        """Eq.(1) over what waits for its prefill (0 when nothing does)."""
        if not self.waiting:
            return 0.0
        a, b, c = coeffs
        return a + b * self.waiting_tokens + c * self.waiting_squares


@dataclass(frozen=True, slots=True)
class HyperFlexisParams:
    theta: float = 0.5
    #: how many queued requests one worker examines per turn (bounds the cost per event)
    max_scan: int = 128
    #: once a turn has taken work, its scan stops after this many requests in a row that do not
    #: fit (seqs, KV, budget): on every completion at 256 engines, scanning the rest of
    #: ``max_scan`` for a fit that rarely exists was the dispatcher's main cost
    scan_after_admit: int = 16
    #: logistic spread of the slack, as a fraction of the request's TTFT target
    slack_scale: float = 0.1
    #: an idle worker takes the queue head even when its TTFT can no longer be met
    idle_backfill: bool = True
    #: requests that can no longer meet their TTFT anywhere use the budget feasible ones left
    late_backfill: bool = True
    #: shortest hold after a turn that took work (seconds): bounds how often one worker is served
    recheck_s: float = 0.01
    #: a worker is never held longer than this (seconds), even when relax <= 0 says "never"
    max_hold_s: float = 1.0
    #: TPOT targets are planned against as this share of themselves (eq.(5) and the hold): a
    #: margin for prediction error, since exact predictions put the mean at the target itself
    tpot_plan: float = 1.0
    #: share of the tightest TTFT that one dispatch's prefill may use in eq.(5); the rest is
    #: headroom for the next urgent arrival's own prefill, which the paper's bound leaves out
    budget_ttft_share: float = 0.5
    #: eq.(5) budgets against the tightest TTFT among the arrivals of this many seconds (the
    #: strict arrival a long batch must not block is one like those recently seen); 0: always
    #: the tightest TTFT of the SLO profile, whether or not any request asks for it
    tightest_window_s: float = 30.0
    #: prefer, among the workers of a turn, the one whose engine holds the most of a request's
    #: prompt in its prefix cache, and predict each prefill from the tokens not cached there
    #: (needs the gateway's prefix index: a routing profile with this on gets one)
    prefix_preference: bool = False
    #: a worker leaves a request to a worker later in the same turn that holds at least this
    #: fraction of its prompt more (smaller differences save less prefill than a wait costs)
    prefix_margin: float = 0.1
    #: a request may wait for a worker holding more of its prompt that is not mature yet, up to
    #: this share of its TTFT target after its arrival (0: only workers mature in the same turn)
    prefix_max_wait: float = 0.2
    #: the imbalance bound: a request is not left to a worker running more than this many requests
    #: and ``prefix_max_ratio`` times more than the worker that would take it instead
    prefix_max_spread: float = 2.0
    prefix_max_ratio: float = 1.5
    #: under overload, serve last the longest requests of each SLO band that its measured drain
    #: cannot fit before their deadlines (Moore-Hodgson, :mod:`policies.demotion`); needs a queue
    #: order that ranks by it (``uses_demotion``: slo_tpot) and ``theta >= 0.5``
    demote_longest: bool = False
    #: plan those deadlines against this share of each band's measured drain rate
    demote_rate_share: float = 0.9
    #: the engines run prompt chunks inside decode steps (vLLM's chunked prefill, llama.cpp's
    #: continuous batching), paying a step's fixed cost once: eq.(5) then charges a worker with
    #: running streams what a turn's prefill adds to their decode step, ``a - a_d``, not ``a``
    #: (the hold still amortises the whole E_p, see :func:`_next_maturity`)
    mixed_steps: bool = False
    #: keep TPOT classes on engines of their own where TPOT binds: a laxer request whose prefill
    #: would break a worker's tighter streams (it exceeds the turn's budget) is left to an engine
    #: whose running requests are mostly of its class (or idle), and a tighter request is left by
    #: a worker running mostly laxer requests, whose decode step is at least half its TPOT, to an
    #: engine running mostly its class. Classes differ by more than ``segregate_ratio``; targets
    #: within it of each other are one class.
    tpot_segregation: bool = False
    segregate_ratio: float = 2.0
    #: a request is left for its class only while it has waited less than this share of its
    #: TTFT target: an engine of its class full for longer must not hold it until it times out
    segregate_max_wait: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {self.theta}")
        if not 0.0 < self.tpot_plan <= 1.0:
            raise ValueError(f"tpot_plan must be in (0, 1], got {self.tpot_plan}")
        if not 0.0 < self.budget_ttft_share <= 1.0:
            raise ValueError(f"budget_ttft_share must be in (0, 1], got {self.budget_ttft_share}")
        if self.tightest_window_s < 0:
            raise ValueError(f"tightest_window_s must be >= 0, got {self.tightest_window_s}")
        if not 0.0 <= self.prefix_margin <= 1.0 or not 0.0 <= self.prefix_max_wait <= 1.0:
            raise ValueError(
                f"prefix_margin and prefix_max_wait must be in [0, 1], got {self.prefix_margin}, "
                f"{self.prefix_max_wait}"
            )
        if self.prefix_max_spread < 0 or self.prefix_max_ratio < 1:
            raise ValueError("prefix_max_spread must be >= 0 and prefix_max_ratio >= 1")
        if self.max_hold_s < self.recheck_s:
            # (a hold shorter than the recheck would let a worker take a second turn at the same instant)
            raise ValueError(f"max_hold_s must be >= recheck_s ({self.recheck_s}), got {self.max_hold_s}")
        if self.demote_longest and self.theta < 0.5:
            # the plan leaves late requests to the queue, which keeps them behind only then (LateLast)
            raise ValueError(f"demote_longest needs theta >= 0.5, got theta {self.theta}")
        if not 0.0 < self.demote_rate_share <= 1.0:
            raise ValueError(f"demote_rate_share must be in (0, 1], got {self.demote_rate_share}")
        if not self.segregate_ratio >= 1.0:
            raise ValueError(f"segregate_ratio must be >= 1, got {self.segregate_ratio}")
        if not self.segregate_max_wait >= 0.0:
            raise ValueError(f"segregate_max_wait must be >= 0, got {self.segregate_max_wait}")
        if self.max_scan < 1 or self.slack_scale <= 0 or self.recheck_s <= 0:
            raise ValueError("max_scan must be >= 1; slack_scale and recheck_s must be > 0")


class Held(NamedTuple):
    """What engines hold of one request's prompt, as fractions of it (engines holding none may be
    left out). Fractions, not tokens: the index counts the engine's tokens, the request view the
    gateway's estimate of them."""

    #: in each engine's prefix cache: its prefill is skipped
    cached: Mapping[str, float]
    #: in blocks that requests running on the engine use now: they take no new KV (a cached block
    #: nobody uses is free memory the engine may reuse, and counts as KV to find, like any other)
    shared: Mapping[str, float]


#: a request id -> what each engine holds of its prompt, or None when nothing is known of it
PrefixLookup = Callable[[str], Held | None]


@dataclass(slots=True)
class Assignment:
    """Read-only by contract, not frozen (as :class:`WorkerView`): one is made per placement."""

    request_id: str
    engine_id: str
    #: False when the request was admitted by idle backfill with p < theta
    feasible: bool = True
    #: prompt tokens the engine was predicted to hold cached (``prefix_preference``), and of
    #: those, the ones in blocks running requests share (no new KV)
    cached_tokens: int = 0
    shared_tokens: int = 0
    #: its TTFT was already lost (late backfill, or idle backfill of a late head): the late lane
    late: bool = False


@dataclass(slots=True)
class HyperFlexisDecision:
    """Read-only by contract, not frozen (as :class:`WorkerView`): one is made per turn."""

    assignments: tuple[Assignment, ...]
    maturity: Mapping[str, float] = field(default_factory=dict)
    wake_at: float = math.inf
    #: workers that took nothing for lack of seqs or KV (not slack): only a completion or a scrape
    #: on them can change that, so a new arrival need not wake them
    full: frozenset[str] = frozenset()
    #: for each worker that took work, the prefill time its maturity was computed from (eq.(1)
    #: over what waits for prefill there, the new work included), seconds
    prefill_s: Mapping[str, float] = field(default_factory=dict)
    #: for each worker that took work, the prompt tokens its turn took from its eq.(5) budget
    #: (a join's include what its hold took before)
    budget_taken: Mapping[str, int] = field(default_factory=dict)


def admission_probability(
    arrival: float,
    ttft_slo: float,
    now: float,
    expected_prefill_s: float,
    utilization: float,
    slack_scale: float,
) -> float:
    """Probability in (0, 1) that the first token beats ``arrival + ttft_slo`` if dispatched now."""
    remaining = arrival + ttft_slo - (now + expected_prefill_s)
    spread = max(1e-4, slack_scale * ttft_slo * (1.0 + max(0.0, utilization)))
    z = remaining / spread
    if z >= 40:
        return 1.0
    if z <= -40:
        return 0.0
    return 1.0 / (1.0 + math.exp(-z))


class _QueuePrefix:
    """The queue, materialised only as far as some worker has read it.

    Workers re-read the queue from its head (skipping what earlier workers took), so the items
    are cached; the source is read lazily, which keeps one call's cost bounded by what the mature
    workers actually examine (``max_scan`` each plus what they take), however long the queue is.
    """

    __slots__ = ("_items", "_source", "complete")

    def __init__(self, source: Iterable[QueuedRequest]) -> None:
        self._items: list[QueuedRequest]
        #: every request of the source is in ``_items``
        self.complete: bool
        if isinstance(source, (tuple, list)):  # (an arrival's turn: one request, read already)
            self._items, self.complete = list(source), True
            self._source: Iterator[QueuedRequest] = iter(())
        else:
            self._items, self.complete = [], False
            self._source = iter(source)

    def _extend(self, count: int) -> None:
        if self.complete:
            return
        before = len(self._items)
        self._items.extend(islice(self._source, count))
        if len(self._items) - before < count:
            self.complete = True

    def all_taken(self, taken: set[str]) -> bool:
        """Whether the source is read to its end and every request of it is in ``taken`` (which
        holds only requests of this prefix): nothing is left for any worker."""
        return self.complete and len(taken) >= len(self._items)

    def untaken(self, skip: set[str], limit: int) -> list[QueuedRequest]:
        """The first ``limit`` requests in order whose ids are not in ``skip``."""
        items = self._items
        # taken requests are never more than ``skip``, so this many items always suffice
        need = limit + len(skip)
        if len(items) < need:
            self._extend(need - len(items))
        if not skip:
            return items[:limit]
        return [item for item in items[:need] if item.view.request_id not in skip][:limit]

    def items_from(self, start: int, count: int) -> list[QueuedRequest]:
        """Up to ``count`` items in order from index ``start``, read from the source as needed."""
        need = start + count
        if len(self._items) < need:
            self._extend(need - len(self._items))
        return self._items[start:need]


class _Candidates:
    """A turn's candidates: the first ``limit`` untaken requests, read from the prefix a chunk at a
    time as the turn consumes them (a turn usually stops long before ``max_scan``)."""

    __slots__ = ("_at", "_chunk", "_left", "_prefix", "_skip", "items")

    def __init__(self, prefix: _QueuePrefix, skip: set[str], limit: int, chunk: int = 24) -> None:
        self._prefix = prefix
        self._skip = skip
        self._chunk = chunk
        self._at = 0  # index into the prefix's items of the next one to look at
        self._left = limit
        self.items: list[QueuedRequest] = []

    def grow(self) -> bool:
        """Read the next chunk of untaken candidates into ``items``; False when none is left."""
        skip = self._skip
        prefix = self._prefix
        while self._left > 0:
            if prefix.complete and self._at >= len(prefix._items):
                return False  # (a complete prefix read to its end: nothing more will come)
            want = min(self._chunk, self._left)
            source = prefix.items_from(self._at, want + len(skip))
            if not source:
                return False
            fresh: list[QueuedRequest]
            if not skip:  # (a turn's first look: nothing taken yet)
                fresh = source[:want]
                self._at += len(fresh)
            else:
                fresh = []
                for i, item in enumerate(source):
                    if item.view.request_id not in skip:
                        fresh.append(item)
                        if len(fresh) == want:
                            self._at += i + 1
                            break
                else:
                    self._at += len(source)
            if fresh:
                self._left -= len(fresh)
                self.items.extend(fresh)
                return True
        return False

    def __iter__(self) -> Iterator[QueuedRequest]:
        items = self.items
        i = 0
        while i < len(items) or self.grow():
            yield items[i]
            i += 1

    def __bool__(self) -> bool:
        return bool(self.items) or self.grow()


def kv_bound(worker: WorkerView, queue_min_need: int) -> bool:
    """Whether ``worker`` runs something and has less KV free than the least any queued request
    needs (``queue_min_need``, as :func:`dispatch` takes it): its turn takes nothing and it waits
    for an event on itself. :func:`dispatch` gives it maturity ``inf`` and lists it in ``full``
    (when its turn comes with a request left untaken), so a caller may park such a worker without
    the call when no worker comes before it in the turn."""
    load = worker.load if worker.load is not None else RunningLoad.of(worker.running)
    return load.requests > 0 and worker.free_kv_tokens < queue_min_need


def dispatch(
    queue: Iterable[QueuedRequest],
    workers: Sequence[WorkerView],
    now: float,
    params: HyperFlexisParams = HyperFlexisParams(),
    tightest_ttft_s: float = math.inf,
    late_last: OrderContext | None = None,
    queue_min_need: int = 0,
    cached: PrefixLookup | None = None,
    soon: Mapping[str, tuple[float, int]] | None = None,
    adapters_held: frozenset[str] = frozenset(),
    engine_classes: Callable[[], Mapping[str, tuple[float, int]]] | None = None,
    pinned: bool = False,
) -> HyperFlexisDecision:
    """Run Algorithm 1 once over the workers whose maturity time has come.

    ``queue`` is in dispatch order (any iterable; it is read lazily and at most once); each
    request is assigned at most once. ``tightest_ttft_s`` is the tightest TTFT target the fleet
    serves (eq.(5) budgets against it, so a long batch dispatched for a lax class cannot block the
    next strict arrival); the candidates' own targets are used when it is larger.

    Every worker examined gets a new maturity time in the decision. ``math.inf`` means *wait for
    an event*: the worker took nothing and nothing but an event can change that (a completion or
    first token on it frees seqs, KV or prefill slack; an arrival brings a new candidate; a scrape
    changes its free KV), so the caller parks it instead of polling. When a candidate it rejected
    will become late (and so eligible for late backfill) the time of that is its maturity instead.

    ``late_last``: the queue holds the requests late on this context's estimate behind all the
    others (the :class:`~policies.queue_order.LateLast` order keyed with it). A worker no faster
    than that estimate then ends its first pass at the first such request instead of skipping
    every one of them: they are late for it too.

    ``queue_min_need``: the least KV (prompt + output bound) any queued request needs, when the
    caller keeps it (0 otherwise); a busy worker with less free takes nothing, without a scan.

    ``pinned``: the queue may hold requests pinned to one engine (``RequestView.engine``): a
    worker of another engine leaves them, as it leaves a LoRA adapter's request to the engines
    that hold it.

    ``engine_classes`` (with ``params.tpot_segregation``): each engine of the pool (workers of
    this call included) with the TPOT target most of its running requests have (``inf``: idle)
    and its whole KV capacity in tokens; called at most once per call, when a candidate's TPOT
    class differs from its worker's (or its worker runs more than one class).

    ``cached`` (with ``params.prefix_preference``): what each engine holds of a request's prompt.
    A worker then predicts each prefill from the tokens not cached on its engine, and leaves a
    request to a worker whose turn is still to come in this call and holds at least
    ``prefix_margin`` of its prompt more; once every worker of the turn has had its look, a
    worker that left something looks again, so a request the better-placed worker turned down is
    not stranded. ``soon``: the maturity and running requests of workers not in this call that
    hold a prefix of a request; a request is left to one of them too while its wait for it stays
    within ``prefix_max_wait`` of its TTFT target (the worker leaving it looks again when that
    ends). Never to a worker over the imbalance bound: more than ``prefix_max_spread`` requests
    and ``prefix_max_ratio`` times above the worker that would take it instead.
    """
    if ALONE_SHORTCUT and len(workers) == 1 and isinstance(queue, tuple) and len(queue) == 1:
        alone = _alone(
            queue[0],
            workers[0],
            now,
            params,
            tightest_ttft_s,
            late_last,
            queue_min_need,
            cached,
            adapters_held,
        )
        if alone is not None:
            return alone
    prefix = _QueuePrefix(queue)
    # (time, tiebreak, index): a second look is ordered after every first one due by ``now``
    order = [(w.maturity, i, i) for i, w in enumerate(workers)]
    heapq.heapify(order)
    running: dict[str, _Shadow] = {}  # each examined worker's running + taken
    taken: set[str] = set()
    assignments: list[Assignment] = []
    maturity: dict[str, float] = {}
    prefill_s: dict[str, float] = {}
    budget_taken: dict[str, int] = {}
    full: set[str] = set()
    lookup = cached if params.prefix_preference else None
    # workers due in this call whose first look is still to come: the ones a request may be left to
    pending = {w.engine_id for w in workers if w.maturity <= now} if lookup is not None else set()
    # running requests per worker (taken in this call included), for the imbalance bound
    loads: dict[str, int] = {}
    if lookup is not None:
        loads = {e: n for e, (_, n) in (soon or {}).items()}
        loads.update((w.engine_id, _requests(w)) for w in workers)
    looked_again: set[str] = set()
    turn = _Turn(
        prefix,
        taken,
        now,
        params,
        tightest_ttft_s,
        late_last,
        queue_min_need,
        lookup,
        pending,
        soon or {},
        loads,
        adapters_held,
        bool(adapters_held) or pinned,
        engine_classes if params.tpot_segregation else None,
        {},
    )

    while order and order[0][0] <= now:
        _, _, index = heapq.heappop(order)
        if prefix.all_taken(taken):
            break  # (as an exhausted look ends the call, before this worker's look is set up)
        worker = workers[index]
        if pending:
            pending.discard(worker.engine_id)
        shadow = running.get(worker.engine_id)
        if shadow is None:
            shadow = running[worker.engine_id] = _Shadow(worker)
        admitted, late_at, exhausted, slack_bound, left = _fill_worker(turn, worker, shadow)
        if exhausted:
            break  # every request is taken: this and the other mature workers stay mature
        if not admitted and not slack_bound and not left:
            full.add(worker.engine_id)
        for item, feasible, prefill_tokens, kv_tokens, late in admitted:
            view = item.view
            taken.add(view.request_id)
            cached_tokens = view.prompt_tokens - prefill_tokens
            shared_tokens = view.prompt_tokens + view.max_output_tokens - kv_tokens
            assignments.append(
                Assignment(view.request_id, worker.engine_id, feasible, cached_tokens, shared_tokens, late)
            )
            shadow.add(prefill_tokens, item.tpot_slo, kv_tokens)
        if loads:
            loads[worker.engine_id] = shadow.count
        next_time, e_p = _next_maturity(worker, shadow, now, bool(admitted), late_at, params)
        engine_id = worker.engine_id
        look_again = left and engine_id not in looked_again
        if admitted:
            prefill_s[engine_id] = e_p
            budget_taken[engine_id] = shadow.prefill_taken
            maturity[engine_id] = next_time
        elif engine_id not in prefill_s and not look_again:
            # (a second look that took nothing keeps the first's hold; a first look that left its
            # requests to later workers and took nothing decides nothing yet: if its second look
            # finds the queue emptied it stays mature, as an idle worker with nothing to take does)
            maturity[engine_id] = next_time
        if look_again:
            looked_again.add(engine_id)
            heapq.heappush(order, (now, len(workers) + len(looked_again), index))
        elif maturity.get(engine_id, now) > now:  # (always, after a look that decided: no look twice at now)
            heapq.heappush(order, (maturity[engine_id], index, index))

    remaining = prefix.untaken(taken, 1)
    wake_at = order[0][0] if order and remaining else math.inf
    return HyperFlexisDecision(
        tuple(assignments), maturity, wake_at, frozenset(full), prefill_s, budget_taken
    )


class _Turn(NamedTuple):
    """What every worker's look in one :func:`dispatch` call shares."""

    queue: _QueuePrefix
    taken: set[str]
    now: float
    params: HyperFlexisParams
    tightest_ttft_s: float
    late_last: OrderContext | None
    queue_min_need: int
    cached: PrefixLookup | None
    #: workers whose first look in this call is still to come
    pending: set[str]
    #: workers not looking in this call that hold a prefix of a request to look at: their
    #: maturity and running requests
    soon: Mapping[str, tuple[float, int]]
    #: running requests per worker that a request may be left to (and per worker looking)
    loads: dict[str, int]
    #: LoRA adapters loaded on some engine in rotation: a request for one goes only to those
    adapters_held: frozenset[str]
    #: requests may be bound to some engines (adapters held, or requests pinned to an engine)
    bound: bool
    #: each engine's TPOT class (see :func:`dispatch`), read once when first needed into ``memo``
    engine_classes: Callable[[], Mapping[str, tuple[float, int]]] | None
    memo: dict[str, Mapping[str, tuple[float, int]]]


def _fill_worker(
    turn: _Turn, worker: WorkerView, shadow: _Shadow
) -> tuple[list[tuple[QueuedRequest, bool, int, int, bool]], float, bool, bool, bool]:
    """One worker's look: what it admits (each with whether it is feasible, the prompt tokens it
    must prefill, the KV tokens it must find and whether its TTFT is already lost), when a
    candidate it skipped for slack turns late (``inf`` if none), whether the queue had nothing
    left for it to look at, whether any candidate was turned down for slack (rather than for
    seqs, KV or budget), and whether it left any to a worker holding more of its prompt."""
    queue, taken, now, params = turn.queue, turn.taken, turn.now, turn.params
    tightest_ttft_s, late_last, queue_min_need = turn.tightest_ttft_s, turn.late_last, turn.queue_min_need
    cached = turn.cached
    adapters_held = turn.adapters_held
    bound = turn.bound
    engine_id = worker.engine_id
    left = False
    coeffs = worker.prefill_coeffs
    decode_s = shadow.decode_step(worker.decode_coeffs)
    # eq.(1) over (waiting + candidate) kept as running sums: O(1) per candidate examined
    a, b, c = coeffs
    waiting_sum = shadow.waiting_tokens
    waiting_squares = shadow.waiting_squares
    utilization = shadow.count / max(1, worker.max_num_seqs)
    free_seqs = worker.max_num_seqs - shadow.count
    kv_left = worker.free_kv_tokens - shadow.kv_taken
    budget_left: int | None = None
    # anything taken in this turn, by this look or an earlier one of the same call (or, for a
    # join, by the turn whose hold it joins: an oversized prompt waits for a turn of its own)
    took = shadow.taken > 0 or worker.joining is not None
    # (request, feasible, prompt tokens to prefill, KV tokens to find, late)
    admitted: list[tuple[QueuedRequest, bool, int, int, bool]] = []
    late_at = math.inf
    slack_bound = False
    candidates = _Candidates(queue, taken, params.max_scan)
    misses = 0
    late_rejected = params.theta >= 0.5
    # (a relative margin of 1e-9 absorbs the context's 1/(1/b) rounding)
    lane = (
        late_last
        if late_last is not None
        and late_rejected
        # the lane ranks by the whole prompt: with a prefix cache, a request late on it may be
        # on time on its uncached part (skipped, it waited for an idle worker or timed out)
        and cached is None
        and c >= 0.0
        and a >= late_last.prefill_base_s * (1.0 - 1e-9)
        and b * late_last.prefill_tokens_per_s >= 1.0 - 1e-9
        else None
    )
    if shadow.count and kv_left < queue_min_need:
        # a busy engine woken by a completion, with most of its cache still held: not one queued
        # request fits the KV left, so say so without scanning (see kv_bound)
        return [], late_at, not queue.untaken(taken, 1), False, False
    # The scans below index the candidates (grown on demand) rather than iterate them, and
    # inline eq.(1) for one prompt and the lane's last feasible start (the same floating-point
    # operations as predict_prefill and last_feasible_start): most candidates a turn examines are
    # skipped after a comparison or two, and under saturation every turn re-reads the head.
    items = candidates.items
    grow = candidates.grow
    # the TPOTs this worker ran before the turn, when classes are kept apart (its class is read
    # only for a candidate of another TPOT, or when it runs more than one class)
    segregate = turn.engine_classes is not None and shadow.count > shadow.taken
    ratio, segregate_wait = turn.params.segregate_ratio, turn.params.segregate_max_wait
    tpot_lo, tpot_hi = shadow.min_tpot, shadow.max_tpot
    if lane is not None:
        lane_base, lane_rate = lane.prefill_base_s, lane.prefill_tokens_per_s
    theta, slack_scale, scan_after_admit = params.theta, params.slack_scale, params.scan_after_admit
    # What ends the scan (no seq, KV or budget left, too many misses since an admission) changes
    # only when a candidate is admitted or missed or the budget is first set, so it is evaluated
    # there and tested before the next candidate: most candidates are turned down for slack.
    done = free_seqs <= 0 or kv_left <= 0 or (took and (kv_left < queue_min_need or scan_after_admit <= 0))
    # Under saturation most candidates a look reads are capacity misses (their KV or prompt does
    # not fit what is left): with no adapters and no prefix lookup those are skipped by a tight
    # loop that makes only the tests the full ones below make before the capacity test (classes,
    # the lane), in the same order and with the same arithmetic; anything else goes to the full
    # tests. (A worker running more than one TPOT class reads every candidate's class.)
    mixed_classes = segregate and tpot_hi > ratio * tpot_lo
    tight = TIGHT_SCAN and not bound and cached is None and not mixed_classes
    lo = ratio * tpot_lo
    i = 0
    while i < len(items) or grow():
        if done:
            break  # nothing more can fit this turn: the rest of the scan would be wasted
        if tight and budget_left is not None:
            end = len(items)
            while i < end:
                item = items[i]
                view = item.view
                prompt = view.prompt_tokens
                if not ((prompt > budget_left and took) or prompt + view.max_output_tokens > kv_left):
                    break
                its_tpot = item.tpot_slo
                if segregate and (its_tpot > lo or tpot_hi > ratio * its_tpot):
                    break
                if lane is not None and now > view.arrival + item.ttft_slo - (
                    lane_base + (prompt if prompt > 0 else 0) / lane_rate
                ):
                    break
                i += 1
                misses += 1
                if took and misses >= scan_after_admit:
                    done = True
                    break
            if done:
                break
            if i == end:
                continue  # (the next chunk, if any)
        item = items[i]
        i += 1
        if budget_left is None:
            budget_left = _budget_left(worker, shadow, item, decode_s, tightest_ttft_s, params)
            done = budget_left <= 0 and took
        view = item.view
        if bound and _elsewhere(view, worker, adapters_held):
            # its LoRA adapter is loaded elsewhere (not here: this engine would answer 404); like
            # slack, that says nothing about what else may fit, so an arrival may wake this worker
            slack_bound = True
            continue
        prompt = view.prompt_tokens
        its_tpot = item.tpot_slo
        if (
            segregate
            and (tpot_hi > ratio * tpot_lo or its_tpot > ratio * tpot_lo or tpot_hi > ratio * its_tpot)
            # (a LoRA request goes where its adapter is, a pinned one to its engine, whatever
            # the classes)
            and not (adapters_held and view.lora is not None)
            and view.engine is None
            and now < view.arrival + segregate_wait * item.ttft_slo
            and _class_elsewhere(
                turn, engine_id, its_tpot, prompt + view.max_output_tokens, prompt > budget_left, decode_s
            )
        ):
            # an engine of its class may take it, an arrival may wake this one; no timer for the
            # end of that wait: a worker asleep until then took none of the arrivals meanwhile
            # (offline on the TPOT-binding set at half speed, a timer cost 2-4 points), and its
            # next turn looks again
            slack_bound = True
            continue
        # The budget bounds how much is batched per turn; a prompt longer than any budget would
        # otherwise never be dispatched, so an otherwise empty turn may take one such request.
        deadline = view.arrival + item.ttft_slo
        if lane is not None and now > deadline - (lane_base + (prompt if prompt > 0 else 0) / lane_rate):
            # from here on the queue holds only requests late on the lane's estimate, which this
            # worker cannot beat: skipping them one by one would change nothing
            # (slack, not capacity, holds these back: a later one might fit, so an arrival may
            # wake this worker; "full" is only for workers nothing could fit)
            slack_bound = True
            break
        need_kv = prompt + view.max_output_tokens
        if cached is not None:
            prompt, kv_prompt, leave_until = _uncached(turn, item, engine_id)
            if leave_until >= now:
                # a worker still to look in this call, or maturing soon, skips more of its prefill
                if leave_until == now:
                    left = True  # (it looks before this worker looks again)
                else:
                    late_at = min(late_at, leave_until)  # look again when the wait for it ends
                    slack_bound = True
                continue
            need_kv = kv_prompt + view.max_output_tokens
        if (prompt > budget_left and took) or need_kv > kv_left:
            misses += 1
            done = done or (took and misses >= scan_after_admit)
            continue
        if late_rejected and deadline < now + a + b * prompt + c * prompt * prompt:
            # late even on an idle worker: p < 0.5 <= theta whatever this worker runs, so skip the
            # probability (under overload most of a scan is such requests)
            slack_bound = True
            continue
        expected = a + b * (waiting_sum + prompt) + c * (waiting_squares + prompt * prompt)
        p = admission_probability(view.arrival, item.ttft_slo, now, expected, utilization, slack_scale)
        if p < theta:
            slack_bound = True
            # Slack only shrinks with time, so this worker will not take it before an event,
            # except once it is late everywhere (late backfill): that moment is worth a timer.
            # the first instant it is late (deadline < now + prefill), not the boundary itself:
            # a timer set for the boundary would find it not yet late and park for good
            # (only one earlier than the earliest so far can matter: the next float above a
            # boundary below late_at is at most late_at)
            boundary = deadline - (a + b * prompt + c * (prompt * prompt))
            if boundary < late_at:
                turns_late = math.nextafter(boundary, math.inf)
                if turns_late > now:
                    late_at = turns_late
            continue
        admitted.append((item, True, prompt, need_kv, False))
        took = True
        waiting_sum += prompt
        waiting_squares += prompt * prompt
        budget_left -= prompt
        kv_left -= need_kv
        free_seqs -= 1
        done = (
            free_seqs <= 0
            or kv_left <= 0
            or budget_left <= 0
            or kv_left < queue_min_need
            or misses >= scan_after_admit
        )
    if params.late_backfill and budget_left is not None:
        chosen: set[str] | None = None  # (made once a candidate is reached: often none is)
        misses = 0
        i = 0
        while i < len(items) or grow():
            item = items[i]
            i += 1
            if (
                free_seqs <= 0
                or budget_left <= 0
                or kv_left < max(1, queue_min_need)
                or misses >= params.scan_after_admit
            ):
                break
            view = item.view
            if chosen is None:
                chosen = {item.view.request_id for item, *_ in admitted}
            if view.request_id in chosen:
                continue
            if bound and _elsewhere(view, worker, adapters_held):
                continue
            prompt = view.prompt_tokens
            need_kv = prompt + view.max_output_tokens
            if cached is not None:
                prompt, kv_prompt, leave_until = _uncached(turn, item, engine_id)
                if leave_until >= now:
                    if leave_until == now:
                        left = True
                    else:
                        late_at = min(late_at, leave_until)
                        slack_bound = True
                    continue
                need_kv = kv_prompt + view.max_output_tokens
            # strictly within what is left: a long late prompt must not stretch the turn that
            # the next urgent arrival waits behind (it still goes to an idle worker)
            if prompt > budget_left or need_kv > kv_left:
                misses += 1
                continue
            if view.arrival + item.ttft_slo >= now + (a + b * prompt + c * (prompt * prompt)):
                continue  # still feasible somewhere: leave it for a worker that can make it
            admitted.append((item, False, prompt, need_kv, True))
            budget_left -= prompt
            kv_left -= need_kv
            free_seqs -= 1
    if not admitted and not shadow.count and params.idle_backfill and candidates:
        # An idle worker takes the head if its prompt fits: a max_tokens as large as the context
        # (common, and accepted by vLLM) would otherwise never fit anywhere and only time out.
        # (the first request this engine may serve: one whose LoRA adapter another engine has
        # is not this one's to take, idle or not, and must not hold back the rest)
        head = next((c for c in candidates.items if not _elsewhere(c.view, worker, adapters_held)), None)
        if head is None:
            return admitted, late_at, False, True, left
        prompt = kv_prompt = head.view.prompt_tokens
        leave_until = -math.inf
        if cached is not None:
            prompt, kv_prompt, leave_until = _uncached(turn, head, engine_id)
        if leave_until >= now:  # left to a worker holding more of it, as in the scans above
            if leave_until == now:
                left = True
            else:
                late_at = min(late_at, leave_until)
                slack_bound = True
        elif head.view.prompt_tokens < worker.free_kv_tokens:
            # (a head that only fitted nowhere else, its TTFT still within reach, is not late)
            late = head.view.arrival + head.ttft_slo < now + (a + b * prompt + c * (prompt * prompt))
            admitted.append((head, False, prompt, kv_prompt + head.view.max_output_tokens, late))
    return admitted, late_at, not candidates, slack_bound, left


def _classes(turn: _Turn) -> Mapping[str, tuple[float, int]]:
    classes = turn.memo.get("classes")
    if classes is None:
        assert turn.engine_classes is not None
        classes = turn.memo["classes"] = turn.engine_classes()
    return classes


def _class_elsewhere(
    turn: _Turn, engine_id: str, tpot: float, need_kv: int, oversized: bool, decode_s: float
) -> bool:
    """Whether a candidate with TPOT target ``tpot`` is left by the worker ``engine_id`` to an
    engine of its own class (see ``HyperFlexisParams.tpot_segregation``): two engines each
    serving one class keep more streams within their TPOT than two that mix them, when a laxer
    class's prefills would stall the tighter class's decode steps. Only to an engine of the
    candidate's own class (or an idle one, for a laxer candidate) whose KV could ever hold it:
    there no rule leaves it again, so it is never passed back and forth."""
    ratio = turn.params.segregate_ratio
    classes = _classes(turn)
    mine = classes.get(engine_id, (math.inf, 0))[0]
    if mine == math.inf:
        return False
    if tpot > ratio * mine:  # laxer than most of what runs here
        if not oversized:
            return False  # its prefill fits this worker's streams' TPOT budget
        idle_counts = True
    elif mine > ratio * tpot:  # tighter than most of what runs here
        if decode_s < 0.5 * tpot:
            return False  # this engine's steps are far within its TPOT: nothing to protect
        idle_counts = False
    else:
        return False
    low, high = tpot / ratio, tpot * ratio
    return any(
        e != engine_id and kv >= need_kv and (low <= c <= high or (idle_counts and c == math.inf))
        for e, (c, kv) in classes.items()
    )


def _elsewhere(view: RequestView, worker: WorkerView, adapters_held: frozenset[str]) -> bool:
    """The request is pinned to another engine, or names a LoRA adapter held elsewhere only."""
    return (view.engine is not None and view.engine != worker.engine_id) or _adapter_elsewhere(
        view, worker, adapters_held
    )


def _adapter_elsewhere(view: RequestView, worker: WorkerView, adapters_held: frozenset[str]) -> bool:
    """The request names a LoRA adapter that this worker's engine lacks and another has."""
    lora = view.lora
    return lora is not None and lora not in worker.adapters and lora in adapters_held


def _uncached(turn: _Turn, item: QueuedRequest, engine_id: str) -> tuple[int, int, float]:
    """The prompt tokens ``engine_id`` would prefill for the request (what it does not hold
    cached) and find KV for (what running requests there do not share), and until when the
    request is left to another worker: one holding at least ``prefix_margin`` of the prompt more
    whose look comes later in this call (``now``: it looks before this worker looks again) or soon
    (its maturity, while that is within ``prefix_max_wait`` of the request's TTFT target since it
    arrived; the end of that wait). ``-inf``: not left."""
    assert turn.cached is not None
    view = item.view
    prompt = view.prompt_tokens
    held = turn.cached(view.request_id)
    if held is None or not held.cached or prompt <= 0:
        return prompt, prompt, -math.inf
    cached = held.cached
    params = turn.params
    mine = cached.get(engine_id, 0.0)
    enough = mine + max(1.0 / prompt, params.prefix_margin)
    loads = turn.loads
    # the imbalance bound: the most running requests a worker may have to be left a request
    load = loads.get(engine_id, 0)
    bound = max(load + params.prefix_max_spread, params.prefix_max_ratio * load)
    pending = turn.pending
    if pending and any(n >= enough and loads.get(e, 0) <= bound for e, n in cached.items() if e in pending):
        return prompt, prompt, turn.now
    soon = turn.soon
    if soon:
        wait_ends = view.arrival + params.prefix_max_wait * item.ttft_slo
        if wait_ends > turn.now and any(
            n >= enough and e in soon and soon[e][0] <= wait_ends and soon[e][1] <= bound
            for e, n in cached.items()
        ):
            return prompt, prompt, wait_ends
    shared = held.shared.get(engine_id, 0.0)
    return prompt - min(prompt, int(mine * prompt)), prompt - min(prompt, int(shared * prompt)), -math.inf


def _requests(worker: WorkerView) -> int:
    return worker.load.requests if worker.load is not None else len(worker.running)


def shortened_maturity(
    turn_at: float, maturity: float, predicted_prefill_s: float, now: float, params: HyperFlexisParams
) -> float:
    """A held worker's maturity once every prefill it was given has produced its first token.

    The hold after a turn amortises that turn's predicted prefill (Algorithm 1). When the engine
    finishes the prefills sooner than predicted (its prior is slower than it is), the hold shrinks
    in proportion to what the prefill really took, so a fast engine is not paced by a slow prior;
    never below ``recheck_s`` after the turn. A prefill slower than predicted changes nothing (the
    hold already ran out, or will).
    """
    if maturity <= now or predicted_prefill_s <= 0.0:
        return maturity
    actual = max(0.0, now - turn_at)
    if actual >= predicted_prefill_s:
        return maturity
    scaled = turn_at + (maturity - turn_at) * (actual / predicted_prefill_s)
    return min(maturity, max(turn_at + params.recheck_s, scaled, now))


def _budget_left(
    worker: WorkerView,
    shadow: _Shadow,
    item: QueuedRequest,
    decode_s: float,
    tightest_ttft_s: float,
    params: HyperFlexisParams,
) -> int:
    """Eq.(5)'s prompt tokens for the worker's turn, less what the turn took already, with the
    tightest targets among what runs there, the fleet and the turn's first candidate."""
    its_tpot = item.tpot_slo if item.tpot_slo >= shadow.tpot_floor else math.inf
    tpot = min(shadow.min_tpot, its_tpot) * params.tpot_plan
    ttft = min(tightest_ttft_s, item.ttft_slo) * params.budget_ttft_share
    # a turn's prefill must also amortise within the longest hold (its maturity time is
    # E_p * TPOT / (TPOT - E_d)): with eq.(5)'s horizon alone a lax TTFT allowed prefills
    # that max_hold_s then cut short, and running streams' TPOT paid for it
    horizon = min(ttft, params.max_hold_s)
    fixed, per_token, _ = worker.prefill_coeffs
    if params.mixed_steps and shadow.count > shadow.waiting:
        # (an idle worker's first prefill runs alone and pays its fixed cost itself)
        fixed = max(0.0, fixed - worker.decode_coeffs[0])
    return token_budget(horizon, tpot, decode_s, fixed, per_token) - shadow.prefill_taken


#: :func:`dispatch` decides one arrival for one worker by :func:`_alone` (tests compare it with
#: the whole algorithm by turning this off)
ALONE_SHORTCUT = True
#: :func:`_fill_worker` skips capacity misses by its tight loop (tests compare it with the full
#: tests by turning this off)
TIGHT_SCAN = True


def _alone(
    item: QueuedRequest,
    worker: WorkerView,
    now: float,
    params: HyperFlexisParams,
    tightest_ttft_s: float,
    late_last: OrderContext | None,
    queue_min_need: int,
    cached: PrefixLookup | None,
    adapters_held: frozenset[str],
) -> HyperFlexisDecision | None:
    """:func:`dispatch`'s decision for one request and one mature worker when the worker takes
    it, without the machinery of a turn over a queue: at low load every arrival is this case (an
    idle engine, or one whose hold the arrival joins). ``None`` where the case is not this simple
    (a prefix lookup, a LoRA adapter held somewhere, TPOT classes to keep apart, a worker that
    would take nothing): the whole algorithm then decides. The same comparisons in the same
    order as :func:`_fill_worker` and :func:`dispatch` (tests/policies/test_hyperflexis.py holds
    the two equal)."""
    view = item.view
    prompt = view.prompt_tokens
    if (
        not worker.maturity <= now  # (as dispatch's turn order reads it: NaN is not mature)
        or (cached is not None and params.prefix_preference)
        or (adapters_held and view.lora is not None)
        or view.engine is not None
    ):
        return None
    shadow = _Shadow(worker)
    a, b, c = worker.prefill_coeffs
    deadline = view.arrival + item.ttft_slo
    need_kv = prompt + view.max_output_tokens
    late_rejected = params.theta >= 0.5
    decode_s = shadow.decode_step(worker.decode_coeffs)
    kv_left = worker.free_kv_tokens
    took = worker.joining is not None
    if shadow.count and kv_left < queue_min_need:
        return None  # (it takes nothing)
    feasible = False
    if not (
        worker.max_num_seqs - shadow.count <= 0
        or kv_left <= 0
        or (took and (kv_left < queue_min_need or params.scan_after_admit <= 0))
    ):
        # the first candidate of _fill_worker's scan
        budget_left = _budget_left(worker, shadow, item, decode_s, tightest_ttft_s, params)
        if (
            params.tpot_segregation
            and shadow.count > 0
            and (
                shadow.max_tpot > params.segregate_ratio * shadow.min_tpot
                or item.tpot_slo > params.segregate_ratio * shadow.min_tpot
                or shadow.max_tpot > params.segregate_ratio * item.tpot_slo
            )
        ):
            return None  # (whether it is left to an engine of its class: the whole turn says)
        elif (
            late_last is not None
            and late_rejected
            and c >= 0.0
            and a >= late_last.prefill_base_s * (1.0 - 1e-9)
            and b * late_last.prefill_tokens_per_s >= 1.0 - 1e-9
            and now
            > deadline
            - (late_last.prefill_base_s + (prompt if prompt > 0 else 0) / late_last.prefill_tokens_per_s)
        ):
            pass  # late on the lane's estimate
        elif (
            (prompt > budget_left and took)
            or need_kv > kv_left
            or (late_rejected and deadline < now + a + b * prompt + c * prompt * prompt)
        ):
            pass  # no room in the turn's budget or KV; or late even on an idle worker
        else:
            expected = (
                a + b * (shadow.waiting_tokens + prompt) + c * (shadow.waiting_squares + prompt * prompt)
            )
            utilization = shadow.count / max(1, worker.max_num_seqs)
            p = admission_probability(
                view.arrival, item.ttft_slo, now, expected, utilization, params.slack_scale
            )
            feasible = not p < params.theta  # (as _fill_worker tests it: a NaN p is admitted)
    late = False
    if not feasible:
        # an idle worker's backfill of the head (_fill_worker's last step)
        if shadow.count or not params.idle_backfill or not prompt < worker.free_kv_tokens:
            return None
        end = now + (a + b * prompt + c * (prompt * prompt))
        if not (deadline < end or deadline >= end):
            return None  # (NaN: late backfill and idle backfill would read it differently)
        late = deadline < end
    shadow.add(prompt, item.tpot_slo, need_kv)
    at, e_p = _next_maturity(worker, shadow, now, True, math.inf, params)
    engine_id = worker.engine_id
    return HyperFlexisDecision(
        (Assignment(view.request_id, engine_id, feasible, 0, 0, late),),
        {engine_id: at},
        math.inf,
        frozenset(),
        {engine_id: e_p},
        {engine_id: shadow.prefill_taken},
    )


def _next_maturity(
    worker: WorkerView,
    shadow: _Shadow,
    now: float,
    took_work: bool,
    late_at: float,
    params: HyperFlexisParams,
) -> tuple[float, float]:
    """The worker's next maturity time, and the prefill time (eq.(1)) it amortises."""
    if not took_work:
        # nothing fitted: only an event (or a candidate turning late) can change that
        return late_at, 0.0
    e_p = shadow.prefill(worker.prefill_coeffs)
    e_d = shadow.decode_step(worker.decode_coeffs)
    min_tpot = shadow.min_tpot * params.tpot_plan
    # A chunked-prefill engine runs the new prompts inside decode steps: each step that carries a
    # chunk also pays E_d, so a turn costs at least E_p + E_d even when relax is large. (The whole
    # E_p, with mixed_steps too: amortising only what the prefill adds to a decode step, E_p - a_d,
    # cost TPOT-bound streams 8 points offline on half-speed engines, 73 % against 81 %.)
    held = max(maturity_time(now, e_p, e_d, min_tpot), now + e_p + e_d)
    return min(now + params.max_hold_s, max(now + params.recheck_s, held)), e_p
