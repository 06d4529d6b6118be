"""The admission queue and the event-driven dispatch loop.

Requests that can be placed at once (pipeline dispatcher, empty queue, an engine with room) skip
the queue entirely: that is the common case and it costs one pipeline call. Otherwise a request
waits in the admission queue (ordered by the profile's queue order) until the dispatch loop
places it, sheds it, or its class's queue timeout expires. The loop wakes on arrivals, on
completions, on the dispatcher's own timer (HyperFlexis maturity times) and on every monitor
re-sync; each wake takes one fleet snapshot and calls the pure dispatcher policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.router import Router
from policies.admission_queue import AdmissionQueue
from policies.api import RequestView, estimated_load
from policies.hyperflexis import HyperFlexisParams, RunningRequest, WorkerView
from policies.hyperflexis import dispatch as hyperflexis_dispatch
from policies.latency_fit import Coeffs
from policies.queue_order import OrderContext, QueuedRequest, QueueOrder, ttft_infeasible

log = logging.getLogger("slogate.dispatch")


@dataclass(slots=True)
class Ticket:
    item: QueuedRequest
    slo_class: str
    future: asyncio.Future[EngineRecord]
    enqueued_at: float


@dataclass(frozen=True, slots=True)
class ClassLimits:
    max_queued: int = 1024
    queue_timeout_s: float = 30.0


class DispatchLoop:
    """Owns the admission queue; the proxy calls :meth:`place` and :meth:`finished`."""

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
    ) -> None:
        self.fleet = fleet
        self.router = router
        self.order = order
        self.coefficients = coefficients
        self.limits = limits
        self.hyperflexis = hyperflexis
        self.max_engine_load = max_engine_load
        self.tightest_ttft_s = tightest_ttft_s
        self.queue = AdmissionQueue(order)
        self.tickets: dict[str, Ticket] = {}
        self.queued_per_class: dict[str, int] = {}
        self.maturity: dict[str, float] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._timer_at = math.inf
        self._task: asyncio.Task[None] | None = None
        self._default_context = OrderContext(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
        self._context = self._default_context
        self._context_key: tuple[float, ...] = ()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatch-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for ticket in self.tickets.values():
            if not ticket.future.done():
                ticket.future.set_exception(
                    GatewayError(503, "gateway is shutting down", code="shutting_down")
                )
        self.tickets.clear()

    def wake(self) -> None:
        self._wake.set()

    # -- the proxy's side ------------------------------------------------------------------------

    def context(self) -> OrderContext:
        """Fleet-level estimates for the queue orders, from the first engine's latency model."""
        first = next(iter(self.fleet.records), None)
        if first is None:
            return self._default_context
        (a, b, _), (a_d, _, _) = self.coefficients(first)
        key = (a, b, a_d, len(self.fleet.records))
        if key != self._context_key:
            self._context_key = key
            self._context = OrderContext(
                prefill_tokens_per_s=1.0 / b if b > 0 else 1e9,
                decode_step_s=max(a_d, 1e-6),
                prefill_base_s=a,
                prefill_engines=max(1, len(self.fleet.records)),
            )
        return self._context

    def _has_room(self, record: EngineRecord) -> bool:
        if self.max_engine_load is None:
            return True
        snapshot = self.fleet.snapshot().engines
        engine = next(e for e in snapshot if e.engine_id == record.engine_id)
        return estimated_load(engine) < self.max_engine_load

    async def place(
        self,
        view: RequestView,
        ttft_slo: float,
        tpot_slo: float,
        slo_class: str,
        exclude: Collection[str] = (),
    ) -> EngineRecord:
        """An engine for the request, now or after queueing; raises GatewayError when shed."""
        if exclude or (self.hyperflexis is None and not self.tickets):
            record = self.router.choose(view, exclude)
            if record is not None and (exclude or self._has_room(record)):
                return record
            if record is None:
                raise self.no_engine(view.model)
        if view.model not in self.fleet.healthy_models():
            raise self.no_engine(view.model)
        limits = self.limits(slo_class)
        now = time.monotonic()
        if self.queued_per_class.get(slo_class, 0) >= limits.max_queued and not self._prune_black_hole(
            slo_class, now
        ):
            metrics.SHEDS.labels(slo_class, "queue_full").inc()
            raise GatewayError(
                429, f"the {slo_class!r} queue is full; retry later", code="queue_full", retry_after_s=1.0
            )
        item = QueuedRequest(
            view=view,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            seq=next(self._seq),
            queue_deadline=now + limits.queue_timeout_s,
        )
        future: asyncio.Future[EngineRecord] = asyncio.get_running_loop().create_future()
        self.tickets[view.request_id] = Ticket(item, slo_class, future, now)
        self.queued_per_class[slo_class] = self.queued_per_class.get(slo_class, 0) + 1
        self.queue.push(item, now, self.context())
        metrics.QUEUE_DEPTH.labels(slo_class).inc()
        self._wake.set()
        try:
            return await future
        finally:
            self._forget(view.request_id)

    def finished(self, engine_id: str) -> None:
        """A request left ``engine_id``: capacity freed, so the dispatcher should look again.

        The engine's maturity time is left alone: it paces how fast new prefill work is handed
        out, and a completion does not make the engine's pending prefill finish sooner.
        """
        if self.tickets:
            self._wake.set()

    def _forget(self, request_id: str) -> None:
        ticket = self.tickets.pop(request_id, None)
        if ticket is None:
            return
        self.queue.remove(request_id)
        self.queued_per_class[ticket.slo_class] -= 1
        metrics.QUEUE_DEPTH.labels(ticket.slo_class).dec()
        metrics.QUEUE_WAIT.labels(ticket.slo_class).observe(time.monotonic() - ticket.enqueued_at)

    def no_engine(self, model: str) -> GatewayError:
        if model not in self.fleet.served_models:
            served = ", ".join(sorted(self.fleet.served_models)) or "none"
            return GatewayError(
                404,
                f"model {model!r} is not served here; available models: {served}",
                param="model",
                code="model_not_found",
            )
        metrics.NO_ENGINE.labels(model).inc()
        return GatewayError(
            503,
            f"no healthy engine is serving model {model!r}; retry later",
            code="no_healthy_engine",
            retry_after_s=1.0,
        )

    def _prune_black_hole(self, slo_class: str, now: float) -> bool:
        """Shed one queued request of the class whose TTFT can no longer be met (MFS pruning):
        its deadline is nearer than even an immediate dispatch's predicted prefill."""
        ctx = self.context()
        for item in self.queue.iter_in_order(now, ctx, len(self.queue)):
            ticket = self.tickets.get(item.view.request_id)
            if ticket is None or ticket.slo_class != slo_class:
                continue
            if ttft_infeasible(item, now, ctx):
                self._reject(
                    ticket,
                    "infeasible",
                    GatewayError(
                        429,
                        "request shed: its TTFT objective can no longer be met",
                        code="slo_infeasible",
                        retry_after_s=1.0,
                    ),
                )
                return True
        return False

    def _reject(self, ticket: Ticket, reason: str, error: GatewayError) -> None:
        metrics.SHEDS.labels(ticket.slo_class, reason).inc()
        if not ticket.future.done():
            ticket.future.set_exception(error)
        self._forget(ticket.item.view.request_id)

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            timeout = None if math.isinf(self._timer_at) else max(0.0, self._timer_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            try:
                self._timer_at = self._dispatch_once(time.monotonic())
            except Exception:  # keep dispatching; a bug must not strand every queued request
                log.exception("dispatch failed")
                self._timer_at = time.monotonic() + 0.05

    def _dispatch_once(self, now: float) -> float:
        """One dispatcher call; returns when to call again absent events."""
        for item in self.queue.expire(now):
            ticket = self.tickets.get(item.view.request_id)
            if ticket is not None:
                self._reject(
                    ticket,
                    "timeout",
                    GatewayError(
                        429,
                        f"request waited longer than the {ticket.slo_class!r} queue timeout",
                        code="queue_timeout",
                        retry_after_s=1.0,
                    ),
                )
        if not self.tickets:
            return math.inf
        healthy = self.fleet.healthy_models()
        for ticket in [t for t in self.tickets.values() if t.item.view.model not in healthy]:
            # every engine of its model was ejected while it waited: say so now rather than let
            # it sit out the queue timeout (new arrivals for the model get the same 503 at once)
            self._reject(ticket, "no_engine", self.no_engine(ticket.item.view.model))
        if not self.tickets:
            return math.inf
        if self.hyperflexis is not None:
            return self._dispatch_hyperflexis(now)
        return self._dispatch_pipeline(now)

    def _assign(self, request_id: str, record: EngineRecord) -> None:
        ticket = self.tickets.get(request_id)
        if ticket is None or ticket.future.done():
            return
        ticket.future.set_result(record)
        self._forget(request_id)

    def _dispatch_pipeline(self, now: float) -> float:
        ctx = self.context()
        blocked: set[str] = set()
        for item in list(self.queue.iter_in_order(now, ctx, len(self.queue))):
            if item.view.model in blocked:
                continue
            record = self.router.choose(item.view)
            if record is None or not self._has_room(record):
                blocked.add(item.view.model)
                continue
            self._assign(item.view.request_id, record)
        # completions wake the loop; the timer only bounds staleness of the load estimate
        return now + 0.05 if self.tickets else math.inf

    def _dispatch_hyperflexis(self, now: float) -> float:
        assert self.hyperflexis is not None
        params = self.hyperflexis
        ctx = self.context()
        snapshot = self.fleet.snapshot(now)
        healthy = [e.engine_id for e in snapshot.engines if e.healthy]
        next_mature = min((self.maturity.get(e, now) for e in healthy), default=math.inf)
        if next_mature > now:
            return next_mature  # no engine can take work yet: skip the queue scan entirely
        wake_at = math.inf
        queued = list(self.queue.iter_in_order(now, ctx, params.max_scan * max(1, len(snapshot.engines))))
        for model in {i.view.model for i in queued}:
            items = [i for i in queued if i.view.model == model]
            workers = [
                self._worker_view(e.engine_id, now)
                for e in snapshot.engines
                if e.healthy and e.model == model and e.role.value == "collocated"
            ]
            decision = hyperflexis_dispatch(items, workers, now, params, self.tightest_ttft_s)
            self.maturity.update(decision.maturity)
            for assignment in decision.assignments:
                self._assign(assignment.request_id, self.fleet.records[assignment.engine_id])
            wake_at = min(wake_at, decision.wake_at)
        return wake_at

    def _worker_view(self, engine_id: str, now: float) -> WorkerView:
        record = self.fleet.records[engine_id]
        running = tuple(
            RunningRequest(r.prompt_tokens, r.generated, r.tpot_slo, r.prefilled)
            for r in record.running.values()
        )
        prefill, decode = self.coefficients(engine_id)
        state = record.state
        free_kv = 1 << 30
        if state is not None and state.num_gpu_blocks and state.block_size:
            capacity = state.num_gpu_blocks * state.block_size
            free_kv = max(0, int(capacity * (1.0 - state.kv_usage)) - record.in_flight_tokens_since_scrape())
        return WorkerView(
            engine_id=engine_id,
            prefill_coeffs=prefill,
            decode_coeffs=decode,
            running=running,
            free_kv_tokens=free_kv,
            maturity=self.maturity.get(engine_id, now),
        )
