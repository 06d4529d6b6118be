"""Live against offline: one scenario replayed through real processes and through the simulator.

The live run starts simulated engines and a gateway as child processes (the experiment runner's
:class:`~gateway.experiments.runner.Stack`) and replays the same request list in real time; the
offline run simulates it. They should agree on SLO attainment and median E2E latency within
``TOLERANCE`` (relative). Run at time scale 1 and a moderate load: on two cores a live run that
is CPU-starved measures the machine, not the policy.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from gateway.experiments import runner
from gateway.experiments.replay import Summary, replay, summarize
from gateway.experiments.runner import split_prio
from gateway.simulator.scenario import Scenario, run, workload_for

TOLERANCE = 0.10
#: a tight-SLO single-task workload at which two qwen-7b engines attain ~75-80 % at 25 QPS
WORKLOAD = Path(__file__).resolve().parents[2] / "loadtest" / "workloads" / "calibration.yaml"


@dataclass(frozen=True, slots=True)
class Comparison:
    policy: str
    offline: Summary
    live: Summary

    @staticmethod
    def _gap(offline: float, live: float) -> float:
        return abs(live - offline) / max(abs(offline), 1e-9)

    @property
    def attainment_gap(self) -> float:
        return self._gap(self.offline.attainment, self.live.attainment)

    @property
    def e2e_p50_gap(self) -> float:
        return self._gap(self.offline.e2e_p50_s, self.live.e2e_p50_s)

    @property
    def ok(self) -> bool:
        return self.attainment_gap <= TOLERANCE and self.e2e_p50_gap <= TOLERANCE


def calibration_scenario(
    policy: str, qps: float = 25.0, requests: int = 300, seed: int = 3, output_bound: str = "exact"
) -> Scenario:
    """``policy``: a routing profile, ``+prio`` for deadline scheduling on the engines;
    ``output_bound``: the max_tokens the replayed clients send (live and offline alike)."""
    profile, prio = split_prio(policy)
    return Scenario(
        str(WORKLOAD),
        qps=qps,
        policy=profile,
        engines=2,
        requests=requests,
        seed=seed,
        engine_priority=prio,
        output_bound=output_bound,
    )


def replay_live(scenario: Scenario) -> Summary:
    """The scenario's requests replayed in real time through engine and gateway processes: its
    engines (count, profile, true speed, deadline scheduling for ``+prio``), its routing and SLO
    profiles, its SLO headers."""
    unsupported = [
        name
        for name, value, default in (
            ("disturbances", scenario.disturbances, ()),
            ("settings", scenario.settings, ()),
            ("pd", scenario.pd, None),
            ("max_engine_load", scenario.max_engine_load, None),
            ("num_gpu_blocks", scenario.num_gpu_blocks, None),
            ("autoscale", scenario.autoscale, None),
            ("disaggregation", scenario.disaggregation, None),
            # (the live stack's gateway checks its engines every second, its default)
            ("monitor_interval_s", scenario.monitor_interval_s, 1.0),
        )
        if value != default
    ]
    if unsupported:
        raise ValueError(f"a live replay does not set up {', '.join(unsupported)}")
    specs = workload_for(scenario)
    policy = f"{scenario.policy}+prio" if scenario.engine_priority else scenario.policy
    with runner.Stack(
        policy, scenario.engines, scenario.engine_profile, 1.0, scenario.slo_profile, scenario.engine_speed
    ) as stack:
        assert stack.gateway is not None
        outcomes = asyncio.run(
            replay(
                stack.gateway.url,
                runner.MODEL,
                specs,
                1.0,
                scenario.seed,
                progress=False,
                explicit_slo=scenario.explicit_slo,
            )
        )
    return summarize(outcomes)


def compare(scenario: Scenario) -> Comparison:
    offline = summarize(run(scenario, workload_for(scenario)).outcomes)
    return Comparison(scenario.policy, offline, replay_live(scenario))


def render(comparisons: list[Comparison]) -> str:
    lines = [
        "| policy | attainment offline | attainment live | gap | E2E p50 offline (s) "
        "| E2E p50 live (s) | gap | within 10 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        lines.append(
            f"| {c.policy} | {c.offline.attainment:.1%} | {c.live.attainment:.1%} | {c.attainment_gap:.1%} | "
            f"{c.offline.e2e_p50_s:.3f} | {c.live.e2e_p50_s:.3f} | {c.e2e_p50_gap:.1%} | "
            f"{'yes' if c.ok else 'NO'} |"
        )
    return "\n".join(lines)
