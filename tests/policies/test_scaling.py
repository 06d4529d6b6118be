"""Scaling policies: HyperFlexis Algorithm 3 (thresholds, sustained scale-in, per-pool P/D scaling,
role flips, warm pool first, bounds) and the HPA-like threshold baseline, table-driven."""

from __future__ import annotations

import math

import pytest

from policies.api import Role
from policies.scaling import (
    TARGET_LOAD,
    ActionKind,
    Algorithm3,
    Algorithm3Params,
    EngineView,
    FleetView,
    LoadMetric,
    Phase,
    PoolSignals,
    ScalingBounds,
    ScalingState,
    ThresholdScaler,
    make_scaler,
    quantile,
)

C, P, D = Role.COLLOCATED, Role.PREFILL, Role.DECODE
S, W, K, L, DR = Phase.SERVING, Phase.WARM, Phase.COLD, Phase.LOADING, Phase.DRAINING
FULL = TARGET_LOAD[C]


def e(name: str, role: Role = C, phase: Phase = S, load: float = 0.0, to: Role | None = None) -> EngineView:
    return EngineView(name, role, phase, load, to)


def view(engines: list[EngineView], *pools: PoolSignals, now: float = 100.0) -> FleetView:
    return FleetView(now, tuple(engines), {p.role: p for p in pools} or {C: PoolSignals(C)})


def kinds(decision_actions: tuple[object, ...]) -> list[tuple[str, str, str]]:
    return [(a.kind.value, a.engine_id, a.role.value) for a in decision_actions]  # type: ignore[attr-defined]


BOUNDS = ScalingBounds({C: 1, P: 1, D: 1}, max_engines=4)


@pytest.mark.parametrize(
    ("engines", "signals", "expected"),
    [
        # idle but not yet for the hold period: nothing
        ([e("a", load=1), e("b", load=1), e("c", phase=W)], PoolSignals(C), []),
        # any one signal over its target scales out; the warm pool before a cold start
        (
            [e("a", load=FULL * 1.5), e("b", phase=K), e("c", phase=W)],
            PoolSignals(C),
            [("wake", "c", "collocated")],
        ),
        (
            [e("a", load=1), e("b", phase=K)],
            PoolSignals(C, wait_ratios=(0.9,) * 10),
            [("add", "b", "collocated")],
        ),
        (
            [e("a", load=1), e("b", phase=K)],
            PoolSignals(C, tpot_ratios=(1.0,) * 10),
            [("add", "b", "collocated")],
        ),
        # R_In / R_Process counts only with a backlog
        ([e("a", load=1), e("b", phase=K)], PoolSignals(C, arrival_rate=50, process_rate=20), []),
        (
            [e("a", load=1), e("b", phase=K)],
            PoolSignals(C, queued=3, arrival_rate=50, process_rate=20),
            [("add", "b", "collocated")],
        ),
        # no slot left (all serving or loading): nothing to add
        ([e("a", load=FULL * 3), e("b", phase=L)], PoolSignals(C), []),
        # at most max_pending (2) engines loading for one pool
        ([e("a", load=FULL * 9), e("b", phase=L), e("c", phase=L), e("d", phase=W)], PoolSignals(C), []),
    ],
)
def test_algorithm3_scale_out(
    engines: list[EngineView], signals: PoolSignals, expected: list[tuple[str, str, str]]
) -> None:
    decision = Algorithm3().decide(view(engines, signals), ScalingState(), BOUNDS)
    assert kinds(decision.actions) == expected
    assert all(a.reason for a in decision.actions)


