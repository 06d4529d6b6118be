"""Fleet scaling decisions: HyperFlexis Algorithm 3 (SLO-aware scaling, §6) and an HPA-like
threshold baseline, as pure functions of a fleet view and an explicit state.

**What is decided.** Every scaling interval ``tau`` a scaler looks at each role's pool (one
``collocated`` pool, or ``prefill`` and ``decode`` pools scaled independently) and returns
:class:`ScaleAction` s, each with its reason:

* ``wake``: bring an engine of the warm pool (runtime up, weights not loaded) into a pool; its
  weights come from a running peer (device to device) or host memory: seconds;
* ``add``: start a cold engine (process start plus weights from disk: the slow path);
* ``remove``: drain an engine (no new work, what runs there finishes), then release it;
* ``flip``: drain an engine of one pool and switch its role to the other (P/D only): no weight
  load, so the cheapest way to move capacity where demand has gone (§6, "dynamically reassigns
  workers across roles when their demand diverges ... avoids unnecessary instance churn").

The mechanism (the offline simulator's ``gateway/simulator/autoscale.py``; the live scaler loop
later) carries them out and reports engines' phases back in the next :class:`FleetView`.

**From what.** Algorithm 3's inputs, per pool (:class:`PoolSignals`), as the gateway sees them:
``Utils`` (the engines' load: requests running or queued there, and the gateway's own queue for the
pool, relative to a per-engine concurrency target), ``T_wait`` (each request still waiting for its
first token: time waited / its TTFT SLO; for running streams their TPOT / TPOT SLO), ``R_In`` and
``R_Process`` (requests into and out of the pool per second over the last window).

**How** (:class:`Algorithm3`). ``LoadMetric = f(Utils, T_wait, R_In, R_Process)``: the paper leaves
``f`` open and says "if *any* of these metrics exceed an upper threshold ... scale out; if they
remain below a lower threshold for a sustained period ... scale in". So every signal is normalised
to 1 at its target (utilisation at ``target_load`` requests per engine, a quantile of the wait
ratios at ``wait_target``, of the TPOT ratios at ``tpot_target``, and ``R_In/R_Process`` at
``rate_target`` while a backlog exists), ``LoadMetric`` is their maximum, scale out above
``eps_out`` and scale in when the maximum of the level signals (not the rate ratio, which is ~1 at
any steady load) stays below ``eps_in`` for ``scale_in_hold_s``. One engine per decision and pool
("add worker", "remove worker"), at most ``max_pending`` engines of a pool loading at once, a
removal at most every ``scale_in_interval_s``. Between P/D pools, a pool that must grow takes an
engine from the other pool by a flip when that pool is below ``eps_in`` now, instead of adding
one. Scaling out prefers the warm pool (§6 "Fast Scaling") over a cold start.

**Baseline** (:class:`ThresholdScaler`): the Kubernetes HPA algorithm on one utilisation metric,
as peers autoscale LLM engines (KServe/KEDA on running + waiting requests per replica):
``desired = ceil(current * metric / target)`` with a 10 % tolerance, scale up at once (at most
``max(100 %, 4)`` engines per step), scale down to the highest recommendation of the last
``stabilization_s`` (HPA's downscale stabilisation window), per pool, no role flips; the same warm
pool preference, so it is compared on the policy, not the mechanism.

Paper: HyperFlexis (arXiv 2508.15919), §6 "Scaling Mechanism and Policy", Algorithm 3, and §8.3
"Fast Scaling Evaluation" (Table 2: weight load times from disk, CPU and a peer).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from policies.api import Role


class Phase(StrEnum):
    """Where an engine is in its life, as the scaler sees it."""

    SERVING = "serving"  # in its pool, taking work
    DRAINING = "draining"  # out of rotation; its requests finish, then it is removed or flipped
    LOADING = "loading"  # provisioning: runtime start and/or weights loading
    WARM = "warm"  # warm pool: runtime up, weights not on the device
    COLD = "cold"  # nothing running: a cold start needs the runtime and the weights from disk


class ActionKind(StrEnum):
    ADD = "add"
    WAKE = "wake"
    REMOVE = "remove"
    FLIP = "flip"


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine slot. ``role`` is its pool while serving or draining, the pool it is loading
    for while loading, and ``flipping_to`` the role a drain for a flip ends in."""

    engine_id: str
    role: Role
    phase: Phase
    #: requests running or queued on the engine (``policies.api.estimated_load``)
    load: float = 0.0
    flipping_to: Role | None = None


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """Algorithm 3's inputs for one pool, over the last window."""

    role: Role
    #: requests waiting in the gateway for this pool (admission queue, or transfer queues)
    queued: int = 0
    #: per request waiting for its first token in this pool: seconds waited / its TTFT SLO
    wait_ratios: tuple[float, ...] = ()
    #: per stream that produced tokens in the window: observed TPOT / its TPOT SLO
    tpot_ratios: tuple[float, ...] = ()
    #: R_In, R_Process: requests into / out of the pool per second
    arrival_rate: float = 0.0
    process_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class FleetView:
    now: float
    engines: tuple[EngineView, ...]
    pools: Mapping[Role, PoolSignals]

    def of(self, role: Role, *phases: Phase) -> list[EngineView]:
        return [e for e in self.engines if e.role is role and e.phase in phases]

    def serving(self, role: Role) -> list[EngineView]:
        return self.of(role, Phase.SERVING)

    def pending(self, role: Role) -> int:
        """Engines on their way into ``role``'s pool: loading for it, or draining to flip to it."""
        return sum(
            1
            for e in self.engines
            if (e.phase is Phase.LOADING and e.role is role)
            or (e.phase is Phase.DRAINING and e.flipping_to is role)
        )


