"""The dispatch core: per-model admission queues and the decisions of the dispatch loop, clock-free.

Everything here is synchronous and reads no clock: every call takes ``now``, and results go to
:attr:`DispatchCore.outbox` as ``(request id, engine record or error)``. The live gateway drives it
from an asyncio task (:mod:`gateway.dispatch.loop`); a virtual-time simulator can drive the same
object with its own clock.

Contracts:

* **One id, one live request.** Tickets are keyed by the gateway's internal request id; a
  duplicate is refused, never merged.
* **Capacity is reserved at assignment.** An assignment calls :meth:`Fleet.reserve` before it is
  reported, so the next assignment in the same pass already sees it; the serving flow releases it
  with :meth:`Fleet.release` when the request leaves the engine.
* **Per-model queues.** One model's backlog never holds back another model's engines.
* **Event driven.** Work happens on arrivals, on engine changes (release, first token, scrape,
  health; see :meth:`Fleet.listeners`), on HyperFlexis maturity times and on queue expiry
  (:meth:`next_wake`). A saturated fleet is not polled: a HyperFlexis worker that took nothing
  waits for an event on itself, an arrival, or the moment a skipped request turns late.
* **Bounded scans.** The pipeline dispatcher looks at the queue head only; HyperFlexis examines
  at most ``max_scan`` requests per mature worker; the queue-full prune looks at a few of the
  class's earliest TTFT deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.dispatch.window_min import WindowMax, WindowMin
from gateway.dispatch.workers import MAX_NUM_SEQS, HyperFlexisWorkers
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from gateway.router import Router
from policies.admission_queue import AdmissionQueue
from policies.api import RequestView
from policies.demotion import Band, BandRates, Member, band_of, demote_in_bands
from policies.flow_control import PoolLoad, ShedCandidate, SheddingParams, saturated, shed_victim
from policies.hyperflexis import HyperFlexisParams, PrefixLookup, WorkerView, kv_bound
from policies.hyperflexis import dispatch as hyperflexis_dispatch
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL, Coeffs
from policies.queue_order import (
    LateLast,
    OrderContext,
    QueuedRequest,
    QueueOrder,
    last_feasible_start,
    marginal_service_s,
    ttft_infeasible,
    with_batch,
    with_demotion,
)

#: parked HyperFlexis workers given a fresh look at each arrival of their model (bounds the cost
#: of an arrival when many workers are parked; the others wait for their own events)
UNPARK_PER_ARRIVAL = 4
#: held workers an arrival to an empty queue may join when none is mature (oldest holds first)
JOIN_LOOK = 2
#: queued requests a pipeline dispatch looks past a head that no engine can take, for requests
#: that other engines could (a LoRA adapter's requests go only where it is loaded)
PIPELINE_LOOKAHEAD = 32
#: how long a late timer counts in the loop's lateness (seconds): long enough to span a stall,
#: short enough that holds return to what the model says soon after it
LAG_WINDOW_S = 2.0
#: lateness counted at all (seconds): a busy loop runs its steps a few milliseconds late as a
#: matter of course, and compensating that (each worker's turn earlier, so more turns) only made
#: it busier (slogate bench dispatch, 256 engines: 128 -> 136-147 µs a placement)
LAG_MIN_S = 0.005
#: queued requests (from the head) whose prefix holders join a HyperFlexis turn that prefers them
PREFIX_HOLDERS_SCAN = 8
#: earliest-deadline requests of a full class examined for the queue-full prune
PRUNE_SCAN = 8
#: the prune's deadlines of a class with a queue limit below this are kept while it empties (at
#: most a few hundred entries); a larger class's are dropped once it is half empty
PRUNE_KEEP_BELOW = 64
#: batch members stamped together when one joins (bounds the cost of a client's huge batch)
MAX_BATCH = 64


#: HyperFlexis's demotions (``demote_longest``) are planned again at most this often per model
#: (seconds), and no more often than DEMOTE_PER_QUEUED_S per queued request: the plan reads the
#: whole queue, so at 10,000 queued it runs once a second, a few percent of the loop
DEMOTE_PERIOD_S = 0.1
DEMOTE_PER_QUEUED_S = 0.0001
#: a plan later than this past the last one (plus two periods) found the queue empty in between
DEMOTE_MAX_GAP_S = 1.0
#: queued requests a demotion plan reads per step (about a millisecond)
DEMOTE_SLICE = 1000
#: a model's queue context (its fastest engine's latency model) is recomputed at most this often
CONTEXT_REFRESH_S = 1.0
#: how far an explicit, laxer TTFT may stretch its class's queue timeout
MAX_TIMEOUT_SCALE = 20.0
#: a model counts as backlogged (:meth:`DispatchCore.backlogged`) this long after a request last
#: stopped waiting for an engine: under HyperFlexis a saturated engine's queue empties every time
#: a worker takes its head (on the priority ramp 0.25 s left most of the mapper's collapse, 1-30 s
#: none)
BACKLOG_MEMORY_S = 1.0


@dataclass(frozen=True, slots=True)
class ClassLimits:
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    #: the class's own TTFT target: a request granted a laxer one (an explicit x-slo-ttft-ms)
    #: may wait in the queue proportionally longer (None: the timeout is fixed)
    class_ttft_s: float | None = None

    def timeout_for(self, ttft_s: float) -> float:
        if self.class_ttft_s and ttft_s > self.class_ttft_s:
            # at most MAX_TIMEOUT_SCALE x the class's: a day-long claim must not hold a queue slot
            # for days
            return self.queue_timeout_s * min(MAX_TIMEOUT_SCALE, ttft_s / self.class_ttft_s)
        return self.queue_timeout_s


@dataclass(slots=True)
class Ticket:
    """One request waiting for an engine. ``entry`` is what its reservation will hold."""

    item: QueuedRequest
    slo_class: str
    entry: RunningEntry
    enqueued_at: float
    #: the client's batch (requests that are only useful together, MFS), scoped by its tenant
    batch: tuple[str, str] | None = None

    @property
    def request_id(self) -> str:
        return self.item.view.request_id


Outcome = tuple[str, "EngineRecord | GatewayError"]


#: what demotion plans keep of a queued request: its ticket's admission number (the row is that
#: ticket's), its band, its rank in the band, and its member (rank, last feasible start,
#: predicted engine time, id) with the context that was computed under. Under a standing queue
#: each plan re-reads every request: a row is looked up, and only a new context (a re-fit of the
#: fastest engine's latency model) recomputes the member's two times
_PlanRow = tuple[int, Band, OrderContext, Member]


@dataclass(slots=True)
class _DemotionPlan:
    """A demotion plan under way: the queue as it was when the plan began, read a slice a step."""

    items: list[QueuedRequest]
    ctx: OrderContext
    period: float
    started: float
    #: what plans keep of each queued request (:meth:`DispatchCore._plan_rows_for`)
    cache: dict[str, _PlanRow]
    at: int = 0
    #: what the plan read so far: each band's requests that were on time
    members: dict[Band, list[Member]] = field(default_factory=dict)
    waiting: set[Band] = field(default_factory=set)
    demoted: list[str] = field(default_factory=list)
    bands: dict[tuple[int, float, float], Band] = field(default_factory=dict)


def _plan_row(
    item: QueuedRequest, ctx: OrderContext, bands: dict[tuple[int, float, float], Band], old: _PlanRow | None
) -> _PlanRow:
    """A demotion plan's row of a queued request; ``old``, its row under another context."""
    view = item.view
    if old is not None and old[0] == item.seq:
        band, rank = old[1], old[3][0]
    else:
        # by targets, not class name (a class may be a priority level's, whatever the task);
        # each distinct set looked up once per plan
        targets = (view.priority, item.ttft_slo, item.tpot_slo)
        known = bands.get(targets)
        band = bands[targets] = band_of(*targets) if known is None else known
        # the order the queue serves a band in (SloTpot, past its level)
        rank = (item.tpot_slo, view.arrival, float(item.seq))
    member = (rank, last_feasible_start(item, ctx), marginal_service_s(view, ctx), view.request_id)
    return (item.seq, band, ctx, member)


