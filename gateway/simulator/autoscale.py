"""Scale actions in the offline simulator: a scaling policy (:mod:`policies.scaling`) run every
scaling interval on what the gateway sees, its actions carried out as events on the virtual clock.

The fleet is built at its maximum size up front (``AutoscaleConfig.max_engines`` slots in the
live registry); engines not provisioned are unhealthy, so never routable, and become healthy when
they come up, as the monitor would re-admit a new engine. Nothing in the registry's structure
changes at run time; the scaler uses the registry's own rotation controls
(:meth:`Fleet.set_draining`, :meth:`Fleet.set_role`, health).

* **add / wake**: the engine serves after its provisioning time from the engine profile
  (``weights``): a cold start is the runtime start then weights from disk
  (:meth:`Weights.cold_start_s`); a warm-pool engine (runtime up) loads its weights from a running
  peer, device to device (``warm_source: peer``, HyperFlexis §6 "Fast Scaling"), from host memory
  (``cpu``: vLLM's sleep level 1) or disk. Then it is scraped and marked healthy.
* **remove**: the engine leaves rotation, what runs there finishes (a prefill engine also until
  the KV it holds has been pulled), then it is released: back to the warm pool while the pool is
  below ``warm_pool`` engines (weights dropped, runtime kept), else off.
* **flip** (P/D): drained the same way, then its role switches (``role_switch_s``) and it is back
  in its new pool, weights kept.
* **warm pool**: ``warm_pool`` engines start warm; a cold slot is started into the pool (its
  runtime, ``runtime_start_s``) whenever the pool falls below its size.

**Cost** (HyperFlexis eq. 3, "active time"): engine-seconds an engine holds a device with weights
or is loading them (serving, draining, loading), over the run (first arrival to last answer);
warm-pool engine-seconds are reported apart (a runtime without weights: whether it holds a
device is a deployment's choice; add them if it does).

**Signals** (:class:`policies.scaling.PoolSignals`), per pool, from the gateway's own state: its
admission queue (or the decode pool's transfer queues), each request still without a first
token (time waited / its TTFT SLO), each stream that produced tokens in the last ``window_s``
(its TPOT so far / its SLO), requests in and out of the pool over ``window_s``, and each engine's
``estimated_load`` (shadow and last scrape).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.fleet.registry import Fleet
from gateway.sim.profiles import EngineProfile
from gateway.simulator.clock import EventQueue
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import SimGateway
from policies.api import Role, estimated_load
from policies.scaling import (
    ActionKind,
    EngineView,
    FleetView,
    Phase,
    PoolSignals,
    ScaleAction,
    Scaler,
    ScalingBounds,
    ScalingState,
    make_scaler,
)

WARM_SOURCES = ("peer", "cpu", "disk")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """The scaler of a simulated run (picklable: part of a Scenario)."""

    policy: str = "hyperflexis"
    #: serving engines never fewer than this (per pool in P/D), slots never more than max_engines
    min_engines: int = 1
    max_engines: int = 8
    #: engines kept warm (runtime up, no weights); they start warm
    warm_pool: int = 0
    #: where a warm engine's weights come from: a running peer (D2D), host memory or disk
    warm_source: str = "peer"
    #: seconds a drained engine takes to switch role (P/D flips; vLLM kv_both needs nothing)
    role_switch_s: float = 0.1
    #: how far back arrival / processing rates and TPOTs look
    window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.min_engines < 1 or self.max_engines < self.min_engines:
            raise ValueError(
                f"autoscale bounds need 1 <= min <= max, got {self.min_engines}..{self.max_engines}"
            )
        if self.warm_pool < 0:
            raise ValueError("warm_pool must be >= 0")
        if self.warm_source not in WARM_SOURCES:
            raise ValueError(
                f"warm_source must be one of {', '.join(WARM_SOURCES)}, got {self.warm_source!r}"
            )
        make_scaler(self.policy)  # a bad name fails here, not in a worker process

    def label(self) -> str:
        warm = f", warm pool {self.warm_pool} ({self.warm_source})" if self.warm_pool else ", no warm pool"
        return f"autoscale {self.policy} {self.min_engines}-{self.max_engines}{warm}"


@dataclass(slots=True)
class _Slot:
    engine_id: str
    role: Role
    phase: Phase
    since: float = 0.0
    flipping_to: Role | None = None
    #: bumped at every transition: a stale event for an earlier phase does nothing
    generation: int = 0


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at: float
    kind: str  # an ActionKind value, or "ready" / "drained" / "warm"
    engine_id: str
    role: str
    reason: str = ""


@dataclass(slots=True)
class AutoscaleReport:
    #: engine-seconds serving, draining, loading (the run's cost) and in the warm pool
    engine_s: float = 0.0
    warm_s: float = 0.0
    by_phase: dict[str, float] = field(default_factory=dict)
    events: list[ScaleEvent] = field(default_factory=list)
    #: (time, serving engines per role, engines loading) at every decision
    timeline: list[tuple[float, dict[str, int], int]] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)


class Autoscaler:
    def __init__(
        self,
        config: AutoscaleConfig,
        gateway: SimGateway,
        nodes: list[EngineNode],
        profile: EngineProfile,
        clock: EventQueue,
        serving: dict[str, Role],
        spare_role: Role,
    ) -> None:
        """``serving``: the engines serving at the start (by role); the other slots start warm
        (the first ``warm_pool``) or cold, labelled ``spare_role`` until they join a pool."""
        self.config = config
        self.gateway = gateway
        self.fleet: Fleet = gateway.fleet
        self.nodes = {n.engine_id: n for n in nodes}
        self.profile = profile
        self.clock = clock
        self.scaler: Scaler = make_scaler(config.policy)
        self.state = ScalingState()
        self.pd = any(r is not Role.COLLOCATED for r in serving.values())
        self.roles = (Role.PREFILL, Role.DECODE) if self.pd else (Role.COLLOCATED,)
        minimum = 1 if self.pd else config.min_engines
        self.bounds = ScalingBounds({r: minimum for r in self.roles}, config.max_engines)
        self.slots: dict[str, _Slot] = {}
        warm = config.warm_pool
        for node in nodes:
            role = serving.get(node.engine_id)
            if role is not None:
                self.slots[node.engine_id] = _Slot(node.engine_id, role, Phase.SERVING)
            else:
                phase = Phase.WARM if warm > 0 else Phase.COLD
                warm -= phase is Phase.WARM
                self.slots[node.engine_id] = _Slot(node.engine_id, spare_role, phase)
                self.fleet.eject(node.engine_id, "not provisioned")
        #: warm-pool starts in progress (cold slot -> warm)
        self._warming: set[str] = set()
        self.report = AutoscaleReport()
        #: (start, end, phase) of every finished phase span, for the cost over the run's window
        self._spans: list[tuple[float, float, Phase]] = []
        self._rates: dict[Role, deque[tuple[float, int, int]]] = {r: deque() for r in self.roles}
        self.log: Callable[[ScaleEvent], None] | None = None

    # -- the loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._replenish()
        self.clock.at(self.clock.now + self.scaler.interval_s, self._tick, daemon=True)

    def _tick(self) -> None:
        if not self.gateway._scraping:  # the run is over
            return
        view = self.view()
        decision = self.scaler.decide(view, self.state, self.bounds)
        self.state = decision.state
        for action in decision.actions:
            self._apply(action)
        self.report.timeline.append(
            (
                view.now,
                {
                    r.value: sum(1 for s in self.slots.values() if s.role is r and s.phase is Phase.SERVING)
                    for r in self.roles
                },
                sum(1 for s in self.slots.values() if s.phase is Phase.LOADING),
            )
        )
        self.clock.at(self.clock.now + self.scaler.interval_s, self._tick, daemon=True)

    # -- what the gateway sees ---------------------------------------------------------------------

    def view(self) -> FleetView:
        now = self.clock.now
        fleet = self.fleet
        engines = []
        for slot in self.slots.values():
            load = 0.0
            if slot.phase in (Phase.SERVING, Phase.DRAINING):
                load = estimated_load(fleet.engine_snapshot(slot.engine_id, now))
            engines.append(EngineView(slot.engine_id, slot.role, slot.phase, load, slot.flipping_to))
        return FleetView(now, tuple(engines), self._signals(now))

    def _signals(self, now: float) -> dict[Role, PoolSignals]:
        gw = self.gateway
        window = self.config.window_s
        waits: dict[Role, list[float]] = {r: [] for r in self.roles}
        tpots: dict[Role, list[float]] = {r: [] for r in self.roles}
        stages = getattr(gw, "stages", None)
        front = Role.PREFILL if self.pd else Role.COLLOCATED
        back = Role.DECODE if self.pd else Role.COLLOCATED
        for rid, flight in gw.flights.items():
            if not flight.tokens:
                role = front
                if stages is not None:
                    stage = stages.get(rid)
                    if stage is not None and (stage.whole or stage.prefill_done):
                        role = back
                waits[role].append((now - flight.arrival) / max(flight.target.ttft_s, 1e-9))
            elif flight.tokens > 1 and now - flight.last_at <= window:
                tpot = (flight.last_at - flight.first_at) / (flight.tokens - 1)
                tpots[back].append(tpot / max(flight.target.tpot_s, 1e-9))
        arrived = gw._count
        finished = len(gw.outcomes)
        queued = gw.core.queued(gw.model)
        if self.pd:
            prefilled = getattr(gw, "prefills_done", 0) + getattr(gw, "whole", 0)
            counts = {
                Role.PREFILL: (arrived - getattr(gw, "whole", 0), prefilled),
                Role.DECODE: (prefilled, finished),
            }
            transfers = sum(len(q.entries) for q in getattr(gw, "queues", {}).values())
            queues = {Role.PREFILL: queued, Role.DECODE: transfers}
        else:
            counts = {Role.COLLOCATED: (arrived, finished)}
            queues = {Role.COLLOCATED: queued}
        signals = {}
        for role in self.roles:
            history = self._rates[role]
            inn, out = counts[role]
            history.append((now, inn, out))
            while len(history) > 1 and now - history[1][0] >= window:
                history.popleft()
            t0, in0, out0 = history[0]
            span = now - t0
            # rates only over a full window (the first seconds' completions lag their arrivals)
            full = span >= 0.99 * window
            rate_in = (inn - in0) / span if full else 0.0
            rate_out = (out - out0) / span if full else 0.0
            signals[role] = PoolSignals(
                role, queues[role], tuple(waits[role]), tuple(tpots[role]), rate_in, rate_out
            )
        return signals

    # -- carrying actions out ----------------------------------------------------------------------

    def _event(self, kind: str, slot: _Slot, reason: str = "", role: Role | None = None) -> None:
        event = ScaleEvent(self.clock.now, kind, slot.engine_id, (role or slot.role).value, reason)
        self.report.events.append(event)
        if self.log is not None:
            self.log(event)

    def _move(self, slot: _Slot, phase: Phase) -> None:
        now = self.clock.now
        self._spans.append((slot.since, now, slot.phase))
        slot.phase = phase
        slot.since = now
        slot.generation += 1

    def _apply(self, action: ScaleAction) -> None:
        slot = self.slots.get(action.engine_id)
        if slot is None:
            return
        actions = self.report.actions
        actions[action.kind.value] = actions.get(action.kind.value, 0) + 1
        if action.kind in (ActionKind.ADD, ActionKind.WAKE):
            if slot.phase not in (Phase.WARM, Phase.COLD):
                return
            weights = self.profile.weights
            if slot.phase is Phase.COLD:
                seconds = weights.cold_start_s()
                self._warming.discard(slot.engine_id)  # (a warm-up in progress is overtaken)
            else:
                source = self.config.warm_source
                if source == "peer" and not any(s.phase is Phase.SERVING for s in self.slots.values()):
                    source = "disk"  # no running engine to copy from (§6: fall back to disk)
                seconds = weights.load_time_s(source)
            slot.role = action.role
            self._move(slot, Phase.LOADING)
            self._event(action.kind.value, slot, f"{action.reason} [ready in {seconds:.2f} s]")
            self.clock.at(self.clock.now + seconds, self._ready, slot, slot.generation)
            self._replenish()
        elif action.kind in (ActionKind.REMOVE, ActionKind.FLIP):
            if slot.phase is not Phase.SERVING:
                return
            slot.flipping_to = action.role if action.kind is ActionKind.FLIP else None
            self.fleet.set_draining(slot.engine_id, True)
            self._move(slot, Phase.DRAINING)
            self._event(action.kind.value, slot, action.reason, action.role)
            self._poll_drain(slot, slot.generation)

    def _ready(self, slot: _Slot, generation: int) -> None:
        if slot.generation != generation:
            return
        fleet = self.fleet
        if fleet.records[slot.engine_id].adapter.role is not slot.role:
            fleet.set_role(slot.engine_id, slot.role)
        self.gateway._scrape(slot.engine_id)
        self._move(slot, Phase.SERVING)
        fleet.record_health(slot.engine_id, True, 1, 1)
        self._event("ready", slot)

    def _drained(self, slot: _Slot) -> bool:
        record = self.fleet.records[slot.engine_id]
        model = self.nodes[slot.engine_id].model
        return not record.running and not model.has_work and not model.held

    def _poll_drain(self, slot: _Slot, generation: int) -> None:
        if slot.generation != generation:
            return
        if not self._drained(slot):
            self.clock.at(self.clock.now + 0.05, self._poll_drain, slot, generation, daemon=True)
            return
        fleet = self.fleet
        if slot.flipping_to is not None:
            # (still on its way into the new pool while it switches: the scaler counts it pending
            # until _flipped, or a tick in between added an engine beyond its max_pending)
            self.clock.at(
                self.clock.now + self.config.role_switch_s, self._flipped, slot, generation, slot.flipping_to
            )
            return
        fleet.eject(slot.engine_id, "scaled in")
        fleet.set_draining(slot.engine_id, False)
        warm = sum(1 for s in self.slots.values() if s.phase is Phase.WARM) + len(self._warming)
        self._move(slot, Phase.WARM if warm < self.config.warm_pool else Phase.COLD)
        self._event("drained", slot, f"now {slot.phase.value}")
        self._replenish()

    def _flipped(self, slot: _Slot, generation: int, role: Role) -> None:
        if slot.generation != generation:
            return
        fleet = self.fleet
        fleet.set_role(slot.engine_id, role)
        slot.role, slot.flipping_to = role, None
        self._move(slot, Phase.SERVING)
        fleet.set_draining(slot.engine_id, False)
        self._event("flipped", slot)

    def _replenish(self) -> None:
        """Start cold slots' runtimes until the warm pool is back to its size."""
        warm = sum(1 for s in self.slots.values() if s.phase is Phase.WARM) + len(self._warming)
        for slot in self.slots.values():
            if warm >= self.config.warm_pool:
                return
            if slot.phase is Phase.COLD and slot.engine_id not in self._warming:
                self._warming.add(slot.engine_id)
                warm += 1
                self.clock.at(
                    self.clock.now + self.profile.weights.runtime_start_s, self._warmed, slot, slot.generation
                )

    def _warmed(self, slot: _Slot, generation: int) -> None:
        if slot.generation != generation or slot.engine_id not in self._warming:
            return
        self._warming.discard(slot.engine_id)
        if slot.phase is Phase.COLD:
            self._move(slot, Phase.WARM)
            self._event("warm", slot)

    # -- the bill ----------------------------------------------------------------------------------

    def finish(self, start: float, end: float) -> AutoscaleReport:
        """Close the books over [start, end] (the run's first arrival to its last answer)."""
        spans = [*self._spans, *((s.since, max(end, s.since), s.phase) for s in self.slots.values())]
        by_phase: dict[str, float] = {}
        for t0, t1, phase in spans:
            overlap = min(t1, end) - max(t0, start)
            if overlap > 0:
                by_phase[phase.value] = by_phase.get(phase.value, 0.0) + overlap
        report = self.report
        report.by_phase = by_phase
        report.engine_s = sum(
            by_phase.get(p.value, 0.0) for p in (Phase.SERVING, Phase.DRAINING, Phase.LOADING)
        )
        report.warm_s = by_phase.get(Phase.WARM.value, 0.0)
        return report


def fixed_engine_s(engines: int, start: float, end: float) -> float:
    return engines * max(0.0, end - start) if math.isfinite(end) else math.nan