@dataclass(frozen=True, slots=True)
class ScalingBounds:
    #: at least this many serving engines per pool (never removed or flipped below it)
    min_per_role: Mapping[Role, int] = field(default_factory=dict)
    #: engines serving, draining or loading, all pools together
    max_engines: int = 1_000_000

    def minimum(self, role: Role) -> int:
        return max(1, self.min_per_role.get(role, 1))


@dataclass(frozen=True, slots=True)
class ScaleAction:
    kind: ActionKind
    engine_id: str
    #: the pool the engine serves after the action (for ``remove``: the pool it leaves)
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class ScalingState:
    """What a scaler remembers between decisions; returned new by each decision."""

    last_decision: float = -math.inf
    #: per pool: since when every level signal has been below eps_in (absent: not low now)
    low_since: Mapping[Role, float] = field(default_factory=dict)
    last_out: Mapping[Role, float] = field(default_factory=dict)
    last_in: Mapping[Role, float] = field(default_factory=dict)
    #: the threshold baseline's recent recommendations: (time, role, desired engines)
    recommendations: tuple[tuple[float, Role, int], ...] = ()


@dataclass(frozen=True, slots=True)
class LoadMetric:
    """One pool's normalised signals (1.0 = at target) and the metric they make."""

    utilisation: float
    wait: float
    tpot: float
    rate: float

    @property
    def value(self) -> float:
        """Algorithm 3's LoadMetric: any signal over its target counts."""
        return max(self.utilisation, self.wait, self.tpot, self.rate)

    @property
    def level(self) -> float:
        """The signals that say how full the pool is (scale-in looks at these)."""
        return max(self.utilisation, self.wait, self.tpot)

    def driver(self) -> str:
        named = {"utilisation": self.utilisation, "wait": self.wait, "tpot": self.tpot, "rate": self.rate}
        return max(named, key=lambda k: named[k])

    def describe(self) -> str:
        return (
            f"util {self.utilisation:.2f}, wait {self.wait:.2f}, tpot {self.tpot:.2f}, rate {self.rate:.2f}"
        )


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    actions: tuple[ScaleAction, ...]
    state: ScalingState
    metrics: Mapping[Role, LoadMetric] = field(default_factory=dict)


class Scaler(Protocol):
    name: str
    interval_s: float

    def decide(self, view: FleetView, state: ScalingState, bounds: ScalingBounds) -> ScalingDecision: ...


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def utilisation(view: FleetView, role: Role, target_load: float) -> float:
    """Requests on the pool's serving engines plus its gateway queue, per serving engine, relative
    to ``target_load`` (inf when demand has no serving engine)."""
    serving = view.serving(role)
    signals = view.pools.get(role)
    demand = sum(e.load for e in serving) + (signals.queued if signals else 0)
    if not serving:
        return math.inf if demand > 0 else 0.0
    return demand / (len(serving) * target_load)


