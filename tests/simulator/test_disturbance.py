"""Injected disturbances do what they say, so robustness comparisons measure the policies."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.experiments.replay import summarize
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.scenario import Scenario, Simulation, run


def _base(**kw: object) -> Scenario:
    scenario = Scenario(
        "hyperflexis-4task", qps=40, policy="least-load", engines=2, duration_s=40, requests=1600
    )
    return dataclasses.replace(scenario, **kw)  # type: ignore[arg-type]


def test_parse() -> None:
    assert Disturbance.parse("slow-engine:10:20") == Disturbance("slow-engine", 10.0, 20.0, 3.0)
    assert Disturbance.parse("gateway-stall:0:5:0.5").magnitude == 0.5
    assert Disturbance.parse("relay-delay:0:5") == Disturbance("relay-delay", 0.0, 5.0, 0.02)
    with pytest.raises(ValueError):
        Disturbance.parse("relay-delay:0:5:-1")
    for bad in ("slow:1:2", "slow-engine:2:1", "slow-engine:a:b", "slow-engine:1", "slow-engine:0:1:0"):
        with pytest.raises(ValueError):
            Disturbance.parse(bad)


def test_a_slow_engine_runs_slower_only_inside_its_window() -> None:
    clean = run(_base())
    slow = run(_base(disturbances=(Disturbance("slow-engine", 10.0, 30.0, 4.0),)))
    # engine 0's steps take 4x longer inside the window: least load still sends it its share
    assert summarize(slow.outcomes).attainment < summarize(clean.outcomes).attainment - 0.05
    inside = [o for o in slow.outcomes if o.engine == "sim-0" and 12 <= o.spec.at < 28]
    before = [o for o in slow.outcomes if o.engine == "sim-0" and o.spec.at < 9]
    mean = lambda xs: sum(o.tpot_s for o in xs) / len(xs)  # noqa: E731
    assert mean(inside) > 2 * mean(before)


@pytest.mark.parametrize(
    ("windows", "expected"),
    [
        # back to back, the later listed first: the first window's start came before the second's
        # end at t=20 and was undone by it (normal speed for the whole first window)
        ((("slow-engine", 20.0, 30.0, 4.0), ("slow-engine", 10.0, 20.0, 2.0)), {15: 2.0, 25: 4.0, 35: 1.0}),
        # overlapping: they compound, and each end takes back its own factor only
        ((("slow-engine", 10.0, 40.0, 3.0), ("slow-engine", 20.0, 30.0, 5.0)), {15: 3.0, 25: 15.0, 35: 3.0}),
    ],
)
def test_slow_engine_windows_on_one_engine_do_not_undo_each_other(
    windows: tuple[tuple[str, float, float, float], ...], expected: dict[float, float]
) -> None:
    sim = Simulation(_base(duration_s=1.0, requests=1, disturbances=tuple(Disturbance(*w) for w in windows)))
    model = sim.nodes[0].model
    seen: dict[float, float] = {}
    for at in expected:
        sim.clock.at(at, lambda at=at: seen.__setitem__(at, model.slow_factor))
    sim.clock.run()
    assert seen == pytest.approx(expected)


def test_stale_scrapes_freeze_what_the_gateway_knows_of_the_engines() -> None:
    sim = Simulation(_base(disturbances=(Disturbance("stale-scrapes", 5.0, 10**6, 0.0),)))
    sim.run()
    assert all(r.state_at < 6.0 for r in sim.gateway.fleet.records.values())
    # as the live monitor marks it once its scrapes time out past stale_after_s: placements
    # stop reading the frozen KV use (a busy engine's last reading kept it parked as full)
    assert all(r.state_stale for r in sim.gateway.fleet.records.values())
    clean = Simulation(_base())
    clean.run()
    assert all(r.state_at > 30.0 for r in clean.gateway.fleet.records.values())


def test_a_gateway_stall_delays_what_clients_see_by_about_its_length() -> None:
    clean = run(_base(qps=10, requests=400))
    stalled = run(_base(qps=10, requests=400, disturbances=(Disturbance("gateway-stall", 10.0, 20.0, 0.5),)))
    inside = [o.ttft_s for o in stalled.outcomes if 11 <= o.spec.at < 19]
    baseline = [o.ttft_s for o in clean.outcomes if 11 <= o.spec.at < 19]
    # arrival handling, dispatch and the first token are each handled 0.5 s late
    assert sum(inside) / len(inside) > sum(baseline) / len(baseline) + 0.9
    assert [o.ttft_s for o in stalled.outcomes if o.spec.at < 9] == [
        o.ttft_s for o in clean.outcomes if o.spec.at < 9
    ]


def test_a_relay_delay_shows_every_token_and_end_that_much_later_in_order() -> None:
    """Tokens and ends reach the gateway (and its clients) ``magnitude`` after the engine made
    them; arrivals and dispatch are not delayed. On an idle fleet (least load, one request at a
    time per engine) each request's whole timeline moves by exactly the delay."""
    light = {"qps": 2, "requests": 60, "duration_s": None}
    clean = run(_base(**light))
    relayed = run(_base(**light, disturbances=(Disturbance("relay-delay", 0.0, 10**6, 0.05),)))
    assert len(clean.outcomes) == len(relayed.outcomes) == 60
    by_id = {o.spec.at: o for o in clean.outcomes}
    for late in relayed.outcomes:
        early = by_id[late.spec.at]
        assert late.ttft_s == pytest.approx(early.ttft_s + 0.05, abs=0.03)
        assert late.e2e_s == pytest.approx(early.e2e_s + 0.05, abs=0.03)
        assert late.tokens == early.tokens


