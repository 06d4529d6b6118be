"""HyperFlexis workers between turns: when each engine may next take work, and which wait for what.

Every collocated engine has a maturity time (Algorithm 1's, on the core's clock):

* finite: the engine takes work once it has come (a heap per model, lazily invalidated by a
  version per engine, so one live entry per engine ever exists);
* ``inf``, *parked*: the engine took nothing and only an event can change that. Engines held back
  by slack may take the next arrivals (``_parked``, in the order they parked); engines that are
  full (no seat or KV) wait for their own completions and scrapes;
* finite but without a timer: the engine took work and with it all the KV (or the last seat) any
  queued request could use (``_kv_wait``). Its hold's end would find it full, so it has no heap
  entry until its own completion or scrape, or an arrival that fits the KV it has left, gives it
  one (at the same maturity).

The rules for events are in :meth:`HyperFlexisWorkers.on_engine_event`. No clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from operator import mul

from gateway.fleet.registry import FRONT_ROLES, EngineRecord, Fleet
from policies.hyperflexis import HyperFlexisParams, RunningLoad, WorkerView, shortened_maturity, tpot_floor
from policies.latency_fit import Coeffs

#: an engine whose prefills take under this fraction of the time predicted for them may take
#: arrivals during its holds (:meth:`HyperFlexisWorkers.held`): its prior is slow, not the engine
JOIN_BELOW_RATIO = 0.5
#: the requests an engine runs at once when the profile sets no max_engine_load (vLLM's default
#: --max-num-seqs)
MAX_NUM_SEQS = 256


class HyperFlexisWorkers:
    def __init__(
        self,
        fleet: Fleet,
        coefficients: Callable[[str], tuple[Coeffs, Coeffs]],
        max_engine_load: int | None,
    ) -> None:
        self.fleet = fleet
        self.coefficients = coefficients
        self.max_engine_load = max_engine_load
        #: each engine's maturity time (``inf``: parked until an event)
        self.maturity: dict[str, float] = {}
        self._heaps: dict[str, list[tuple[float, int, str]]] = {m: [] for m in fleet.served_models}
        #: bumped whenever an engine's maturity changes: a heap entry with an older one is stale
        self._version: dict[str, int] = {}
        self._parked: dict[str, dict[str, None]] = {m: {} for m in fleet.served_models}
        #: engines held after a turn that took work: (turn time, the prefill time predicted for it)
        self._holds: dict[str, tuple[float, float]] = {}
        #: held engines whose every dispatched prefill has produced its first token, with the
        #: hold they had then (it may have ended since: the engine went idle) and whether a first
        #: token showed it (a release may be a cancellation: it says nothing of the engine's speed)
        self._prefilled: dict[str, tuple[tuple[float, float], bool]] = {}
        #: per model, the engines in a hold after a turn that took work, oldest hold first, with
        #: the prompt tokens the hold took from its turn's budget: an arrival may join one
        #: (see :meth:`held`)
        self._held: dict[str, dict[str, int]] = {m: {} for m in fleet.served_models}
        #: per engine, how long its last hold's prefills really took, as a fraction of the
        #: prediction (known when they all produced their first token within the hold)
        self.prefill_ratio: dict[str, float] = {}
        #: per model, engines in a hold whose timer waits for an event (module doc), with the KV
        #: tokens each has left (-1: no seat), and the most any of them has (an upper bound)
        self._kv_wait: dict[str, dict[str, int]] = {m: {} for m in fleet.served_models}
        self._kv_room: dict[str, int] = {}
        for record in fleet.records.values():
            if record.adapter.role in FRONT_ROLES:
                self.set(record.model, record.engine_id, 0.0)

    @property
    def models(self) -> Iterator[str]:
        return iter(self._heaps)

    def set(self, model: str, engine_id: str, at: float, room: int | None = None) -> None:
        """The one place a worker's maturity changes: one live heap entry per worker, ever
        (none while it waits for KV, ``room`` being the KV tokens it has left: ``_kv_wait``)."""
        version = self._version.get(engine_id, 0) + 1
        self._version[engine_id] = version
        self.maturity[engine_id] = at
        self._holds.pop(engine_id, None)
        self._held[model].pop(engine_id, None)
        waiting = self._kv_wait[model]
        if waiting:
            waiting.pop(engine_id, None)
        if at != math.inf:
            if room is None:
                heapq.heappush(self._heaps[model], (at, version, engine_id))
            else:
                waiting[engine_id] = room
                if room > self._kv_room.get(model, -1):
                    self._kv_room[model] = room

    def _timer_back(self, model: str, engine_id: str) -> None:
        """A worker waiting for KV gets its hold's end as a timer again (its maturity stays)."""
        del self._kv_wait[model][engine_id]
        heapq.heappush(self._heaps[model], (self.maturity[engine_id], self._version[engine_id], engine_id))

    def fits_waiting(self, model: str, need: int) -> None:
        """A request needing ``need`` KV tokens is queued: the workers waiting for KV with room
        for it get their timers back (their holds' ends would now find something to take)."""
        if need > self._kv_room.get(model, -1):
            return  # (no waiting worker has room for it: the common case under saturation)
        waiting = self._kv_wait[model]
        for engine_id, room in list(waiting.items()):
            if room >= need:
                self._timer_back(model, engine_id)
        self._kv_room[model] = max(waiting.values(), default=-1)

    def hold(
        self,
        model: str,
        engine_id: str,
        at: float,
        turn_at: float,
        prefill_s: float,
        tokens: int = 0,
        room: int | None = None,
    ) -> None:
        """``engine_id`` took work at ``turn_at`` and matures at ``at``, a hold that amortises a
        predicted prefill of ``prefill_s`` (``tokens`` prompt tokens to prefill, taken from the
        turn's budget); it may end sooner (see :meth:`shorten_holds`). ``room``: it has no seat
        (-1) or only this much KV left, less than any queued request needs, so its hold's end waits
        for its own completion or scrape or an arrival that fits (under saturation the timer's
        turn found every such engine full: a turn a placement)."""
        self.set(model, engine_id, at, room)
        if at > turn_at:
            if self.prefill_ratio.get(engine_id, 1.0) < JOIN_BELOW_RATIO:
                self._held[model][engine_id] = tokens
            if prefill_s > 0.0:
                self._holds[engine_id] = (turn_at, prefill_s)

    def hold_started(self, engine_id: str) -> float | None:
        """When the turn whose hold ``engine_id`` is in took work (``None``: not in a timed hold)."""
        held = self._holds.get(engine_id)
        return None if held is None else held[0]

    def held(self, model: str, count: int, now: float) -> list[WorkerView]:
        """Up to ``count`` of the model's workers in a hold after a turn that took work, oldest
        hold first, as views for a join look at ``now`` (:attr:`WorkerView.joining`); only engines
        whose last hold's prefills took under ``JOIN_BELOW_RATIO`` of the predicted time: on an
        engine as slow as predicted the hold is what keeps its running streams within their
        TPOT, so arrivals wait for the next turn as Algorithm 1 has them. They stay where they
        are: a join that takes nothing changes nothing, one that takes work sets a new hold
        (:attr:`maturity` keeps the one it joined)."""
        views: list[WorkerView] = []
        records = self.fleet.records
        held = self._held[model]
        ratio = self.prefill_ratio
        # (bounded: engines out of rotation leave only at their next set())
        for engine_id in islice(held, 4 * count):
            record = records[engine_id]
            if ratio.get(engine_id, 1.0) < JOIN_BELOW_RATIO and self.fleet.in_front(record):
                views.append(self._view(record, now, joining=held[engine_id]))
                if len(views) == count:
                    break
        return views

    def shorten_holds(self, now: float, params: HyperFlexisParams) -> list[str]:
        """Holds whose prefills all produced their first token end in proportion to how long
        the prefills really took (:func:`policies.hyperflexis.shortened_maturity`); returns the
        models whose timers came sooner."""
        ratio = self.prefill_ratio
        sooner_for: list[str] = []
        for engine_id, (held, timed) in self._prefilled.items():
            took = max(0.0, now - held[0]) / held[1]
            if timed:
                ratio[engine_id] = took
            elif took >= JOIN_BELOW_RATIO:
                # ended without a first token (cancelled): the prefill took at least this long
                ratio[engine_id] = max(ratio.get(engine_id, 0.0), took)
            if self._holds.get(engine_id) is not held:
                continue  # (the hold ended meanwhile: only the ratio is news)
            at = self.maturity[engine_id]
            sooner = shortened_maturity(held[0], at, held[1], now, params)
            if sooner < at:
                model = self.fleet.records[engine_id].model
                room = self._kv_wait[model].get(engine_id)
                self.set(model, engine_id, sooner, room)
                if room is None and model not in sooner_for:
                    sooner_for.append(model)
        self._prefilled.clear()
        return sooner_for

    def park(self, model: str, engine_id: str, full: bool) -> None:
        """``engine_id`` took nothing and has no timer: wait for an event (see the module doc)."""
        self.set(model, engine_id, math.inf)
        if not full:
            self._parked[model][engine_id] = None

    def unpark(self, model: str, engine_id: str, now: float) -> None:
        self._parked[model].pop(engine_id, None)
        self.set(model, engine_id, now)

    def unpark_all(self, model: str, now: float) -> None:
        """Every engine of ``model`` parked for slack looks again: what held it back (a request's
        adapter on another engine, that engine in rotation) may have changed."""
        parked = self._parked.get(model)
        for engine_id in list(parked or ()):
            self.unpark(model, engine_id, now)

    def unpark_for_arrival(self, model: str, count: int, now: float) -> None:
        """Give ``count`` engines parked for slack a look at a new arrival (oldest parked first)."""
        parked = self._parked.get(model)
        for _ in range(min(count, len(parked) if parked else 0)):
            assert parked is not None
            self.unpark(model, next(iter(parked)), now)

    def next_mature(self, model: str) -> float:
        """The earliest maturity among the model's workers (``inf`` when every one is parked)."""
        heap = self._heaps[model]
        while heap and self._version[heap[0][2]] != heap[0][1]:
            heapq.heappop(heap)  # superseded entry
        return heap[0][0] if heap else math.inf

    def pop_mature(
        self, model: str, now: float, limit: int, early: float = 0.0, park_below: int | None = None
    ) -> tuple[list[WorkerView], int]:
        """Up to ``limit`` workers whose maturity has come by ``now + early``, earliest first, as
        views (mature at ``now`` at the latest); unhealthy ones leave the heap until a health
        event brings them back. With ``park_below`` (the least KV any request the turn looks at
        needs), busy workers with less KV free that would come first in the turn are parked as
        full instead (:func:`policies.hyperflexis.kv_bound`: their look takes nothing), without a
        view: under saturation that is half the workers a turn pops. Also returns how many were
        parked (they count towards ``limit`` as the turn would have counted them)."""
        heap = self._heaps[model]
        workers: list[WorkerView] = []
        until = now + early
        parked = 0
        while heap and heap[0][0] <= until and len(workers) + parked < limit:
            at, version, engine_id = heapq.heappop(heap)
            if self._version[engine_id] != version:
                continue  # superseded
            record = self.fleet.records[engine_id]
            if not self.fleet.in_front(record):
                self.set(model, engine_id, math.inf)  # back with the event that returns it
                continue
            held = self._holds.get(engine_id)
            if held is not None and record.unprefilled and now - held[0] >= JOIN_BELOW_RATIO * held[1]:
                # its hold ran out before its prefills did: a lower bound says it is not fast
                self.prefill_ratio[engine_id] = (now - held[0]) / held[1]
            if park_below is not None and not workers and record.running:
                free_kv = record.free_kv_tokens()
                if free_kv is not None and free_kv < park_below:
                    self.park(model, engine_id, full=True)
                    parked += 1
                    continue
            workers.append(self._view(record, at if at <= now else now))
        return workers, parked

    def take_mature(
        self, model: str, engine_ids: Iterable[str], now: float, early: float = 0.0
    ) -> list[WorkerView]:
        """The workers among ``engine_ids`` whose maturity has come (by ``now + early``) and that
        may take work, as views, out of the heap (like :meth:`pop_mature`, whatever their place in
        it): the caller sets each one's maturity after the turn."""
        views = []
        for engine_id in engine_ids:
            at = self.maturity.get(engine_id)
            if at is None or at > now + early:
                continue
            record = self.fleet.records[engine_id]
            if record.model != model or not self.fleet.in_front(record):
                continue
            views.append(self._view(record, at if at <= now else now))
            self._version[engine_id] += 1  # its heap entry is superseded until the caller's set()
        return views

    def on_engine_event(self, record: EngineRecord, what: str) -> bool:
        """Wake what the event may have changed: a parked or full worker looks again at its own
        events, queue or not (a full worker whose queue emptied meanwhile would otherwise stay
        out), except a full one at a first token, which frees no seat and no KV; an engine that
        goes idle takes the next request at once: its hold was for work it has finished (at
        concurrency 1 the next arrival waited out a whole turn, ~37 ms on the default prior,
        behind an engine with nothing to do); an engine back in health is mature at once.

        True when the event ended a hold's prefills (a first token, or the end or cancellation of
        the request): the caller times the prefill (:meth:`shorten_holds`,
        :attr:`prefill_ratio`) now, at its end, not at the next arrival or step."""
        engine_id = record.engine_id
        model = record.model
        in_front = (
            record.adapter.role in FRONT_ROLES
            and not record.draining
            and not record.stalled
            and not record.tripped
        )
        if what in ("role", "health"):
            # restarted or reassigned: measured afresh (not by a first token from before)
            self.prefill_ratio.pop(engine_id, None)
            self._prefilled.pop(engine_id, None)
        if what == "role":  # drained, flipped or back in rotation: a fresh look, or out
            if in_front:
                self.unpark(model, engine_id, -math.inf)
            elif engine_id in self.maturity:
                self._parked[model].pop(engine_id, None)
                self.set(model, engine_id, math.inf)  # its own events no longer wake it
            return False
        if engine_id not in self.maturity or not in_front:
            return False
        ended = False
        if what in ("prefilled", "release") and engine_id in self._holds and not record.unprefilled:
            # (a non-streamed answer's end shows its prefill was done, and so may a cancellation:
            # both end the hold early, only a first token times the engine)
            held = self._holds[engine_id]
            seen = self._prefilled.get(engine_id)
            timed = what == "prefilled"
            self._prefilled[engine_id] = (held, timed or (seen is not None and seen == (held, True)))
            ended = True
        if what == "health":
            if record.healthy:
                self.unpark(model, engine_id, -math.inf)
            return False
        at = self.maturity[engine_id]
        if what in ("release", "state", "remote") and engine_id in self._kv_wait[model]:
            self._timer_back(model, engine_id)  # its KV may have freed
        full = at == math.inf and engine_id not in self._parked[model]
        if (at == math.inf and not (full and what == "prefilled")) or (
            what == "release" and not record.running and at > -math.inf
        ):
            self.unpark(model, engine_id, -math.inf)
        return ended

    def _view(self, record: EngineRecord, maturity: float, joining: int | None = None) -> WorkerView:
        # the running requests summed from what the fleet keeps as they come and go (their
        # token total, the prompts still waiting for prefill): no object per running request
        waiting = record.unprefilled.values()
        prefill, decode = self.coefficients(record.engine_id)
        floor = tpot_floor(decode)
        load = RunningLoad(
            # (other gateway replicas' requests there count in its batch and its seats; their
            # prompts' prefill and TPOT targets are not exchanged: the engine's scrape has them)
            record.seats_taken(),
            record.running_tokens + record.remote_running_tokens,
            len(waiting),
            sum(waiting),
            sum(map(mul, waiting, waiting)),
            tightest
            if (tightest := min(record.tpot_counts, default=math.inf)) >= floor
            # (a target below what the engine can do at all is not planned for: tpot_floor)
            else min((t for t in record.tpot_counts if t >= floor), default=math.inf),
            max(record.tpot_counts, default=0.0),
        )
        free_kv = record.free_kv_tokens()
        return WorkerView(
            engine_id=record.engine_id,
            prefill_coeffs=prefill,
            decode_coeffs=decode,
            free_kv_tokens=1 << 30 if free_kv is None else free_kv,
            max_num_seqs=self.max_engine_load or MAX_NUM_SEQS,
            maturity=maturity,
            load=load,
            adapters=record.adapters,
            joining=joining,
        )
