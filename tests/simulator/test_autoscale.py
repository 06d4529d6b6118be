"""Scale actions in the offline simulator (small, seconds): engines join after their provisioning
time (cold vs warm pool), removals and role flips drain first and lose no request, cost is the
engine-seconds held, and ``slogate simulate --autoscale`` / ``slogate experiment autoscale`` run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.fleet.registry import RunningEntry
from gateway.sim.profiles import load_profile
from gateway.simulator.autoscale import AutoscaleConfig
from gateway.simulator.autoscale_experiment import recovery, step_burst
from gateway.simulator.scenario import Scenario, Simulation, run
from policies.api import Role

WEIGHTS = load_profile("qwen-7b").weights


def _burst(qps: float = 90.0, duration: float = 6.0, **auto: object) -> Scenario:
    config = AutoscaleConfig(**{"policy": "hyperflexis", "min_engines": 1, "max_engines": 3, **auto})  # type: ignore[arg-type]
    return Scenario(
        "hyperflexis-4task",
        qps=qps,
        policy="least-load",
        engines=1,
        duration_s=duration,
        requests=10**6,
        seed=2,
        autoscale=config,
    )


def test_a_warm_engine_joins_after_its_peer_weight_load_and_is_routable_only_then() -> None:
    sim = Simulation(_burst(warm_pool=2))
    fleet = sim.gateway.fleet
    assert fleet.records["sim-0"].healthy
    assert not fleet.records["sim-1"].healthy and not fleet.records["sim-2"].healthy
    # when each engine was first given a request (the placement, on the virtual clock)
    placed: dict[str, float] = {}
    reserve = fleet.reserve

    def reserving(engine_id: str, request_id: str, entry: RunningEntry) -> None:
        placed.setdefault(engine_id, sim.clock.now)
        reserve(engine_id, request_id, entry)

    fleet.reserve = reserving  # type: ignore[method-assign]
    result = sim.run()
    report = result.autoscale
    assert report is not None
    wakes = [ev for ev in report.events if ev.kind == "wake"]
    assert wakes, report.events
    ready = {ev.engine_id: ev.at for ev in report.events if ev.kind == "ready"}
    first = wakes[0]
    assert ready[first.engine_id] == pytest.approx(first.at + WEIGHTS.load_time_s("peer"))
    # nothing was served by an engine before it was ready
    assert result.served_by_engine[first.engine_id] > 0
    assert all(o.status == 200 for o in result.outcomes)
    assert ready[first.engine_id] <= placed[first.engine_id] < sim.clock.now


def test_a_cold_start_takes_the_runtime_and_the_disk_load() -> None:
    result = run(_burst(warm_pool=0))
    report = result.autoscale
    assert report is not None
    adds = [ev for ev in report.events if ev.kind == "add"]
    assert adds and f"[ready in {WEIGHTS.cold_start_s():.2f} s]" in adds[0].reason
    # the burst is over before a cold engine is up: it never served, but its loading is paid for
    assert not any(ev.kind == "ready" for ev in report.events)
    assert result.served_by_engine[adds[0].engine_id] == 0
    assert report.by_phase["loading"] > 0
    assert WEIGHTS.cold_start_s() > WEIGHTS.load_time_s("disk") > WEIGHTS.load_time_s("peer")


def test_cost_is_the_engine_seconds_held_between_the_fixed_fleets() -> None:
    small = run(
        Scenario(
            "hyperflexis-4task",
            qps=90,
            policy="least-load",
            engines=1,
            duration_s=6,
            requests=10**6,
            seed=2,
        )
    )
    scaled = run(_burst(warm_pool=2))
    assert scaled.autoscale is not None
    assert small.engine_s == pytest.approx(small.makespan_s)
    assert small.engine_s < scaled.engine_s < 3 * scaled.makespan_s
    phases = scaled.autoscale.by_phase
    assert scaled.engine_s == pytest.approx(
        phases.get("serving", 0) + phases.get("loading", 0) + phases.get("draining", 0)
    )
    assert scaled.autoscale.warm_s > 0
    assert scaled.cost_units == pytest.approx(scaled.engine_s / 0.05)


def test_removal_drains_first_and_loses_no_request() -> None:
    # a short burst then a long quiet tail: engines are added, then removed after the hold
    from gateway.simulator.autoscale_experiment import step_burst as burst

    specs = burst(20.0, 140.0, 2.0, 8.0, 40.0, seed=1)
    scenario = _burst(warm_pool=1)
    result = run(scenario, specs)
    report = result.autoscale
    assert report is not None
    kinds = [ev.kind for ev in report.events]
    assert "remove" in kinds and "drained" in kinds
    assert all(o.status == 200 for o in result.outcomes)
    assert len(result.outcomes) == len(specs)
    removed = [ev for ev in report.events if ev.kind == "remove"]
    drained = {ev.engine_id: ev.at for ev in report.events if ev.kind == "drained"}
    for ev in removed:
        finished_there = [o.start_s + o.e2e_s for o in result.outcomes if o.engine == ev.engine_id]
        if ev.engine_id in drained:
            assert max(finished_there, default=0.0) <= drained[ev.engine_id] + 1e-9


def _pd_scaled(**auto: object) -> Scenario:
    """A P/D run whose prefill pool is the bottleneck at 1:2 (a decode engine flips to prefill)."""
    return Scenario(
        "hyperflexis-4task",
        qps=60,
        policy="least-load",
        duration_s=12,
        requests=10**6,
        seed=3,
        pd=(1, 2),
        disaggregation="always",
        autoscale=AutoscaleConfig("hyperflexis", 1, 4, 1, **auto),  # type: ignore[arg-type]
    )


def test_pd_scales_each_pool_and_flips_roles_without_losing_requests() -> None:
    sim = Simulation(_pd_scaled())
    assert sim.gateway.fleet.records["spare-0"].adapter.role is Role.PREFILL
    result = sim.run()
    report = result.autoscale
    assert report is not None
    assert all(o.status == 200 for o in result.outcomes)
    # the prefill pool is the bottleneck at 1:2: a decode engine flips to prefill (no weight load),
    # then the decode pool grows from the warm pool
    flips = [ev for ev in report.events if ev.kind == "flip"]
    assert flips and flips[0].role == "prefill"
    flipped = [ev for ev in report.events if ev.kind == "flipped"]
    assert flipped and sim.gateway.fleet.records[flipped[0].engine_id].adapter.role is Role.PREFILL
    assert flipped[0].at == pytest.approx(flips[0].at, abs=2.0)
    assert any(ev.kind == "wake" and ev.role == "decode" for ev in report.events)
    assert set(report.timeline[-1][1]) == {"prefill", "decode"}


def test_an_engine_switching_role_counts_as_pending_for_its_new_pool() -> None:
    """Drained, a flipping engine switches role for ``role_switch_s``: in that time it was neither
    serving nor pending anywhere, and a scaler tick could add another engine to the pool it was
    joining beyond the policy's max_pending."""
    sim = Simulation(_pd_scaled(role_switch_s=3.0))
    auto = sim.autoscaler
    assert auto is not None
    seen: list[int] = []
    flipped = auto._flipped

    def spy(slot: object, generation: int, role: Role) -> None:
        seen.append(auto.view().pending(role))  # the moment before the switch ends
        flipped(slot, generation, role)  # type: ignore[arg-type]

    auto._flipped = spy  # type: ignore[method-assign]
    result = sim.run()
    assert result.autoscale is not None and any(ev.kind == "flipped" for ev in result.autoscale.events)
    assert seen and all(n >= 1 for n in seen), seen