def test_what_a_window_held_back_is_not_overtaken_when_it_ends() -> None:
    """Each event's delay was fixed when it was made: at the window's end a token made just
    after it was handled before the ones made just before, the stream's finish too, and the
    streams crossing the end lost their last tokens (and their TTFT came out early)."""
    light = {"qps": 4, "requests": 120, "duration_s": None}
    for kind in ("relay-delay", "gateway-stall"):
        held = run(_base(**light, disturbances=(Disturbance(kind, 0.0, 12.0, 0.5),)))
        served = [o for o in held.outcomes if o.status == 200]
        assert len(served) == 120, kind
        assert all(o.tokens == o.spec.output_tokens for o in served), kind


@pytest.mark.parametrize("kind", ["relay-delay", "gateway-stall"])
def test_a_relay_delay_brings_the_scrapes_answers_that_much_later_too(kind: str) -> None:
    """The engine's metrics come back over the same path as its tokens: a scrape sent at t reads
    the engine as it was at t and reaches the gateway at t + delay (recorded with its send time,
    as the live monitor records it). Answered at once, a delayed token stream and a punctual
    scrape disagreed on every interval's step count, which no live gateway sees."""
    sim = Simulation(_base(qps=10, requests=100, disturbances=(Disturbance(kind, 0.0, 10**6, 0.05),)))
    seen: list[tuple[float, float, float]] = []  # (recorded at, sent at, the clock then)
    fleet = sim.gateway.fleet
    fleet.listeners.append(
        lambda engine_id, what: (
            what == "state"
            and seen.append(
                (fleet.records[engine_id].state_at, fleet.records[engine_id].scrape_sent_at, sim.clock.now)
            )
        )
    )
    sim.run()
    assert len(seen) >= 10
    for received, sent, _ in seen:
        assert received - sent == pytest.approx(0.05)


def test_hyperflexis_loses_no_more_than_least_load_to_a_stalled_gateway() -> None:
    # a 0.3 s stall for 20 s at 50 QPS: every event the gateway handles is late, so a tight-TTFT
    # arrival (medical_qa, 0.7 s) has little left; HyperFlexis must not add its workers' timers
    # to that (it lost 8.8 points against least-load's 6.3 before it compensated for the lag)
    stall = (Disturbance("gateway-stall", 20.0, 40.0, 0.3),)
    drop = {}
    for policy in ("least-load+prio", "hyperflexis"):
        base = _base(qps=50, duration_s=60, requests=3000, policy=policy.removesuffix("+prio"))
        if policy.endswith("+prio"):
            base = dataclasses.replace(base, engine_priority=True)
        clean = summarize(run(base).outcomes).attainment
        stalled = summarize(run(dataclasses.replace(base, disturbances=stall)).outcomes).attainment
        drop[policy] = clean - stalled
    assert drop["hyperflexis"] <= drop["least-load+prio"] + 0.01, drop


def test_a_scrape_sent_before_a_relay_delay_ends_never_overwrites_a_later_one() -> None:
    """The last delayed scrape of a window can come back after the first prompt one past it: the
    older reading must not replace the newer (its counters would read as an engine restart)."""
    sim = Simulation(_base(qps=10, requests=200, disturbances=(Disturbance("relay-delay", 0.0, 5.0, 1.5),)))
    fleet = sim.gateway.fleet
    sent: dict[str, float] = {}
    backwards: list[tuple[str, float, float]] = []  # (the fleet swallows a listener's exception)

    def watch(engine_id: str, what: str) -> None:
        if what == "state":
            at = fleet.records[engine_id].scrape_sent_at
            if at < sent.get(engine_id, -1.0):
                backwards.append((engine_id, at, sent[engine_id]))
            sent[engine_id] = at

    fleet.listeners.append(watch)
    sim.run()
    assert len(sent) == 2 and not backwards