@pytest.mark.parametrize(
    ("load", "wait", "cover", "expected"),
    [
        # one engine at 1.5x its target with one loading: the loading one covers it
        (1.5, None, True, []),
        # the same, the rule off: one per decision up to max_pending, as the paper's step
        (1.5, None, False, [("wake", "w", "collocated")]),
        # at 2.5x one loading engine is not enough: another one starts
        (2.5, None, True, [("wake", "w", "collocated")]),
        # no engine serving yet: nothing to weigh the loading one against, up to max_pending
        (None, None, True, [("wake", "w", "collocated")]),
        # an SLO signal counts the same way (wait ratio 1.8x its target: covered; 3x: not)
        (0.5, 0.9, True, []),
        (0.5, 1.5, True, [("wake", "w", "collocated")]),
    ],
)
def test_algorithm3_counts_the_engines_on_their_way(
    load: float | None, wait: float | None, cover: bool, expected: list[tuple[str, str, str]]
) -> None:
    """An autoscaler that adds engines while new ones are still starting over-provisions during
    every cold start (a peer's users' complaint): a pool whose loading engines already cover what
    its LoadMetric asks for adds none."""
    serving = [] if load is None else [e("a", load=FULL * load)]
    engines = [*serving, e("b", phase=L), e("w", phase=W)]
    signals = PoolSignals(C) if wait is None else PoolSignals(C, wait_ratios=(wait,) * 10)
    if load is None:  # (demand queued for a pool with no engine serving yet)
        signals = PoolSignals(C, queued=5)
    decision = Algorithm3(Algorithm3Params(cover_pending=cover)).decide(
        view(engines, signals), ScalingState(), BOUNDS
    )
    assert kinds(decision.actions) == expected


def test_algorithm3_waits_for_its_interval() -> None:
    scaler = Algorithm3()
    hot = view([e("a", load=FULL * 2), e("b", phase=W)], PoolSignals(C))
    state = ScalingState(last_decision=99.5)
    decision = scaler.decide(hot, state, BOUNDS)
    assert decision.actions == () and decision.state is state


def test_algorithm3_scales_in_after_a_sustained_low_period_only() -> None:
    scaler = Algorithm3(Algorithm3Params(scale_in_hold_s=10.0, scale_in_interval_s=5.0))
    engines = [e("a", load=2), e("b", load=1), e("c", load=3)]
    state = ScalingState()
    removed = []
    for t in range(100, 131):
        decision = scaler.decide(view(engines, PoolSignals(C), now=float(t)), state, BOUNDS)
        state = decision.state
        for action in decision.actions:
            assert action.kind is ActionKind.REMOVE
            removed.append((t, action.engine_id))
            engines = [x for x in engines if x.engine_id != action.engine_id]
    # the least loaded first, after the hold, then one per interval, never below the minimum
    assert removed == [(110, "b"), (115, "a")]


def test_algorithm3_a_busy_moment_resets_the_hold() -> None:
    scaler = Algorithm3(Algorithm3Params(scale_in_hold_s=10.0))
    engines = [e("a", load=1), e("b", load=1)]
    state = scaler.decide(view(engines, PoolSignals(C), now=100.0), ScalingState(), BOUNDS).state
    # between the thresholds: not low any more
    mid = PoolSignals(C, wait_ratios=(0.4,) * 5)
    state = scaler.decide(view(engines, mid, now=105.0), state, BOUNDS).state
    assert C not in state.low_since
    decision = scaler.decide(view(engines, PoolSignals(C), now=111.0), state, BOUNDS)
    assert decision.actions == ()


@pytest.mark.parametrize(
    ("engines", "pools", "expected"),
    [
        # prefill hot, decode idle with a spare engine: flip one decode engine instead of adding
        (
            [e("p0", P, load=40), e("d0", D, load=2), e("d1", D, load=1), e("x", P, W)],
            (PoolSignals(P), PoolSignals(D)),
            [("flip", "d1", "prefill")],
        ),
        # decode at its minimum: add (from the warm pool) instead
        (
            [e("p0", P, load=40), e("d0", D, load=2), e("x", P, W)],
            (PoolSignals(P), PoolSignals(D)),
            [("wake", "x", "prefill")],
        ),
        # decode not idle (between the thresholds): no flip
        (
            [e("p0", P, load=40), e("d0", D, load=40), e("d1", D, load=40), e("x", P, K)],
            (PoolSignals(P), PoolSignals(D)),
            [("add", "x", "prefill")],
        ),
        # each pool scaled on its own signals: decode TPOT over target grows decode only
        (
            [e("p0", P, load=1), e("d0", D, load=5), e("x", P, W)],
            (PoolSignals(P), PoolSignals(D, tpot_ratios=(1.2,) * 10)),
            [("wake", "x", "decode")],
        ),
        # both pools hot: the hotter first; one slot, so only it grows
        (
            [e("p0", P, load=20), e("d0", D, load=300), e("x", P, W)],
            (PoolSignals(P), PoolSignals(D)),
            [("wake", "x", "decode")],
        ),
        # an engine draining to flip into prefill counts as pending there: at this load one more
        # prefill engine is enough, and it is on its way (not counted, d2 flipped too)
        (
            [e("p0", P, load=24), e("d0", D, DR, load=1, to=P), e("d1", D, load=1), e("d2", D, load=1)],
            (PoolSignals(P), PoolSignals(D)),
            [],
        ),
        # ...and past what it covers, the next flip goes ahead
        (
            [e("p0", P, load=40), e("d0", D, DR, load=1, to=P), e("d1", D, load=1), e("d2", D, load=1)],
            (PoolSignals(P), PoolSignals(D)),
            [("flip", "d2", "prefill")],
        ),
    ],
)
def test_algorithm3_pd_pools_and_flips(
    engines: list[EngineView], pools: tuple[PoolSignals, ...], expected: list[tuple[str, str, str]]
) -> None:
    bounds = ScalingBounds({P: 1, D: 1}, max_engines=4)
    decision = Algorithm3().decide(view(engines, *pools), ScalingState(), bounds)
    assert kinds(decision.actions) == expected
    assert set(decision.metrics) == {P, D}