def test_recovery_time() -> None:
    wins = [(0.0, 10, 1.0), (5.0, 10, 0.5), (10.0, 10, 0.8), (15.0, 10, 0.95), (20.0, 10, 1.0)]
    assert recovery(wins, 5.0, 25.0) == 10.0
    assert recovery(wins, 15.0, 25.0) == 0.0
    assert math.isinf(recovery(wins, 5.0, 15.0))


def test_step_burst_rates() -> None:
    specs = step_burst(10.0, 50.0, 10.0, 10.0, 30.0, seed=0)
    during = sum(1 for s in specs if 10 <= s.at < 20)
    before = sum(1 for s in specs if s.at < 10)
    assert 350 < during < 650 and 60 < before < 140
    assert specs == sorted(specs, key=lambda s: s.at)


def test_simulate_autoscale_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    argv = ["simulate", "--workload", "hyperflexis-4task", "--policies", "least-load", "--qps", "120"]
    argv += ["--engines", "1", "--duration", "8", "--requests", "100000", "--jobs", "1", "--out", str(out)]
    argv += ["--autoscale", "--max-engines", "3", "--warm-pool", "2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "autoscale hyperflexis 1-3, warm pool 2 (peer)" in err
    points = json.loads((out / "points.json").read_text())
    fixed = 1 * 8 / 0.05
    assert points[0]["cost_units"] > fixed  # engines were added and paid for


def test_experiment_autoscale_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exp"
    argv = ["experiment", "autoscale", "--min", "1", "--max", "2", "--burst-at", "3", "--burst-s", "4"]
    argv += [
        "--total-s",
        "10",
        "--shapes",
        "step",
        "--jobs",
        "1",
        "--out",
        str(out),
        "--policy",
        "least-load",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "(6/6)" in captured.err
    table = (out / "table.md").read_text()
    for arm in ("fixed 1", "fixed 2", "threshold 1-2, cold", "hyperflexis 1-2, warm pool 1"):
        assert f"| {arm} |" in table
    assert (out / "autoscale.png").stat().st_size > 10_000
