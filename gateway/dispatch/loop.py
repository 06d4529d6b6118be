"""The live driver of the dispatch core: asyncio futures, the monotonic clock, one task.

Requests that can be placed at once skip the queue and the task entirely (one router call, or
one HyperFlexis turn when a worker is mature): that is the common case. Otherwise the request's
coroutine waits on a future that the task resolves when the core assigns or refuses it. The task
runs when the core says there is work (an arrival, an engine change) or at the core's next timer
(a HyperFlexis maturity time, a queue expiry); it never polls.

A caller cancelled while waiting (its client left) either removes its ticket or, when the
assignment raced with the cancellation, releases the reservation it was given: no path leaves an
engine's capacity counted for a request that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.dispatch.core import ClassLimits, DispatchCore, Ticket
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.tasks import cancel_and_wait
from policies.api import RequestView

log = logging.getLogger("slogate.dispatch")

#: the event loop's timer granularity (uvloop/libuv: 1 ms): a timer that fires more than
#: ``TIMER_EARLY_S`` before its time waits at least this much more, not one loop turn at a time
TIMER_TICK_S = 0.001
#: steps that each ask for the next at once yield to the event loop after holding it this long
#: (seconds): a demotion plan's slices over a deep queue, not a short chain of turns
CHAIN_YIELD_S = 0.001
TIMER_EARLY_S = 10e-6

__all__ = ["ClassLimits", "DispatchLoop"]


class DispatchLoop:
    """Owns the dispatch core; the serving flows call :meth:`place` and :meth:`release`."""

    def __init__(self, core: DispatchCore, clock: Callable[[], float] = time.monotonic) -> None:
        """Drive ``core`` on the running event loop, on ``clock`` (the core's time base)."""
        self.core = core
        name = "hyperflexis" if core.hyperflexis is not None else "pipeline"
        self._submit_hist = metrics.deferred(metrics.DISPATCH_CALL, name, "submit")
        self._step_hist = metrics.deferred(metrics.DISPATCH_CALL, name, "step")
        self.fleet = core.fleet
        self.clock = clock
        self.core.wake = self.wake
        self.core.clock = clock
        self._futures: dict[str, asyncio.Future[EngineRecord]] = {}
        self._event = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._task: asyncio.Task[None] | None = None
        #: loop turns that did work, for benchmarks and tests
        self.steps = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatch-loop")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._timer is not None:
            self._timer.cancel()
        self.core.closed = True
        self.core.reject_all(
            GatewayError(503, "gateway is shutting down", code="shutting_down"), self.clock()
        )
        self._deliver()

    @property
    def running(self) -> bool:
        """Whether the loop's task is alive (it ends only when stopped, or on a bug that escaped
        its own handler; either way nothing would be dispatched)."""
        return self._task is not None and not self._task.done()

    def wake(self) -> None:
        self._event.set()

    # -- the serving flows' side -----------------------------------------------------------------

    @property
    def tickets(self) -> dict[str, Ticket]:
        return self.core.tickets

    def no_engine(self, model: str) -> GatewayError:
        return self.core.no_engine(model)

    async def place(
        self,
        view: RequestView,
        ttft_slo: float,
        tpot_slo: float,
        slo_class: str,
        entry: RunningEntry,
        exclude: Collection[str] = (),
        batch: tuple[str, str] | None = None,
    ) -> EngineRecord:
        """An engine for the request with ``entry`` reserved on it under ``view.request_id``, now
        or after queueing; raises GatewayError when the request is refused. The caller must
        :meth:`release` the reservation when the request leaves the engine."""
        now = self.clock()
        ticket = self.core.ticket(view, ttft_slo, tpot_slo, slo_class, entry, now, batch)
        if exclude:
            return self.core.retry(ticket, exclude, now)
        t0 = time.perf_counter()
        try:
            record = self.core.submit(ticket, now)
        finally:
            self._submit_hist.observe(time.perf_counter() - t0)
            self._deliver()
        if record is not None:
            return self._with_adapter(ticket, record)
        future: asyncio.Future[EngineRecord] = asyncio.get_running_loop().create_future()
        self._futures[view.request_id] = future
        try:
            record = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                # assigned in the same turn the caller was cancelled: give the capacity back
                self.release(future.result().engine_id, view.request_id)
            else:
                self.core.cancel(view.request_id, self.clock())
            raise
        finally:
            self._futures.pop(view.request_id, None)
        return self._with_adapter(ticket, record)

    def _with_adapter(self, ticket: Ticket, record: EngineRecord) -> EngineRecord:
        """``record``, unless the request names a LoRA adapter that engine has not loaded while
        engines of its model that have it are in rotation (and the profile does not say engines
        load adapters on demand): then its reservation moves to one of those at once, as a retry
        would (an engine without the adapter answers 404). The router never picks such an
        engine; HyperFlexis's workers take their model's queued requests whatever adapters they
        have, so its placements are corrected here."""
        view = ticket.item.view
        lora = view.lora
        if lora is None or lora in record.adapters or not self.core.router.lora.required:
            return record
        now = self.clock()
        engines = self.fleet.candidates(view.model, now)
        lacking = [e.engine_id for e in engines if lora not in e.adapters]
        if len(lacking) == len(engines):
            return record  # no engine in rotation has it: nowhere better to go
        log.debug(
            "request %s for LoRA adapter %r moved off %s, which does not have it",
            view.request_id,
            lora,
            record.engine_id,
        )
        self.release(record.engine_id, view.request_id)
        return self.core.retry(ticket, lacking, now)

    def release(self, engine_id: str, request_id: str) -> None:
        """The request left the engine (finished, failed or abandoned). Idempotent."""
        self.fleet.release(engine_id, request_id)

    # -- the task ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        event = self._event
        chained_since: float | None = None
        while True:
            await event.wait()
            event.clear()
            try:
                t0 = time.perf_counter()
                self.core.step(self.clock())
                self._step_hist.observe(time.perf_counter() - t0)
                self.steps += 1
                self._deliver()
                self._arm(self.core.next_wake(self.clock()))
            except Exception:  # keep dispatching; a bug must not strand every queued request
                log.exception("dispatch failed")
                # what the step decided before it failed goes out (an assignment left in the
                # outbox held its engine and its waiting client until some later delivery)
                with contextlib.suppress(Exception):
                    self._deliver()
                await asyncio.sleep(0.05)
                event.set()
            if not event.is_set():
                chained_since = None
            else:
                # another step asked for at once (a demotion plan's next slice, a worker due
                # already): Event.wait() returns without yielding, so such steps ran back to back
                # in one turn of the event loop, holding every stream as one long call. Yield once
                # they have held it CHAIN_YIELD_S (not after every one: short chains are the
                # common case in front of fast engines, and a yield each cost throughput there)
                if chained_since is None:
                    chained_since = t0
                if time.perf_counter() - chained_since >= CHAIN_YIELD_S:
                    chained_since = None
                    await asyncio.sleep(0)

    def _arm(self, at: float) -> None:
        """Wake the task at ``at`` (the core's clock): one timer handle, moved only when needed."""
        if at == self._timer_at:
            return
        now = self.clock()
        if self._timer is not None:
            if now < at and self._timer_at < at:
                # an earlier timer stays: its step finds nothing due and arms this one. Under a
                # standing queue the earliest expiry moves on with every placement, and moving the
                # timer each time cost a cancelled handle and a new one per placement
                return
            self._timer.cancel()
            self._timer = None
        if at <= now:  # due already (a worker made mature by an event): run again at once
            self._timer_at = math.inf
            self._event.set()
            return
        self._timer_at = at
        if at != math.inf:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + (at - now), self._fire)

    def _fire(self) -> None:
        self._timer = None
        early = self._timer_at - self.clock()
        if early > 0.0:
            # libuv keeps time in whole milliseconds and rounds a delay to the nearest one, so
            # most timers fired up to ~0.5 ms before the core's time: the step found nothing
            # due and re-armed for under half a millisecond, which uvloop runs at once, and the
            # loop spun through empty steps until the time came (5 a placement at 256 engines).
            # Wait for the rest instead, without a step: at least one tick of such a loop's
            # timers (asyncio's own timers are early by at most a clock resolution).
            wait = max(early, TIMER_TICK_S) if early > TIMER_EARLY_S else early
            self._timer = asyncio.get_running_loop().call_later(wait, self._fire)
            return
        self._timer_at = math.inf
        self._event.set()

    def _deliver(self) -> None:
        outbox = self.core.outbox
        if not outbox:
            return
        self.core.outbox = []
        for rid, result in outbox:
            future = self._futures.get(rid)
            if future is None or future.done():
                if isinstance(result, EngineRecord):
                    self.release(result.engine_id, rid)  # nobody waits for it any more
                continue
            if isinstance(result, EngineRecord):
                future.set_result(result)
            else:
                future.set_exception(result)
