"""The strong baselines in the offline simulator: least-load-deadline starts its engines with
deadline scheduling (as '+prio' does), and a comparison of every shipped baseline runs end to end.
Who wins is not asserted here: that is the experiments' business."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.experiments.replay import Outcome
from gateway.experiments.workload import RequestSpec
from gateway.simulator.cli import scenario_for
from gateway.simulator.scenario import Scenario, Simulation, run, settings_for

POLICIES = ("least-load", "least-load-deadline", "flow-control", "wspt", "hyperflexis")


def _small(**kw: object) -> Scenario:
    base = Scenario("hyperflexis-4task", qps=20, policy="least-load", engines=2, requests=300, seed=4)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_the_deadline_profile_starts_its_engines_with_priority_scheduling() -> None:
    assert all(e.priority_scheduling for e in settings_for(_small(policy="least-load-deadline")).engines)
    assert not any(e.priority_scheduling for e in settings_for(_small(policy="least-load")).engines)
    sim = Simulation(_small(policy="least-load-deadline"))
    assert all(node.model.priority_scheduling for node in sim.nodes)
    assert all(r.adapter.accepts_priority for r in sim.gateway.fleet.records.values())
    assert not any(node.model.priority_scheduling for node in Simulation(_small()).nodes)


def test_the_prio_suffix_still_turns_on_engine_priority_for_any_profile() -> None:
    args = argparse.Namespace(
        workload="hyperflexis-4task",
        engines=2,
        profile="qwen-7b",
        slo_profile=None,
        requests=300,
        duration=None,
        engine_priority=False,
    )
    for policy, expected in (("least-load+prio", True), ("wspt+prio", True), ("least-load", False)):
        scenario = scenario_for(args, policy, 20.0, 0)
        assert all(e.priority_scheduling is expected for e in settings_for(scenario).engines)
        assert all(node.model.priority_scheduling is expected for node in Simulation(scenario).nodes)


def test_deadlines_reach_the_engines_of_the_deadline_profile() -> None:
    # every spec the same except its SLO: engines scheduling by deadline serve the tight ones first
    specs = [
        RequestSpec(
            at=0.001 * i,
            task="t",
            priority=0,
            prompt_tokens=400,
            output_tokens=20,
            ttft_s=0.5 if i % 2 else 30.0,
            tpot_s=1.0,
        )
        for i in range(200)
    ]

    def tight_ttft(outcomes: list[Outcome]) -> float:
        return sum(o.ttft_s for o in outcomes if o.spec.ttft_s < 1) / 100

    fifo = run(_small(engines=1), specs).outcomes
    deadline = run(_small(engines=1, policy="least-load-deadline"), specs).outcomes
    assert tight_ttft(deadline) < 0.75 * tight_ttft(fifo)


@pytest.mark.parametrize("policy", ["flow-control", "wspt"])
def test_the_gateway_queue_baselines_answer_every_request_once_and_hold_their_cap(policy: str) -> None:
    scenario = _small(policy=policy, qps=200, requests=300)
    sim = Simulation(scenario)
    assert sim.gateway.core.max_engine_load == 256
    result = sim.run()
    assert len(result.outcomes) == 300 and {o.status for o in result.outcomes} <= {200, 429}
    assert sim.gateway.core.queued() == 0 and not sim.gateway.core.tickets
    assert all(r.in_flight == 0 for r in sim.gateway.fleet.records.values())


def test_an_offline_comparison_of_every_baseline_runs_and_reports_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "baselines"
    argv = [
        "simulate",
        "--policies",
        ",".join(POLICIES),
        "--qps",
        "60,120",
        "--engines",
        "2",
        "--requests",
        "300",
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "(10/10)" in capsys.readouterr().err
    points = json.loads((out / "points.json").read_text())
    assert sorted((p["policy"], p["qps"]) for p in points) == sorted(
        (p, q) for p in POLICIES for q in (60.0, 120.0)
    )
    assert all(p["requests"] == 300 and 0.0 <= p["attainment"] <= 1.0 for p in points)
    table = (out / "table.md").read_text()
    for policy in POLICIES:
        assert table.count(f"\n| {policy} | ") == 2