#: requests running or queued per engine (and the pool's share of the gateway queue) at which a
#: pool's utilisation is 1, for both scalers: a deployment's knob (concurrency grows with output
#: length and, near saturation, with queueing). Defaults for qwen-7b on the HyperFlexis 4-task
#: set: one engine holds ~22 requests at 40 % of its capacity, ~62 at 60 %, ~190 at 80 %
#: (measured offline), so 64 is about 60 % of capacity, where E2E has doubled; decode engines
#: hold streams for their whole output, prefill engines a prompt for ~0.1 s.
TARGET_LOAD: Mapping[Role, float] = {Role.COLLOCATED: 64.0, Role.PREFILL: 16.0, Role.DECODE: 64.0}


# -- engines to act on -------------------------------------------------------------------------


def _active_count(view: FleetView) -> int:
    return sum(1 for e in view.engines if e.phase in (Phase.SERVING, Phase.DRAINING, Phase.LOADING))


def _bring_up(view: FleetView, role: Role, taken: set[str], reason: str) -> ScaleAction | None:
    """An engine for ``role``: from the warm pool if any, else a cold start (None: no slot)."""
    for phase, kind in ((Phase.WARM, ActionKind.WAKE), (Phase.COLD, ActionKind.ADD)):
        for e in view.engines:
            if e.phase is phase and e.engine_id not in taken:
                taken.add(e.engine_id)
                return ScaleAction(kind, e.engine_id, role, reason)
    return None


def _least_loaded(view: FleetView, role: Role, taken: set[str]) -> EngineView | None:
    candidates = [e for e in view.serving(role) if e.engine_id not in taken]
    # the least loaded drains fastest; ties: the last in fleet order (keeps the first ones stable)
    return min(reversed(candidates), key=lambda e: e.load, default=None)


# -- HyperFlexis Algorithm 3 -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Algorithm3Params:
    #: tau: seconds between decisions (§9.3 tests 0.5-2 s)
    interval_s: float = 1.0
    #: upper / lower thresholds on the normalised LoadMetric
    eps_out: float = 1.0
    eps_in: float = 0.5
    #: a pool stays below eps_in this long before an engine is removed ("sustained period")
    scale_in_hold_s: float = 10.0
    #: then at most one removal per pool this often
    scale_in_interval_s: float = 5.0
    #: engines of one pool provisioning (or flipping into it) at once
    max_pending: int = 2
    #: requests running or queued per engine at which utilisation is 1, per role (TARGET_LOAD)
    target_load: Mapping[Role, float] = field(default_factory=lambda: dict(TARGET_LOAD))
    #: the quantile of the wait / TPOT ratios that counts, and the ratio that is "at target"
    quantile: float = 0.9
    wait_target: float = 0.5
    tpot_target: float = 0.8
    #: R_In / R_Process at target (counted only while the pool has a backlog)
    rate_target: float = 1.25
    #: take an engine from the other P/D pool when it is below eps_in, before adding one
    flips: bool = True
    #: add no engine while the ones on their way (loading, or flipping to the pool) cover the
    #: excess: LoadMetric x serving <= eps_out x (serving + pending). Off, a pool adds one per
    #: decision up to max_pending whatever is already starting (offline, cold starts: 8 % and
    #: 22 % more engine-seconds on the step burst and the Gamma arrivals, 0.6 points more
    #: attainment on the step burst). A pool with no engine serving has no excess to weigh (its
    #: metric has no serving count): it adds up to max_pending, as without the rule.
    cover_pending: bool = True