def test_algorithm3_respects_max_engines() -> None:
    engines = [e("a", load=FULL * 5), e("b", phase=W)]
    decision = Algorithm3().decide(view(engines, PoolSignals(C)), ScalingState(), ScalingBounds({C: 1}, 1))
    assert decision.actions == ()


def test_load_metric_is_the_largest_signal_and_scale_in_ignores_the_rate() -> None:
    m = LoadMetric(utilisation=0.2, wait=0.1, tpot=0.3, rate=0.8)
    assert m.value == 0.8 and m.level == 0.3 and m.driver() == "rate"


@pytest.mark.parametrize(
    ("values", "q", "expected"), [((), 0.9, 0.0), ((3.0, 1.0, 2.0), 0.5, 2.0), (tuple(range(1, 11)), 0.9, 9)]
)
def test_quantile(values: tuple[float, ...], q: float, expected: float) -> None:
    assert quantile(values, q) == expected


def test_no_serving_engine_with_demand_is_infinitely_full() -> None:
    scaler = Algorithm3()
    m = scaler.metric(view([e("a", phase=L)], PoolSignals(C, queued=5)), C)
    assert math.isinf(m.utilisation)


# -- the HPA-like baseline ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "spare", "expected_adds"),
    [
        ([FULL, FULL], 4, 0),  # at target
        ([FULL * 1.05, FULL], 4, 0),  # within the 10 % tolerance
        ([FULL * 2, FULL * 2], 4, 2),  # desired = ceil(2 x 2) = 4
        ([FULL * 4, FULL * 4], 8, 4),  # desired 8, at most max(100 %, 4) = 4 more per step
        ([FULL * 4, FULL * 4], 1, 1),  # only one slot
    ],
)
def test_threshold_scales_out_proportionally(loads: list[float], spare: int, expected_adds: int) -> None:
    engines = [e(f"s{i}", load=x) for i, x in enumerate(loads)] + [e(f"x{i}", phase=K) for i in range(spare)]
    decision = ThresholdScaler().decide(
        view(engines, PoolSignals(C)), ScalingState(), ScalingBounds({C: 1}, 100)
    )
    assert len(decision.actions) == expected_adds
    assert all(a.kind is ActionKind.ADD for a in decision.actions)


def test_threshold_scales_down_to_the_highest_recent_recommendation() -> None:
    scaler = ThresholdScaler()
    bounds = ScalingBounds({C: 1}, 100)
    engines = [e(f"s{i}", load=FULL * 0.25) for i in range(4)]
    # 20 s ago it wanted 4; now 1: stays at 4 until that recommendation leaves the 30 s window
    state = ScalingState(recommendations=((80.0, C, 4),))
    assert scaler.decide(view(engines, PoolSignals(C), now=100.0), state, bounds).actions == ()
    state = ScalingState(recommendations=((60.0, C, 4),))
    decision = scaler.decide(view(engines, PoolSignals(C), now=100.0), state, bounds)
    assert [a.kind for a in decision.actions] == [ActionKind.REMOVE] * 3


