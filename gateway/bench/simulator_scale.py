"""``slogate bench simulator``: how long the offline simulator takes as the cluster grows.

Each point simulates ``--per-engine`` requests per engine (781 x 256 = 199,936) of the 4-task
workload at ``--qps-per-engine`` (about 70 % of what a qwen-7b engine serves), so the load per
engine is the same at every size and only the cluster grows. Measured: wall time of the run (the
workload is generated before), events, cost per event and per request. Target from the issue: 256
engines and 200,000 requests in under 10 minutes on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import summarize
from gateway.report_json import report_json
from gateway.simulator.scenario import Scenario, Simulation

TARGET_S = 600.0
TARGET_ENGINES = 256


@dataclass(frozen=True, slots=True)
class ScalePoint:
    policy: str
    engines: int
    requests: int
    events: int
    wall_s: float
    setup_s: float
    us_per_event: float
    us_per_request: float
    attainment: float
    virtual_s: float


def run_point(policy: str, engines: int, per_engine: int, qps_per_engine: float, seed: int) -> ScalePoint:
    scenario = Scenario(
        "hyperflexis-4task",
        qps=engines * qps_per_engine,
        policy=policy,
        engines=engines,
        requests=engines * per_engine,
        seed=seed,
    )
    started = time.perf_counter()
    simulation = Simulation(scenario)
    setup = time.perf_counter() - started
    result = simulation.run()
    return ScalePoint(
        policy,
        engines,
        len(result.outcomes),
        result.events,
        result.wall_s,
        setup,
        result.wall_s / max(1, result.events) * 1e6,
        result.wall_s / max(1, len(result.outcomes)) * 1e6,
        summarize(result.outcomes).attainment,
        result.makespan_s,
    )


def render(points: list[ScalePoint]) -> str:
    lines = [
        "| policy | engines | requests | events | wall (s) | µs per event | µs per request | virtual s "
        "| attainment |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.policy} | {p.engines} | {p.requests:,} | {p.events:,} | {p.wall_s:.1f} | "
            f"{p.us_per_event:.0f} | {p.us_per_request:.0f} | {p.virtual_s:.0f} | {p.attainment:.1%} |"
        )
    big = [p for p in points if p.engines >= TARGET_ENGINES and p.requests >= 199_000]
    if big:
        worst = max(p.wall_s + p.setup_s for p in big)
        verdict = "met" if worst <= TARGET_S else "MISSED"
        lines.append(
            f"\ntarget: {TARGET_ENGINES} engines / 200k requests in <= {TARGET_S:.0f} s: "
            f"{verdict} ({worst:.0f} s)"
        )
    return "\n".join(lines)


def plot(points: list[ScalePoint], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in sorted({p.policy for p in points}):
        mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.engines)
        left.plot([p.engines for p in mine], [p.wall_s for p in mine], marker="o", label=policy)
        right.plot([p.engines for p in mine], [p.us_per_event for p in mine], marker="o", label=policy)
    for ax, label in ((left, "wall time (s)"), (right, "µs per event")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines (requests grow with them)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.axhline(TARGET_S, color="grey", linestyle=":", label="target at 256 engines")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_simulator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="16,64,256", help="comma-separated engine counts")
    parser.add_argument(
        "--per-engine", type=int, default=781, help="requests per engine (781 x 256 = 199,936)"
    )
    parser.add_argument("--qps-per-engine", type=float, default=20.0)
    parser.add_argument("--policies", default="least-load,hyperflexis")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/bench-simulator"))


def bench_simulator_main(args: argparse.Namespace) -> int:
    pyplot()
    engines = [int(x) for x in args.engines.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    points: list[ScalePoint] = []
    total = len(engines) * len(policies)
    for policy in policies:
        for n in engines:
            print(
                f"[bench] ({len(points) + 1}/{total}) {policy}: {n} engines, "
                f"{n * args.per_engine:,} requests",
                file=sys.stderr,
                flush=True,
            )
            point = run_point(policy, n, args.per_engine, args.qps_per_engine, args.seed)
            print(
                f"[bench]   {point.wall_s:.1f} s, {point.events:,} events, {point.us_per_event:.0f} µs/event",
                file=sys.stderr,
                flush=True,
            )
            points.append(point)
    table = render(points)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "points.json").write_text(report_json([asdict(p) for p in points], indent=2))
    png = args.out / "simulator_scale.png"
    plot(points, png)
    print(f"wrote {args.out / 'table.md'}, {args.out / 'points.json'} and {png}")
    return 0