class Algorithm3:
    """HyperFlexis Algorithm 3 (SLO-aware scaling), per pool; see the module docstring."""

    name = "hyperflexis"

    def __init__(self, params: Algorithm3Params | None = None) -> None:
        self.params = params or Algorithm3Params()
        self.interval_s = self.params.interval_s

    def metric(self, view: FleetView, role: Role) -> LoadMetric:
        p = self.params
        signals = view.pools.get(role, PoolSignals(role))
        target = p.target_load.get(role, TARGET_LOAD[role])
        backlog = signals.queued > 0 or bool(signals.wait_ratios)
        rate = 0.0
        if backlog and signals.process_rate > 0:
            rate = signals.arrival_rate / signals.process_rate / p.rate_target
        return LoadMetric(
            utilisation(view, role, target),
            quantile(signals.wait_ratios, p.quantile) / p.wait_target,
            quantile(signals.tpot_ratios, p.quantile) / p.tpot_target,
            rate,
        )

    def decide(self, view: FleetView, state: ScalingState, bounds: ScalingBounds) -> ScalingDecision:
        p = self.params
        now = view.now
        if now - state.last_decision < p.interval_s:
            return ScalingDecision((), state)
        roles = list(view.pools)
        metrics = {role: self.metric(view, role) for role in roles}
        low_since = dict(state.low_since)
        last_out = dict(state.last_out)
        last_in = dict(state.last_in)
        grow: list[Role] = []
        shrink: list[Role] = []
        for role in roles:
            m = metrics[role]
            if m.value > p.eps_out:
                low_since.pop(role, None)
                grow.append(role)
            elif m.level < p.eps_in:
                since = low_since.setdefault(role, now)
                if (
                    now - since >= p.scale_in_hold_s
                    and now - last_in.get(role, -math.inf) >= p.scale_in_interval_s
                ):
                    shrink.append(role)
            else:
                low_since.pop(role, None)
        actions: list[ScaleAction] = []
        taken: set[str] = set()
        donors: set[Role] = set()  # pools that give an engine away by a flip in this decision
        active = _active_count(view)
        # the pool in most need first
        for role in sorted(grow, key=lambda r: -metrics[r].value):
            m = metrics[role]
            pending = view.pending(role)
            if pending >= p.max_pending:
                continue
            serving = len(view.serving(role))
            covered = serving and m.value * serving <= p.eps_out * (serving + pending)
            if p.cover_pending and pending and covered:
                # the engines on their way cover the excess the metric shows (it falls about as
                # the pool grows): another one now would start for a need already met
                continue
            why = f"{role.value} LoadMetric {m.value:.2f} > {p.eps_out:g} ({m.driver()}; {m.describe()})"
            donor = self._donor(view, role, metrics, bounds, taken, last_out, grow) if p.flips else None
            if donor is not None:
                taken.add(donor.engine_id)
                donors.add(donor.role)
                other = metrics[donor.role]
                actions.append(
                    ScaleAction(
                        ActionKind.FLIP,
                        donor.engine_id,
                        role,
                        f"{why}; {donor.role.value} below {p.eps_in:g} ({other.describe()}): flip",
                    )
                )
                low_since.pop(donor.role, None)
                last_out[role] = now
                continue
            if active >= bounds.max_engines:
                continue
            action = _bring_up(view, role, taken, why)
            if action is not None:
                actions.append(action)
                active += 1
                last_out[role] = now
        for role in shrink:
            # a pool that gave an engine away by a flip has shrunk already in this decision (its
            # serving count does not show it yet: a removal too could take it below its minimum)
            if role in donors or view.pending(role) or len(view.serving(role)) <= bounds.minimum(role):
                continue
            victim = _least_loaded(view, role, taken)
            if victim is None:
                continue
            taken.add(victim.engine_id)
            m = metrics[role]
            actions.append(
                ScaleAction(
                    ActionKind.REMOVE,
                    victim.engine_id,
                    role,
                    f"{role.value} LoadMetric {m.level:.2f} < {p.eps_in:g} for "
                    f"{now - low_since[role]:.1f} s ({m.describe()})",
                )
            )
            last_in[role] = now
        new_state = replace(state, last_decision=now, low_since=low_since, last_out=last_out, last_in=last_in)
        return ScalingDecision(tuple(actions), new_state, metrics)

    def _donor(
        self,
        view: FleetView,
        role: Role,
        metrics: Mapping[Role, LoadMetric],
        bounds: ScalingBounds,
        taken: set[str],
        last_out: Mapping[Role, float],
        grow: Collection[Role],
    ) -> EngineView | None:
        """A serving engine of the other P/D pool, if that pool is below eps_in now, is not itself
        growing (its rate signal may say so at a low level), has not grown within the hold period
        and keeps its minimum without it."""
        if role not in (Role.PREFILL, Role.DECODE):
            return None
        other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        m = metrics.get(other)
        if m is None or m.level >= self.params.eps_in or other in grow or view.pending(other):
            return None
        # a pool that grew within the hold period does not give an engine back (no ping-pong)
        if view.now - last_out.get(other, -math.inf) < self.params.scale_in_hold_s:
            return None
        if len(view.serving(other)) <= bounds.minimum(other):
            return None
        return _least_loaded(view, other, taken)