def test_threshold_never_flips() -> None:
    engines = [e("p0", P, load=100), e("d0", D, load=0), e("d1", D, load=0), e("x", P, K)]
    decision = ThresholdScaler().decide(
        view(engines, PoolSignals(P), PoolSignals(D)), ScalingState(), ScalingBounds({P: 1, D: 1}, 10)
    )
    assert {a.kind for a in decision.actions} <= {ActionKind.ADD, ActionKind.REMOVE}


def test_make_scaler() -> None:
    assert make_scaler("hyperflexis").name == "hyperflexis"
    assert make_scaler("HPA").name == "threshold"
    with pytest.raises(ValueError, match="unknown scaling policy"):
        make_scaler("magic")


def test_algorithm3_a_pool_that_gives_an_engine_by_a_flip_is_not_also_shrunk() -> None:
    """The shrink list was made before the flips: a decode pool low for long gave prefill an
    engine by a flip, lost its low_since with it, and the removal that followed read it (a
    KeyError: the simulator's autoscale run died). Even without it, one decision took two engines
    from the pool, and could take it below its minimum."""
    P, D = Role.PREFILL, Role.DECODE
    engines = (
        EngineView("p1", P, Phase.SERVING, load=200.0),
        EngineView("d1", D, Phase.SERVING, load=1.0),
        EngineView("d2", D, Phase.SERVING, load=1.0),
        EngineView("d3", D, Phase.SERVING, load=1.0),
    )
    pools = {P: PoolSignals(P), D: PoolSignals(D)}
    state = ScalingState(last_decision=0.0, low_since={D: 0.0})  # low since long ago
    decision = Algorithm3().decide(FleetView(100.0, engines, pools), state, ScalingBounds({P: 1, D: 1}))
    assert [(a.kind, a.role) for a in decision.actions] == [(ActionKind.FLIP, P)]


def test_algorithm3_a_pool_growing_by_its_rate_signal_gives_no_engine_away() -> None:
    """A pool below its level target but growing by its rate (a backlog arriving faster than it
    drains) flipped an engine to the other pool and woke one for itself in the same decision."""
    P, D = Role.PREFILL, Role.DECODE
    engines = (
        EngineView("p1", P, Phase.SERVING, load=200.0),
        EngineView("d1", D, Phase.SERVING, load=1.0),
        EngineView("d2", D, Phase.SERVING, load=1.0),
        EngineView("w1", P, Phase.WARM),
        EngineView("w2", P, Phase.WARM),
    )
    pools = {P: PoolSignals(P), D: PoolSignals(D, queued=1, arrival_rate=25.0, process_rate=10.0)}
    decision = Algorithm3().decide(
        FleetView(100.0, engines, pools), ScalingState(last_decision=0.0), ScalingBounds({P: 1, D: 1})
    )
    assert not any(a.kind is ActionKind.FLIP for a in decision.actions), decision.actions
    assert {a.role for a in decision.actions} == {P, D}  # each pool grows from the warm pool


def test_threshold_asks_for_exactly_the_engines_demand_needs() -> None:
    """n x (demand / (n x target)) rounds past a whole number: 11 engines at a demand of 1,600
    (25 engines' worth at 64 each) asked for 26."""
    engines = tuple(EngineView(f"e{i}", C, S, load=1600 / 11) for i in range(11))
    engines += tuple(EngineView(f"w{i}", C, W) for i in range(20))
    decision = ThresholdScaler().decide(
        FleetView(100.0, engines, {C: PoolSignals(C)}), ScalingState(), ScalingBounds()
    )
    assert decision.state.recommendations == ((100.0, C, 25),)
    assert (
        len(decision.actions) == 11 and "desired 25" in decision.actions[0].reason
    )  # (a step of max(11, 4))


def test_threshold_with_nothing_serving_adds_one_engine_and_waits_for_it() -> None:
    """Demand with no serving engine is infinite load: one engine is added, and while it loads
    no more (each decision of a cold start added another, up to max_engines)."""
    scaler = ThresholdScaler()
    bounds = ScalingBounds({C: 0}, 10)
    cold = [e(f"x{i}", phase=K) for i in range(5)]
    decision = scaler.decide(view(cold, PoolSignals(C, queued=5)), ScalingState(), bounds)
    assert kinds(decision.actions) == [("add", "x0", "collocated")]
    loading = [e("x0", phase=L), *cold[1:]]
    later = scaler.decide(view(loading, PoolSignals(C, queued=5), now=105.0), decision.state, bounds)
    assert later.actions == ()