#: the code of the 503 a request gets when no engine in rotation can take it (counted in
#: ``slogate_no_engine_total`` where the answer goes out, once per request: an attempt's outcome
#: may still be mended by another)
NO_HEALTHY_ENGINE = "no_healthy_engine"


def model_not_found(model: str, served: Collection[str]) -> GatewayError:
    """The 404 for a request naming a model no engine of the fleet serves."""
    listed = ", ".join(sorted(served)) or "none"
    return GatewayError(
        404,
        f"model {model!r} is not served here; available models: {listed}",
        param="model",
        code="model_not_found",
    )


def no_healthy_engine(model: str, why: str) -> GatewayError:
    """The 503 (with Retry-After) for a request of ``model`` that no engine in rotation can take
    now."""
    return GatewayError(503, f"{why}; retry later", code=NO_HEALTHY_ENGINE, retry_after_s=1.0)


def _order_context(prefill: Coeffs, decode: Coeffs, engines: int) -> OrderContext | None:
    """The queue orders' estimates from (the fastest) prefill and decode coefficients; None when
    any is negative or not finite."""
    a, b, _ = prefill
    a_d, b_d, c_d = decode
    if not all(math.isfinite(x) and x >= 0 for x in (a, b, a_d, b_d, c_d)):
        return None
    return OrderContext(
        prefill_tokens_per_s=1.0 / b if b > 1e-12 else 1e9,
        decode_step_s=max(a_d, 1e-6),
        prefill_base_s=a,
        prefill_engines=max(1, engines),
        decode_seq_s=c_d,
        decode_context_s=b_d,
    )


def _need(view: RequestView) -> int:
    """The KV a request needs at most (its prompt and output bound), as the queue's min_need counts."""
    return view.prompt_tokens + view.max_output_tokens


def _rid_of(item: QueuedRequest | None) -> str | None:
    # orders may store a re-stamped copy of the item: compare ids, not objects
    return None if item is None else item.view.request_id