# -- the threshold baseline (Kubernetes HPA's algorithm) ----------------------------------------


@dataclass(frozen=True, slots=True)
class ThresholdParams:
    #: HPA's sync period is 15 s; engines scale faster here so that it is a strong baseline
    interval_s: float = 1.0
    #: requests running or queued per engine (and the pool's gateway queue) at target, per role
    target_load: Mapping[Role, float] = field(default_factory=lambda: dict(TARGET_LOAD))
    tolerance: float = 0.1
    #: scale down to the highest recommendation of this window (HPA default 300 s)
    stabilization_s: float = 30.0
    #: at most max(this fraction of current engines, max_up_engines) more per decision
    max_up_fraction: float = 1.0
    max_up_engines: int = 4


class ThresholdScaler:
    """HPA-like utilisation scaler per pool; see the module docstring."""

    name = "threshold"

    def __init__(self, params: ThresholdParams | None = None) -> None:
        self.params = params or ThresholdParams()
        self.interval_s = self.params.interval_s

    def decide(self, view: FleetView, state: ScalingState, bounds: ScalingBounds) -> ScalingDecision:
        p = self.params
        now = view.now
        if now - state.last_decision < p.interval_s:
            return ScalingDecision((), state)
        kept = [r for r in state.recommendations if now - r[0] < p.stabilization_s]
        actions: list[ScaleAction] = []
        taken: set[str] = set()
        active = _active_count(view)
        metrics: dict[Role, LoadMetric] = {}
        for role in view.pools:
            target = p.target_load.get(role, TARGET_LOAD[role])
            util = utilisation(view, role, target)
            metrics[role] = LoadMetric(util, 0.0, 0.0, 0.0)
            # HPA's currentReplicas: the engines the pool has or is getting
            current = len(view.serving(role)) + view.pending(role)
            if math.isinf(util):
                # demand and nothing serving: one engine, and no more while it comes up (with
                # one loading, each decision of its cold start added another, up to the bound)
                desired = current if view.pending(role) else current + 1
            elif abs(util - 1.0) <= p.tolerance:
                desired = current
            else:
                # (demand / target exactly: n x util rounds past a whole number, 25 -> 26)
                desired = math.ceil(len(view.serving(role)) * util - 1e-9) if view.serving(role) else current
            desired = max(bounds.minimum(role), desired)
            kept.append((now, role, desired))
            stable = max(d for t, r, d in kept if r is role)
            why = f"{role.value} load {util:.2f} of target {target:g}/engine: desired {desired}"
            if desired > current:
                step = max(math.ceil(p.max_up_fraction * current), p.max_up_engines)
                for _ in range(min(desired - current, step)):
                    if active >= bounds.max_engines:
                        break
                    action = _bring_up(view, role, taken, why)
                    if action is None:
                        break
                    actions.append(action)
                    active += 1
            elif stable < current and not view.pending(role):
                serving = len(view.serving(role))
                for _ in range(min(current - stable, serving - bounds.minimum(role))):
                    victim = _least_loaded(view, role, taken)
                    if victim is None:
                        break
                    taken.add(victim.engine_id)
                    actions.append(
                        ScaleAction(
                            ActionKind.REMOVE,
                            victim.engine_id,
                            role,
                            f"{why}; highest in {p.stabilization_s:g} s: {stable}",
                        )
                    )
        new_state = replace(state, last_decision=now, recommendations=tuple(kept))
        return ScalingDecision(tuple(actions), new_state, metrics)


SCALERS = ("hyperflexis", "threshold")


def make_scaler(name: str) -> Scaler:
    """``hyperflexis`` (Algorithm 3, alias ``algorithm3``) or ``threshold`` (alias ``hpa``)."""
    key = name.strip().lower()
    if key in ("hyperflexis", "algorithm3", "alg3"):
        return Algorithm3()
    if key in ("threshold", "hpa"):
        return ThresholdScaler()
    raise ValueError(f"unknown scaling policy {name!r}; use one of {', '.join(SCALERS)}")