class DispatchCore:
    def __init__(
        self,
        fleet: Fleet,
        router: Router,
        order: QueueOrder,
        coefficients: Callable[[str], tuple[Coeffs, Coeffs]],
        limits: Callable[[str], ClassLimits],
        hyperflexis: HyperFlexisParams | None = None,
        max_engine_load: int | None = None,
        tightest_ttft_s: float = math.inf,
        shedding: SheddingParams | None = None,
    ) -> None:
        self.fleet = fleet
        self.router = router
        # HyperFlexis's first pass skips late requests; keeping them behind the rest lets it stop
        # at the first one (see LateLast) instead of re-reading them on every turn under overload
        late_last = hyperflexis is not None and hyperflexis.theta >= 0.5
        self.order: QueueOrder = LateLast(order) if late_last else order
        self.coefficients = coefficients
        self.limits = limits
        self.hyperflexis = hyperflexis
        self.max_engine_load = max_engine_load
        self.tightest_ttft_s = tightest_ttft_s
        #: per model, the tightest TTFT target among recent arrivals (HyperFlexis eq.(5))
        self._recent_ttft: dict[str, WindowMin] = {}
        #: per model, the LoRA adapters loaded on its engines in rotation (see _adapters_held)
        self._adapters: dict[str, frozenset[str]] = {}
        #: shed under saturation (llm-d flow control): the least urgent band's newest first
        self.shedding = shedding
        #: per model and band (priority), the queued tickets newest first: (-seq, id), lazily pruned
        self._band_newest: dict[str, dict[int, list[tuple[int, str]]]] = {}
        #: queued tickets per (model, band): a band whose last ticket left is dropped at once, so
        #: the index stays as large as the priorities actually queued
        self._band_live: dict[tuple[str, int], int] = {}
        self.queues: dict[str, AdmissionQueue] = {}
        self.tickets: dict[str, Ticket] = {}
        #: queued requests per (model, SLO class): a class's limit applies within one model's queue
        self.queued_per_class: dict[tuple[str, str], int] = {}
        #: set by the driver when it stops: later arrivals are refused, never queued
        self.closed = False
        #: assignments and refusals of queued tickets, for the driver to deliver
        self.outbox: list[Outcome] = []
        #: called when there is work for :meth:`step` (the driver wakes its task)
        self.wake: Callable[[], None] = lambda: None
        #: the driver's clock (the time base of every ``now`` it passes), for engine events, which
        #: come without one; None: such an event wakes a step instead
        self.clock: Callable[[], float] | None = None
        self._dirty: set[str] = set()
        #: how late the driver ran the steps it was asked for (:meth:`next_wake`), at most over the
        #: last LAG_WINDOW_S: an arrival may take a HyperFlexis worker maturing within that (a
        #: loop running late by L handled the arrival L late already, and its timers fire L late:
        #: a tight TTFT paid the lateness twice, once more waiting for the worker's timer)
        self._lateness = WindowMax(LAG_WINDOW_S)
        self.lag = 0.0
        self._due = math.inf
        self._stepped_at = -math.inf
        self._submitting: str | None = None
        self._own: EngineRecord | None = None
        #: per (model, class), the queued requests' TTFT deadlines as a heap, for the queue-full
        #: prune: kept only from the first time the class is full until it is half empty (kept
        #: for every class, its O(n) clean-ups stalled the loop 10-60 ms at 10,000 queued)
        self._class_deadlines: dict[tuple[str, str], list[tuple[float, int, str]]] = {}
        #: queued members of each client batch (request ids), for orders that rank whole batches
        self._batches: dict[tuple[str, str, str], set[str]] = {}
        #: HyperFlexis engines between turns (maturity times, parked engines)
        self.workers = HyperFlexisWorkers(fleet, coefficients, max_engine_load)
        #: a model without engines, or whose fits are unusable: the default prior's estimates
        #: (its decode terms too: the demotion plan charges requests by them)
        default = _order_context(DEFAULT_PREFILL, DEFAULT_DECODE, 1)
        assert default is not None
        self._default_context = default
        #: per model: when its queue context was computed, and the context
        self._contexts: dict[str, tuple[float, OrderContext]] = {}
        self._seq = 0
        #: the queue order stamps fair rounds at admission: every arrival goes through the queue
        self._flow_order: bool = getattr(self.order, "uses_flows", False)
        #: per model: each SLO band's measured drain and when demotions are planned next
        self._demote = (
            hyperflexis is not None and hyperflexis.demote_longest and getattr(order, "uses_demotion", False)
        )
        self._band_rates: dict[str, BandRates] = {}
        self._demote_due: dict[str, float] = {}
        #: per model, the demotion plan under way (read a slice of the queue per step)
        self._demote_plans: dict[str, _DemotionPlan] = {}
        #: per model, what plans keep of each queued request (what does not change while it waits:
        #: at 10,000 queued looking it up again was most of each plan)
        self._plan_rows: dict[str, dict[str, _PlanRow]] = {}
        #: per model, when a request that had waited for an engine last left the queue
        self._waited_at: dict[str, float] = {}
        #: a request pinned to one engine was submitted (see _bound_requests)
        self._pinned_seen = False
        #: queued requests pinned to each engine: refused at once when it leaves rotation
        self._pinned_to: dict[str, set[str]] = {}
        fleet.listeners.append(self._on_engine_change)

    def ticket(
        self,
        view: RequestView,
        ttft_slo: float,
        tpot_slo: float,
        slo_class: str,
        entry: RunningEntry,
        now: float,
        batch: tuple[str, str] | None = None,
    ) -> Ticket:
        """A request as the core queues it: numbered in arrival order, with its class's queue
        deadline. Every driver (the live loop, the offline simulator) makes tickets here."""
        self._seq += 1
        item = QueuedRequest(
            view=view,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            seq=self._seq,
            queue_deadline=now + self.limits(slo_class).timeout_for(ttft_slo),
        )
        return Ticket(item, slo_class, entry, now, batch)

    # -- reads -----------------------------------------------------------------------------------

    def queued(self, model: str | None = None) -> int:
        if model is None:
            return len(self.tickets)
        queue = self.queues.get(model)
        return 0 if queue is None else len(queue)

    def backlogged(self, model: str, now: float) -> bool:
        """Whether requests for ``model`` wait for an engine at ``now``, or one stopped waiting
        within BACKLOG_MEMORY_S: the priority mapper's sign of a fleet that is not underloaded
        (see :func:`policies.priority_mapping.assign`)."""
        if self.queued(model):
            return True
        waited = self._waited_at.get(model)
        return waited is not None and now - waited < BACKLOG_MEMORY_S

    def context(self, model: str, now: float | None = None) -> OrderContext:
        """The queue orders' estimates for one model's queue: its fastest engine's latency model
        (so "late" means late on every engine that could take the request), and how many
        engines drain that queue. Recomputed at most every ``CONTEXT_REFRESH_S`` of ``now``
        (a pass over the model's engines; latency models change far more slowly)."""
        cached = self._contexts.get(model)
        if cached is not None and now is not None and now - cached[0] < CONTEXT_REFRESH_S:
            return cached[1]
        # the engines that take the queue's requests: not a P/D model's decode engines (which
        # never learn a prefill speed), nor those out of rotation; all of them while none is in
        # (a queue with no engine is refused, its context matters little)
        every = self.fleet.engines_of.get(model, ())
        engines = [r for r in every if self.fleet.in_front(r)] or every
        if not engines:
            return self._default_context
        # ...and the decode estimate from those that decode them (a P/D model's decode engines)
        decoding = [r for r in every if self.fleet.in_front(r) or self.fleet.in_decode_pool(r)] or every
        a = b = a_d = b_d = c_d = math.inf
        for record in engines:
            (pa, pb, _), _ = self.coefficients(record.engine_id)
            a, b = min(a, pa), min(b, pb)
        for record in decoding:
            _, (da, db, dc) = self.coefficients(record.engine_id)
            a_d, b_d, c_d = min(a_d, da), min(b_d, db), min(c_d, dc)
        # a bad profile or a degenerate fit must not stop every submit and step
        context = _order_context((a, b, 0.0), (a_d, b_d, c_d), len(engines)) or self._default_context
        if cached is not None and cached[1] == context:
            context = cached[1]  # the same object: the queue skips comparing what did not change
        self._contexts[model] = (now if now is not None else -math.inf, context)
        return context

    def next_wake(self, now: float | None = None) -> float:
        """When :meth:`step` must run absent events: a queue expiry or a HyperFlexis maturity.
        ``now``: the driver's clock as it arms the timer (what a wake due at once is late from)."""
        wake = math.inf
        for model, queue in self.queues.items():
            if not len(queue):
                continue
            wake = min(wake, queue.next_expiry())
            if self.hyperflexis is not None:
                wake = min(wake, self._maturity_timer(model))
        # (due at once, it is late by however long the driver takes to run the next step)
        self._due = max(wake, self._stepped_at if now is None else now)
        return wake

    def no_engine(self, model: str) -> GatewayError:
        if model not in self.fleet.served_models:
            return model_not_found(model, self.fleet.served_models)
        return no_healthy_engine(model, f"no healthy engine is serving model {model!r}")

    # -- arrivals, retries, cancellation ----------------------------------------------------------

    def submit(self, ticket: Ticket, now: float) -> EngineRecord | None:
        """Place ``ticket`` now (reserved, returned) or queue it (``None``); raises GatewayError
        when it is refused (unknown model, no healthy engine, class queue full)."""
        view = ticket.item.view
        model = view.model
        if self.closed:
            raise GatewayError(503, "gateway is shutting down", code="shutting_down", retry_after_s=1.0)
        if not self.fleet.has_healthy(model):
            raise self.no_engine(model)
        rid = view.request_id
        if rid in self.tickets:
            raise ValueError(f"request id {rid!r} is already queued")
        if view.engine is not None:
            self._pinned_seen = True
            home = self.fleet.records.get(view.engine)
            if home is None or not self.fleet.in_front(home):
                raise _pinned_engine_left(view.engine)
        queue = self.queues.get(model)
        if self.hyperflexis is None and (queue is None or not len(queue)):
            record = self._choose(ticket, (), now)
            if record is not None:
                # a zero wait, as HyperFlexis counts its placements at once: the histogram is
                # every placed request's wait, the same series whichever dispatcher runs
                metrics.deferred(metrics.QUEUE_WAIT, ticket.slo_class).observe(0.0)
                return record
        limits = self.limits(ticket.slo_class)
        bucket = (model, ticket.slo_class)
        if self.queued_per_class.get(bucket, 0) >= limits.max_queued and not self._prune(
            model, ticket.slo_class, now
        ):
            metrics.child(metrics.SHEDS, ticket.slo_class, "queue_full").inc()
            raise GatewayError(
                429,
                f"the {ticket.slo_class!r} queue is full; retry later",
                code="queue_full",
                retry_after_s=1.0,
            )
        if self.shedding is not None and self._shed_for_saturation(ticket, queue, now):
            metrics.child(metrics.SHEDS, ticket.slo_class, "saturated").inc()
            raise GatewayError(
                429,
                "the pool is saturated and this request is among the least urgent; retry later",
                code="pool_saturated",
                retry_after_s=1.0,
            )
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(self.order)
        if self.hyperflexis is None:
            behind, first_expiry, ctx = self._enqueue(ticket, queue, now)
            self._dirty.add(model)
            # Behind a head that waits for capacity a newcomer can go only once capacity frees,
            # and that wakes the loop itself: under saturation every arrival woke a turn that
            # placed nothing. It still wakes when it is the new head (a request-dependent pipeline
            # may place it where the old head did not fit) or expires before anything queued.
            if not behind or ticket.item.queue_deadline < first_expiry:
                self.wake()
                return None
            head = queue.peek(now, ctx)
            if _rid_of(head) == rid or (
                # with LoRA adapters a request of another adapter than the head's may go to
                # other engines at once (_dispatch_other_engines): no capacity need free for it
                self._bound_requests() and head is not None and _bound(head.view) != _bound(view)
            ):
                self.wake()
            return None
        # An arrival to an empty queue is the only request a worker's turn can look at: the turn
        # reads it from the ticket rather than through the queue (push, head, remove: the common
        # case at low load), and queues it only if the turn leaves it. Orders that stamp fair
        # rounds at admission (flow_control) and client batches always go through the queue.
        alone = not len(queue)
        at_once = alone and ticket.batch is None and not self._flow_order
        if at_once:
            self.queued_per_class.setdefault(bucket, 0)
        else:
            self._enqueue(ticket, queue, now)
        if self.hyperflexis.tightest_window_s > 0:
            # only admitted arrivals count (a refused one asks nothing of the engines)
            window = self._recent_ttft.get(model)
            if window is None:
                window = self._recent_ttft[model] = WindowMin(self.hyperflexis.tightest_window_s)
            window.add(ticket.item.ttft_slo, now)
        self.workers.fits_waiting(model, _need(view))
        self.workers.unpark_for_arrival(model, UNPARK_PER_ARRIVAL, now)
        for other in self.workers.shorten_holds(now, self.hyperflexis):
            if other != model and self.queued(other) and self._sooner(other):
                self._dirty.add(other)
                self.wake()
        self.lag = self._lateness.max(now)  # (arrivals may come for long without a step)
        mature = self.workers.next_mature(model) <= now + self.lag
        # No worker mature and nothing queued: the arrival may join a worker's hold while what
        # that engine has still to prefill leaves room in its turn's budget. Without it an engine
        # that took one request turned the next arrival away for the whole hold (at concurrency 8
        # in front of a fast engine the requests went in batches, each waiting for the last).
        joining = None if mature or not alone else self.workers.held(model, JOIN_LOOK, now)
        if mature or joining:
            # a worker can take work right now: decide in this call, not on the next loop turn
            self._submitting, self._own = rid, None
            try:
                self._dispatch_hyperflexis(model, now, ticket if at_once else None, self.lag, joining)
            except BaseException:
                if self._own is not None:  # never leave a reservation behind a failure
                    self.fleet.release(self._own.engine_id, rid)
                    self._own = None
                # nor a ticket: the caller is told the request failed, so nothing may place it
                self._forget(rid, None)
                # nor the queued requests the turn had taken out of the queue (answered, as a
                # failed step answers them: their waiters get it on this call's delivery)
                self._unstrand(model, now)
                raise
            finally:
                self._submitting = None
            own, self._own = self._own, None
            if own is not None:
                # (a worker that looked and took nothing may mature before the loop's timer)
                if self.outbox or (len(queue) and self._sooner(model)):
                    self.wake()
                return own
        if at_once:
            self._enqueue(ticket, queue, now)  # no worker took it at once: it waits
        # the ticket waits for a worker's maturity or its expiry: the loop must run if either
        # comes before its timer (under saturation each arrival woke a turn that took nothing)
        if self._sooner(model):
            self.wake()
        return None

    def _maturity_timer(self, model: str) -> float:
        """When the driver's timer must run for the model's next maturity: a loop late by L runs
        a timer L late, so it is armed L early (unless that is already past: then at its time,
        never at once, which would only spin)."""
        mature = self.workers.next_mature(model)
        early = mature - self.lag
        return early if early > self._stepped_at else mature

    def _sooner(self, model: str) -> bool:
        """Whether the model's next maturity or queue expiry (what :meth:`next_wake` would arm)
        comes before the time the driver's timer is armed for: a step must run (and re-arm)."""
        queue = self.queues[model]
        return self._maturity_timer(model) < self._due or (len(queue) > 0 and queue.next_expiry() < self._due)

    def _enqueue(self, ticket: Ticket, queue: AdmissionQueue, now: float) -> tuple[bool, float, OrderContext]:
        """Queue ``ticket`` (admitted already); returns whether a request was queued before it,
        the queue's earliest expiry before it, and the context it was keyed with."""
        view = ticket.item.view
        model, rid = view.model, view.request_id
        bucket = (model, ticket.slo_class)
        if ticket.batch is not None:
            self._join_batch(ticket, queue, now)
        behind = len(queue) > 0  # a head is already waiting (or about to be tried)
        first_expiry = queue.next_expiry()
        ctx = self.context(model, now)
        queue.push(ticket.item, now, ctx)
        self.tickets[rid] = ticket
        if view.engine is not None:
            self._pinned_to.setdefault(view.engine, set()).add(rid)
        self.queued_per_class[bucket] = self.queued_per_class.get(bucket, 0) + 1
        deadlines = self._class_deadlines.get(bucket)
        if deadlines is not None:
            heapq.heappush(deadlines, (ticket.item.ttft_deadline, ticket.item.seq, rid))
            if len(deadlines) > 64 + 2 * self.queued_per_class[bucket]:
                # entries of requests that left are dropped lazily; keep the heap O(live) all the same
                deadlines[:] = [e for e in deadlines if e[2] in self.tickets]
                heapq.heapify(deadlines)
        metrics.deferred(metrics.QUEUE_DEPTH, ticket.slo_class).inc()
        if self.shedding is not None:
            bands = self._band_newest.setdefault(model, {})
            newest = bands.setdefault(view.priority, [])
            heapq.heappush(newest, (-ticket.item.seq, rid))
            live = (model, view.priority)
            self._band_live[live] = self._band_live.get(live, 0) + 1
            if len(newest) > 64 + 2 * len(queue):
                newest[:] = [e for e in newest if e[1] in self.tickets]
                heapq.heapify(newest)
        return behind, first_expiry, ctx

    def retry(self, ticket: Ticket, exclude: Collection[str], now: float) -> EngineRecord:
        """Another engine for a request whose engine failed before its first byte: placed at once
        (it was admitted already), never on an engine in ``exclude``."""
        # (what the failed engine held is not on this one)
        ticket.entry.cached_tokens = ticket.entry.shared_tokens = 0
        # (a fresh reservation per attempt: one whose TTFT is gone by now stays in the late lane)
        ticket.entry.late = now >= ticket.item.ttft_deadline
        record = self._choose(ticket, exclude, now)
        if record is None:
            raise self.no_engine(ticket.item.view.model)
        return record

    def cancel(self, request_id: str, now: float) -> bool:
        """Take a queued request out (its client left); False when it is not queued."""
        ticket = self.tickets.get(request_id)
        if ticket is None or not self._forget(request_id, now):
            return False
        if self.hyperflexis is None and self._bound_requests():
            # a pipeline with LoRA adapters (or pinned requests) looks a bounded way past a
            # blocked head: one that left may bring a request engines can take within it now,
            # which waited otherwise for the model's next engine event
            self._dirty.add(ticket.item.view.model)
            self.wake()
        return True

    def reject_all(self, error: GatewayError, now: float) -> None:
        for rid in list(self.tickets):
            self._refuse(rid, "shutdown", error, now)

    # -- the loop's work ---------------------------------------------------------------------------

    def step(self, now: float) -> None:
        """Expire, then dispatch every model with news or a mature worker; results to the outbox."""
        if self._due <= now:
            if now - self._due > LAG_MIN_S:
                self._lateness.add(now - self._due, now)
            self._due = math.inf
        self._stepped_at = now
        self.lag = self._lateness.max(now)
        failed: Exception | None = None
        for model, queue in self.queues.items():
            if len(queue) and queue.next_expiry() <= now:
                if self.hyperflexis is None and self._bound_requests():
                    self._dirty.add(model)  # (as for a cancel: see cancel)
                try:
                    for item in queue.expire(now):
                        self._expired(item, now)
                except Exception as exc:
                    self._unstrand(model, now)  # (the rest of what expired left the queue too)
                    failed = failed or exc
        if self.hyperflexis is not None:
            self.workers.shorten_holds(now, self.hyperflexis)
            for model in self.workers.models:
                if self.queued(model) and self.workers.next_mature(model) <= now + self.lag:
                    self._dirty.add(model)
        pending, self._dirty = list(self._dirty), set()
        while pending:
            model = pending.pop()
            if not self.queued(model):
                self._demote_plans.pop(model, None)  # (what it read has left)
                continue
            try:
                # here, not in submit: the pass reads the whole queue, off the request's path
                if (
                    self._demote
                    and (model in self._demote_plans or now >= self._demote_due.get(model, -math.inf))
                    and not self._plan_demotions(model, self.queues[model], now)
                ):
                    self._dirty.add(model)  # the rest of the plan on the next step
                    self.wake()
                if self.hyperflexis is not None:
                    self._dispatch_hyperflexis(model, now, None, self.lag)
                else:
                    self._dispatch_pipeline(model, now)
            except Exception as exc:
                # one model's failure (a bug) must not hold back the others: they are
                # dispatched all the same, and it is tried again on the next step
                self._dirty.add(model)
                self._unstrand(model, now)
                failed = failed or exc
            except BaseException:
                self._dirty.update(pending)  # the other models still have news
                self._dirty.add(model)
                raise
        if failed is not None:
            raise failed

    def _dispatch_pipeline(self, model: str, now: float) -> None:
        queue = self.queues[model]
        ctx = self.context(model, now)
        while True:
            item = queue.peek(now, ctx)
            if item is None:
                return
            ticket = self.tickets[item.view.request_id]
            # the head waits for capacity; everything behind it in order waits too (the queue
            # order decides who goes first, not who happens to fit)
            record = self._choose(ticket, (), now, reserve=False)
            if record is not None:
                queue.pop(now, ctx)
                self._assign(ticket, record, now)
            elif not self._bound_requests() or not self._dispatch_other_engines(queue, ctx, item, now):
                return

    def _dispatch_other_engines(
        self, queue: AdmissionQueue, ctx: OrderContext, head: QueuedRequest, now: float
    ) -> bool:
        """With LoRA adapters, requests of one model may go to different engines (an adapter's
        only to those that have it loaded): when the head has no engine, the first request behind
        it (within PIPELINE_LOOKAHEAD) that other engines could take goes, each set of engines in
        queue order; True if one went. Without it, one adapter's backlog held its whole model.
        Requests pinned to an engine (:attr:`RequestView.engine`) are bound the same way."""
        blocked = {_bound(head.view)}
        for item in queue.head(now, ctx, PIPELINE_LOOKAHEAD):
            bound = _bound(item.view)
            if bound in blocked:
                continue
            ticket = self.tickets[item.view.request_id]
            record = self._choose(ticket, (), now, reserve=False)
            if record is None:
                blocked.add(bound)
                continue
            queue.remove(item.view.request_id)
            self._assign(ticket, record, now)
            return True
        return False

    def _bound_requests(self) -> bool:
        """Whether the model's requests may be bound to some of its engines (LoRA adapters loaded
        on some only, or requests pinned to one): then a head that has no engine does not hold
        back a request other engines could take."""
        return bool(self.fleet.adapter_bases) or self._pinned_seen

    def _dispatch_hyperflexis(
        self,
        model: str,
        now: float,
        arrival: Ticket | None = None,
        early: float = 0.0,
        joining: list[WorkerView] | None = None,
    ) -> None:
        """One HyperFlexis turn of the model's mature workers over its queue, or, with
        ``arrival`` (a ticket for the model's empty queue, not queued), over that ticket alone.
        ``early``: workers maturing that much later take part as mature (by the loop's lateness).
        ``joining``: held workers (:meth:`HyperFlexisWorkers.held`) that look at ``arrival``
        instead of the mature ones."""
        assert self.hyperflexis is not None
        queue = self.queues[model]
        # a worker that takes anything takes at least one request: more mature workers than
        # queued requests would only be looked at to stay mature (they keep their place)
        limit = len(queue) + (arrival is not None)
        if joining:
            workers = joining
        else:
            # the least KV the turn's requests need (as _run_hyperflexis reads it)
            min_need = queue.min_need() if arrival is None else _need(arrival.item.view)
            workers, parked = self.workers.pop_mature(model, now, limit, early, min_need)
            if not workers and not parked:
                return
        lookup: PrefixLookup | None = None
        soon: dict[str, tuple[float, int]] = {}
        try:
            if self.hyperflexis.prefix_preference and self.router.prefix is not None:
                lookup, soon = self._prefix_holders(model, queue, workers, now, arrival, limit, early)
            self._run_hyperflexis(model, queue, workers, now, arrival, lookup, soon)
        except BaseException:
            # a bug must not strand the workers it had popped: they stay mature for the next try
            # (joining ones were not popped; holders of a prefix taken beside them were)
            for worker in workers:
                if worker.joining is None:
                    self.workers.set(model, worker.engine_id, worker.maturity)
            raise

    def _prefix_holders(
        self,
        model: str,
        queue: AdmissionQueue,
        workers: list[WorkerView],
        now: float,
        arrival: Ticket | None,
        limit: int,
        early: float,
    ) -> tuple[PrefixLookup | None, dict[str, tuple[float, int]]]:
        """The prefix index's lookup for this turn; added to ``workers``, the mature workers
        holding a prefix of the requests the turn will look at first (``pop_mature`` takes only as
        many workers as there are requests, which are rarely the ones holding their prompts); and
        the maturity of the holders not mature yet."""
        assert self.router.prefix is not None
        maturity = self.workers.maturity
        engines = [r.engine_id for r in self.fleet.engines_of.get(model, ()) if r.engine_id in maturity]
        lookup = self.router.prefix.lookup(engines, now)
        if lookup is None:
            return None, {}
        first = (
            (arrival.item,)
            if arrival is not None
            else queue.head(now, self.context(model, now), min(limit, PREFIX_HOLDERS_SCAN))
        )
        looking = {w.engine_id for w in workers}
        holders: dict[str, None] = {}
        for item in first:
            held = lookup(item.view.request_id)
            for engine_id in () if held is None else held.cached:
                if engine_id not in looking:
                    holders[engine_id] = None
        workers.extend(self.workers.take_mature(model, holders, now, early))
        records = self.fleet.records
        soon = {
            e: (at, records[e].seats_taken())
            for e in holders
            if now + early < (at := maturity[e]) < math.inf and self.fleet.in_front(records[e])
        }
        # past the head, only the workers of this turn and those maturing soon can be chosen:
        # matching every engine of the model for every request the turn reads would cost
        # max_scan x engines probes per turn
        return self.router.prefix.lookup([*(w.engine_id for w in workers), *soon], now), soon

    def _run_hyperflexis(
        self,
        model: str,
        queue: AdmissionQueue,
        workers: list[WorkerView],
        now: float,
        arrival: Ticket | None = None,
        lookup: PrefixLookup | None = None,
        soon: dict[str, tuple[float, int]] | None = None,
    ) -> None:
        assert self.hyperflexis is not None
        ctx = self.context(model, now)
        # what the queue would say holding the arrival alone
        min_need = queue.min_need() if arrival is None else _need(arrival.item.view)
        # Busy workers first in the turn with less KV free than any queued request needs take
        # nothing and wait for their own events, as the policy would say (kv_bound): under
        # saturation that is every worker whose hold ends before a completion frees its cache,
        # a turn per placement that read the queue's head for nothing.
        lead = 0
        while lead < len(workers) and workers[lead].joining is None and kv_bound(workers[lead], min_need):
            self.workers.park(model, workers[lead].engine_id, full=True)
            lead += 1
        if lead == len(workers):
            queue.peek(now, ctx)  # the queue's read at ``now`` (its re-keys) all the same
            return
        # Each worker reads at most max_scan past what earlier ones took; a pass that runs out
        # leaves the rest mature, and the next step (due at once) reads a fresh head.
        head: Iterable[QueuedRequest]
        if arrival is None:
            head = queue.head(now, ctx, 2 * self.hyperflexis.max_scan)
        else:
            queue.peek(now, ctx)  # adopts ctx as a push would: the late lane's context below
            head = (arrival.item,)
        looking = workers[lead:] if lead else workers
        decision = hyperflexis_dispatch(
            head,
            looking,
            now,
            self.hyperflexis,
            self._tightest(model, now),
            # the context the queue keyed its late part with (it lags ours within a tolerance)
            queue.context if isinstance(self.order, LateLast) else None,
            min_need,
            lookup,
            soon,
            self._adapters_held(model),
            lambda: self._tpot_classes(model),
            self._pinned_seen,
        )
        for assignment in decision.assignments:
            if arrival is not None:  # (the only request this turn could take)
                arrival.entry.cached_tokens = assignment.cached_tokens
                arrival.entry.shared_tokens = assignment.shared_tokens
                arrival.entry.late = assignment.late
                # (the prefix index, the affinity store and x-slogate-decision learn it as for any)
                self.router.assigned(arrival.item.view, assignment.engine_id, now)
                self.fleet.reserve(assignment.engine_id, arrival.request_id, arrival.entry)
                wait = max(0.0, now - arrival.enqueued_at)
                metrics.deferred(metrics.QUEUE_WAIT, arrival.slo_class).observe(wait)
                self._own = self.fleet.records[assignment.engine_id]
                if self._demote:
                    self._drained(arrival.item, now)
                continue
            assigned = self.tickets.get(assignment.request_id)
            queue.remove(assignment.request_id)
            if assigned is not None:  # (always, while queues hold only live tickets)
                assigned.entry.cached_tokens = assignment.cached_tokens
                assigned.entry.shared_tokens = assignment.shared_tokens
                assigned.entry.late = assignment.late
                self.router.assigned(assigned.item.view, assignment.engine_id, now)
                self._assign(assigned, self.fleet.records[assignment.engine_id], now)
        # the least KV a queued request needs now (what the hold's end would find)
        need = queue.min_need() if decision.prefill_s else 0
        for worker in looking:
            at = decision.maturity.get(worker.engine_id, worker.maturity)
            engine_id = worker.engine_id
            if worker.joining is not None:
                if engine_id in decision.prefill_s:  # it took the arrival: a hold as long or longer
                    joined = self.workers.maturity[engine_id]
                    # still timed from the turn it joined: the prefills predicted to end then
                    started = self.workers.hold_started(engine_id)
                    turn_at = now if started is None else started
                    self.workers.hold(
                        model,
                        engine_id,
                        max(at, joined),
                        turn_at,
                        now - turn_at + decision.prefill_s[engine_id],
                        decision.budget_taken[engine_id],
                    )
                continue  # (one that took nothing stays as it was)
            if at == math.inf:
                # a full worker waits for its own completions and scrapes; one held back by
                # slack may take the next arrival
                self.workers.park(model, worker.engine_id, full=worker.engine_id in decision.full)
            elif engine_id in decision.prefill_s:
                self.workers.hold(
                    model,
                    engine_id,
                    at,
                    now,
                    decision.prefill_s[engine_id],
                    decision.budget_taken[engine_id],
                    room=self._room_if_full(self.fleet.records[engine_id], need),
                )
            else:
                self.workers.set(model, worker.engine_id, at)

    def _room_if_full(self, record: EngineRecord, need: int) -> int | None:
        """When the engine, running what it just took, has no seat (-1) or less KV than a request
        needing ``need`` (the queue's least) takes, what it has: its turn would take nothing
        until an event on it or an arrival that fits. ``None`` when it has room."""
        if record.seats_taken() >= (self.max_engine_load or MAX_NUM_SEQS):
            return -1
        free_kv = record.free_kv_tokens()
        return free_kv if free_kv is not None and free_kv < need else None

    def _plan_demotions(self, model: str, queue: AdmissionQueue, now: float) -> bool:
        """Demote what each SLO band's drain cannot serve in time (Moore-Hodgson), and restore
        what it can again; closes the bands' drain-rate interval. The queue is read
        ``DEMOTE_SLICE`` requests per call (a plan over 10,000 queued held the event loop for
        10-50 ms at once, a stall in every stream): False while the plan is unfinished (the
        caller calls again on its next step)."""
        assert self.hyperflexis is not None
        plan = self._demote_plans.get(model)
        if plan is None or now - plan.started > DEMOTE_MAX_GAP_S:
            # (a plan left unfinished that long read a queue that has changed since: begin anew)
            period = max(DEMOTE_PERIOD_S, len(queue) * DEMOTE_PER_QUEUED_S)
            self._demote_due[model] = now + period
            plan = self._demote_plans[model] = _DemotionPlan(
                queue.items(), self.context(model, now), period, now, self._plan_rows_for(model, queue)
            )
        try:
            return self._plan_slice(model, queue, plan, now)
        except BaseException:
            # (not retried before every dispatch: the next plan is due a period from this one's start)
            self._demote_plans.pop(model, None)
            raise

    def _plan_rows_for(self, model: str, queue: AdmissionQueue) -> dict[str, _PlanRow]:
        """The model's cache of plan rows, holding no more than a few rows of requests that left
        the queue."""
        cache = self._plan_rows.get(model)
        if cache is None:
            cache = self._plan_rows[model] = {}
        elif len(cache) > 2 * len(queue) + 1024:
            queued = queue.ids()
            cache = self._plan_rows[model] = {rid: row for rid, row in cache.items() if rid in queued}
        return cache

    def _plan_slice(self, model: str, queue: AdmissionQueue, plan: _DemotionPlan, now: float) -> bool:
        assert self.hyperflexis is not None
        items = plan.items
        end = min(len(items), plan.at + DEMOTE_SLICE)
        ctx = plan.ctx
        cache, members, waiting, demoted = plan.cache, plan.members, plan.waiting, plan.demoted
        bands = plan.bands
        for item in items[plan.at : end]:
            rid = item.view.request_id
            row = cache.get(rid)
            if row is None or row[0] != item.seq or row[2] is not ctx:
                # (another ticket, the request queued again; or another context)
                row = cache[rid] = _plan_row(item, ctx, bands, row)
            band, member = row[1], row[3]
            if band not in waiting:
                waiting.add(band)
                members[band] = []
            if member[1] < now:
                continue  # late: the queue ranks it late whatever its stamp
            members[band].append(member)
            if item.demoted:
                demoted.append(rid)
        plan.at = end
        if end < len(items):
            return False
        del self._demote_plans[model]
        rates = self._band_rates.get(model)
        if rates is None:
            rates = self._band_rates[model] = BandRates()
        # a longer gap since the last plan means the queue was empty: not a drain sample
        rates.close(now, waiting, max_span=DEMOTE_MAX_GAP_S + 2 * plan.period)
        # (``now`` drops rows that went late meanwhile; read over several steps, requests that left
        # meanwhile no longer take the drain, and the queue skips ids no longer queued)
        demote = demote_in_bands(
            members,
            now,
            rates.rates,
            self.hyperflexis.demote_rate_share,
            queue.ids() if end > DEMOTE_SLICE else None,
        )
        queue.set_demoted([rid for rid in demoted if rid not in demote], False, now, ctx)
        queue.set_demoted(demote, True, now, ctx)
        return True

    def _drained(self, item: QueuedRequest, now: float) -> None:
        """A request leaves the queue for an engine: its band's drain rate counts its service."""
        view = item.view
        rates = self._band_rates.get(view.model)
        if rates is None:
            return
        ctx = self.context(view.model, now)
        # the plan's row of it has both, under a standing queue (its last use: dropped here)
        rows = self._plan_rows.get(view.model)
        row = None if rows is None else rows.pop(view.request_id, None)
        if row is not None and row[0] == item.seq and row[2] is ctx:
            rates.dispatched(row[1], row[3][2])
        else:
            band = band_of(view.priority, item.ttft_slo, item.tpot_slo)
            rates.dispatched(band, marginal_service_s(view, ctx))

    def _adapters_held(self, model: str) -> frozenset[str]:
        """The model's LoRA adapters loaded on an engine in rotation, when the profile sends an
        adapter's requests only there (empty when no engine lists any: the usual case)."""
        fleet = self.fleet
        if not fleet.adapter_bases or not self.router.lora.required:
            return frozenset()
        held = self._adapters.get(model)
        if held is None:  # (kept until an engine's adapters, health or rotation change)
            held = self._adapters[model] = frozenset().union(
                *(
                    r.adapters
                    for r in fleet.records.values()
                    if r.model == model and r.adapters and fleet.in_front(r)
                )
            )
        return held

    def _tpot_classes(self, model: str) -> dict[str, tuple[float, int]]:
        """Each in-front engine of ``model`` with the TPOT target most of its running requests
        have (the tighter on a tie; ``inf`` when idle) and its whole KV capacity in tokens (a
        large number when unknown): HyperFlexis's TPOT classes. When every engine is busy and of
        one class while some run laxer requests, the one with the largest share of them counts
        as of their class: otherwise engines that all took the tight class first would mix the
        classes for good. O(engines), asked only by a turn that meets a candidate of another
        class than its worker's."""
        fleet = self.fleet
        assert self.hyperflexis is not None
        ratio = self.hyperflexis.segregate_ratio
        classes: dict[str, tuple[float, int]] = {}
        lax_share, lax_engine, lax_class = 0.0, "", math.inf
        for record in fleet.engines_of.get(model, ()):
            if not fleet.in_front(record):
                continue
            state = record.state
            kv = (
                state.num_gpu_blocks * state.block_size
                if state is not None and state.num_gpu_blocks and state.block_size
                else 1 << 40
            )
            counts = record.tpot_counts
            if not counts:
                classes[record.engine_id] = (math.inf, kv)
                continue
            most = max(counts, key=lambda tpot: (counts[tpot], -tpot))
            classes[record.engine_id] = (most, kv)
            laxer = [tpot for tpot in counts if tpot > ratio * most]
            if laxer:
                share = sum(counts[t] for t in laxer) / record.in_flight
                if share > lax_share:
                    lax_share, lax_engine = share, record.engine_id
                    lax_class = max(laxer, key=lambda tpot: (counts[tpot], -tpot))
        busy = [c for c, _ in classes.values()]
        if lax_engine and len(busy) > 1 and math.inf not in busy and max(busy) <= ratio * min(busy):
            # (every engine busy and of one class, within the ratio)
            classes[lax_engine] = (lax_class, classes[lax_engine][1])
        return classes

    def _tightest(self, model: str, now: float) -> float:
        """The TTFT eq.(5) budgets against: the tightest among the model's recent arrivals, or
        the SLO profile's tightest when none arrived within the window (or no window is set)."""
        window = self._recent_ttft.get(model)
        recent = math.inf if window is None else window.min(now)
        if recent == math.inf:
            return self.tightest_ttft_s
        # never tighter than the profile's tightest class: a client claiming a 1 ms TTFT must not
        # shrink every worker's budget to nothing for the whole window
        return max(recent, self.tightest_ttft_s) if math.isfinite(self.tightest_ttft_s) else recent

    # -- engine events -----------------------------------------------------------------------------

    def _on_engine_change(self, engine_id: str, what: str) -> None:
        if what == "prefilled" and self.hyperflexis is None:
            return  # (a first token frees no capacity a pipeline placement reads)
        record = self.fleet.records[engine_id]
        model = record.model
        if what in ("adapters", "health", "role"):
            self._adapters.pop(model, None)
        hyperflexis = self.hyperflexis is not None
        if (
            ((what == "health" and not record.healthy) or what == "role")
            and not self.fleet.has_healthy(model)
            and self.queued(model)
        ):
            # every engine of the model is gone (ejected, or drained or flipped away): say so
            # now rather than let requests sit out the queue timeout (new arrivals for the
            # model get the same 503 at once)
            error = self.no_engine(model)
            queue = self.queues[model]
            self._demote_plans.pop(model, None)
            self._plan_rows.pop(model, None)
            for rid in [rid for rid, t in self.tickets.items() if t.item.view.model == model]:
                queue.remove(rid)
                self._refuse(rid, "no_engine", error, None)
            self.wake()
            return
        if what in ("health", "role") and engine_id in self._pinned_to and not self.fleet.in_front(record):
            # requests only this engine can serve (it stored what they continue) would wait out
            # their queue timeout for it: told now, as for a model left without engines
            error = _pinned_engine_left(engine_id)
            for rid in list(self._pinned_to[engine_id]):
                self._refuse(rid, "no_engine", error, None)
            self.wake()
        if hyperflexis and what in ("adapters", "health", "role") and self.fleet.adapter_bases:
            # a worker parked for slack left a LoRA request to an engine holding its adapter:
            # that engine may just have left rotation or unloaded it (only arrivals woke them)
            self.workers.unpark_all(model, -math.inf)
            self._dirty.add(model)
        if hyperflexis:
            assert self.hyperflexis is not None
            models = {model}
            if self.workers.on_engine_event(record, what):
                # the prefills that just ended are timed now, not at the next arrival or step (a
                # step only for that was a loop turn per request)
                if self.clock is None:
                    self.wake()  # (the step times them)
                else:
                    models.update(self.workers.shorten_holds(self.clock(), self.hyperflexis))
            # A turn is needed only if the event made a worker mature, or a hold end before the
            # loop's timer: under saturation every completion, first token and scrape woke the
            # loop for a turn that found the engine in a hold and took nothing.
            for changed in models:
                if self.queued(changed) and self._sooner(changed):
                    self._dirty.add(changed)
                    self.wake()
            return
        if not self.queued(model) or what == "prefilled":
            return
        self._dirty.add(model)
        self.wake()

    # -- bookkeeping -------------------------------------------------------------------------------

    def _choose(
        self, ticket: Ticket, exclude: Collection[str], now: float, reserve: bool = True
    ) -> EngineRecord | None:
        """The router's engine for the ticket with room under ``max_engine_load`` (not checked for
        retries, which were admitted already); reserved unless ``reserve`` is False."""
        max_load = None if exclude else self.max_engine_load
        record = self.router.choose(ticket.item.view, exclude, max_load, now)
        if record is not None and reserve:
            self.fleet.reserve(record.engine_id, ticket.request_id, ticket.entry)
        return record

    def _assign(self, ticket: Ticket, record: EngineRecord, now: float) -> None:
        rid = ticket.request_id
        if self._demote:
            self._drained(ticket.item, now)
        self.fleet.reserve(record.engine_id, rid, ticket.entry)
        self._forget(rid, now, in_queue=False)
        if rid == self._submitting:
            self._own = record
        else:
            self.outbox.append((rid, record))

    def _unstrand(self, model: str, now: float) -> None:
        """After a step of ``model`` failed (a bug): a ticket it had taken from the queue but not
        yet assigned is in no queue, so nothing would ever place or expire it, and its client
        would wait for good. It is answered with a 500 instead, any reservation made for it
        undone. (Every live ticket is in its queue between steps: arrivals placed at once are
        never ticketed.)"""
        queue = self.queues.get(model)
        for rid, ticket in list(self.tickets.items()):
            if ticket.item.view.model != model or (queue is not None and rid in queue):
                continue
            for record in self.fleet.engines_of.get(model, ()):
                self.fleet.release(record.engine_id, rid)
            self._forget(rid, now, in_queue=False)
            # (the loop logs the step's exception)
            message = "internal gateway error while dispatching; see its log"
            self.outbox.append((rid, GatewayError(500, message, code="internal_error")))

    def _expired(self, item: QueuedRequest, now: float) -> None:
        ticket = self.tickets.get(item.view.request_id)
        if ticket is None:
            return
        error = GatewayError(
            429,
            f"request waited longer than the {ticket.slo_class!r} queue timeout",
            code="queue_timeout",
            retry_after_s=1.0,
        )
        self._refuse(ticket.request_id, "timeout", error, now, in_queue=False)

    def _refuse(
        self, rid: str, reason: str, error: GatewayError, now: float | None, in_queue: bool = True
    ) -> None:
        ticket = self.tickets.get(rid)
        if ticket is None:
            return
        metrics.child(metrics.SHEDS, ticket.slo_class, reason).inc()
        self._forget(rid, now, in_queue)
        self.outbox.append((rid, error))

    def _join_batch(self, ticket: Ticket, queue: AdmissionQueue, now: float) -> None:
        """Stamp the newcomer and its queued peers with the batch's deadlines and re-queue the
        peers: the batch is ranked as one (RED). Peers beyond ``MAX_BATCH`` are not re-stamped,
        so a huge batch costs O(MAX_BATCH) per member, not O(n)."""
        assert ticket.batch is not None
        members = self._batches.setdefault((*ticket.batch, ticket.item.view.model), set())
        peers = [
            peer
            for peer in (self.tickets.get(r) for r in itertools.islice(members, MAX_BATCH - 1))
            if peer is not None and peer.request_id in queue
        ]
        stamped = with_batch([p.item for p in peers] + [ticket.item])
        ctx = self.context(ticket.item.view.model, now)
        for peer, item in zip(peers, stamped, strict=False):
            held = queue.remove(peer.request_id)
            # the queue's copy carries the current stamp, the ticket's may be stale
            item = with_demotion(item, held is not None and held.demoted)
            peer.item = item
            queue.push(item, now, ctx)
        ticket.item = stamped[-1]
        members.add(ticket.request_id)

    def _forget(self, rid: str, now: float | None, in_queue: bool = True) -> bool:
        ticket = self.tickets.pop(rid, None)
        if ticket is None:
            return False
        pinned = ticket.item.view.engine
        if pinned is not None:
            waiting = self._pinned_to.get(pinned)
            if waiting is not None:
                waiting.discard(rid)
                if not waiting:
                    del self._pinned_to[pinned]
        if ticket.batch is not None:
            key = (*ticket.batch, ticket.item.view.model)
            members = self._batches.get(key)
            if members is not None:
                members.discard(rid)
                if not members:
                    del self._batches[key]
        queue = self.queues.get(ticket.item.view.model)
        if queue is not None:
            if in_queue:
                queue.remove(rid)
            if not len(queue) and self._plan_rows:
                # every request the plans kept a row for has left
                self._plan_rows.pop(ticket.item.view.model, None)
        bucket = (ticket.item.view.model, ticket.slo_class)
        in_class = self.queued_per_class[bucket] = self.queued_per_class[bucket] - 1
        if (
            self._class_deadlines
            and bucket in self._class_deadlines
            and PRUNE_KEEP_BELOW <= self.limits(ticket.slo_class).max_queued > 2 * in_class
        ):
            # half empty: the prune is far off again. (Not for a small class: dropped, it was
            # made again from every queued ticket of every class the next time it filled, an
            # O(all queued) pass on nearly every arrival of a class of one or two)
            del self._class_deadlines[bucket]
        if now is not None and now > ticket.enqueued_at:  # (queued and taken in one call: no wait)
            self._waited_at[ticket.item.view.model] = now
        if self.shedding is not None:
            live = (ticket.item.view.model, ticket.item.view.priority)
            left = self._band_live.get(live, 0) - 1
            if left > 0:
                self._band_live[live] = left
            else:
                self._band_live.pop(live, None)
                self._band_newest.get(live[0], {}).pop(live[1], None)
        metrics.deferred(metrics.QUEUE_DEPTH, ticket.slo_class).dec()
        if now is not None:
            metrics.deferred(metrics.QUEUE_WAIT, ticket.slo_class).observe(max(0.0, now - ticket.enqueued_at))
        return True

    def _shed_for_saturation(self, ticket: Ticket, queue: AdmissionQueue | None, now: float) -> bool:
        """Saturation shedding (:func:`policies.flow_control.shed_victim`) as ``ticket`` is about
        to queue: True when the ticket itself is the one to shed (the caller refuses it, nothing
        is held yet); a queued victim is refused here, through the same path as every refusal."""
        assert self.shedding is not None
        view = ticket.item.view
        model = view.model
        pool = PoolLoad(
            engines=self.fleet.candidates(model, now),
            max_engine_load=self.max_engine_load,
            queued=1 + (len(queue) if queue is not None else 0),
            queued_prompt_tokens=view.prompt_tokens
            + (queue.queued_prompt_tokens if queue is not None else 0),
        )
        if not saturated(pool, self.context(model, now), self.shedding):
            return False
        newcomer = ShedCandidate(view.request_id, view.priority, ticket.item.seq)
        victim = shed_victim(self.shedding, newcomer, self._least_urgent_newest(model))
        if victim is None:
            return False
        if victim.request_id == view.request_id:
            return True
        error = GatewayError(
            429,
            "request shed: the pool is saturated and a more urgent request arrived",
            code="pool_saturated",
            retry_after_s=1.0,
        )
        self._refuse(victim.request_id, "saturated", error, now)
        self.wake()
        return False

    def _least_urgent_newest(self, model: str) -> ShedCandidate | None:
        """The newest queued ticket of the model's least urgent band (stale index entries of
        tickets that left are dropped on the way); ``None`` when nothing is queued."""
        bands = self._band_newest.get(model)
        if not bands:
            return None
        for band in sorted(bands, reverse=True):
            newest = bands[band]
            while newest and newest[0][1] not in self.tickets:
                heapq.heappop(newest)
            if newest:
                return ShedCandidate(newest[0][1], band, -newest[0][0])
            del bands[band]
        return None

    def _prune(self, model: str, slo_class: str, now: float) -> bool:
        """Shed one queued request of the class whose TTFT can no longer be met (MFS pruning):
        its deadline is nearer than even an immediate dispatch's predicted prefill. Looks at the
        class's few earliest TTFT deadlines only, so a full class costs O(log n) per arrival."""
        bucket = (model, slo_class)
        heap = self._class_deadlines.get(bucket)
        if heap is None:
            # the class is full for the first time (since it was last half empty)
            heap = self._class_deadlines[bucket] = [
                (t.item.ttft_deadline, t.item.seq, rid)
                for rid, t in self.tickets.items()
                if t.slo_class == slo_class and t.item.view.model == model
            ]
            heapq.heapify(heap)
        if not heap:
            return False
        ctx = self.context(model, now)
        looked: list[tuple[float, int, str]] = []
        found: str | None = None
        while heap and len(looked) < PRUNE_SCAN:
            entry = heapq.heappop(heap)
            ticket = self.tickets.get(entry[2])
            if ticket is None:
                continue  # left the queue since: drop the stale entry
            if ttft_infeasible(ticket.item, now, ctx):
                found = entry[2]
                break
            looked.append(entry)
        for entry in looked:
            heapq.heappush(heap, entry)
        if found is None:
            return False
        error = GatewayError(
            429,
            "request shed: its TTFT objective can no longer be met",
            code="slo_infeasible",
            retry_after_s=1.0,
        )
        self._refuse(found, "infeasible", error, now)
        self.wake()
        return True


def _pinned_engine_left(engine_id: str) -> GatewayError:
    return GatewayError(
        503,
        f"engine {engine_id}, which holds the response this request continues, is out of rotation; "
        "retry later",
        code="engine_unavailable",
        retry_after_s=5.0,
    )


def _bound(view: RequestView) -> tuple[str | None, str | None]:
    """The engines a request is bound to, as a key: its LoRA adapter's and its pinned engine."""
    return view.lora, view.engine
