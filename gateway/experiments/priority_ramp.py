"""``slogate experiment priority-ramp``: HyperFlexis Fig. 6, priorities joining over time.

P3 starts alone at ``--qps`` per client; every ``--join-every`` seconds the next higher priority
joins at the same rate, until P0..P3 all run. Requests carry only ``x-priority``: the gateway's
priority profile (HyperFlexis Algorithm 2) turns priorities into TTFT/TPOT targets, which it
echoes in ``x-slo-ttft-ms``. Reported per policy: P0 TTFT attainment in every 10-s window,
against the target the gateway assigned and against P0's fixed upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import Outcome, replay
from gateway.experiments.runner import MODEL, Stack
from gateway.experiments.workload import HYPERFLEXIS_4TASK, priority_ramp
from gateway.report_json import report_json

#: P0's TTFT upper bound in profiles/slo/priority.yaml (Table 1 medical_qa 0.7 s + 25 %)
P0_TTFT_BOUND_S = 0.875
WINDOW_S = 10.0


def windows(outcomes: Sequence[Outcome], priority: int, duration_s: float) -> list[dict[str, float]]:
    rows = []
    start = 0.0
    while start < duration_s:
        inside = [
            o for o in outcomes if o.spec.priority == priority and start <= o.spec.at < start + WINDOW_S
        ]
        if inside:
            rows.append(
                {
                    "window_start_s": start,
                    "requests": len(inside),
                    "ttft_met_assigned": sum(o.assigned_ttft_met for o in inside) / len(inside),
                    "ttft_met_bound": sum(o.status == 200 and o.ttft_s <= P0_TTFT_BOUND_S for o in inside)
                    / len(inside),
                    # (over the requests served: the shed ones have no first token)
                    "mean_ttft_s": _mean([o.ttft_s for o in inside if o.status == 200]),
                    "mean_assigned_ttft_s": sum(o.assigned_ttft_s for o in inside) / len(inside),
                }
            )
        start += WINDOW_S
    return rows


def plot(results: dict[str, list[Outcome]], path: Path, duration_s: float) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), sharey=True, squeeze=False)
    for ax, (policy, outcomes) in zip(axes[0], results.items(), strict=True):
        for priority in range(4):
            mine = [o for o in outcomes if o.spec.priority == priority and o.status == 200]
            if not mine:
                continue
            seconds = sorted({int(o.spec.at) for o in mine})
            measured = [
                sum(o.ttft_s for o in mine if int(o.spec.at) == t) / sum(int(o.spec.at) == t for o in mine)
                for t in seconds
            ]
            assigned = [
                sum(o.assigned_ttft_s for o in mine if int(o.spec.at) == t)
                / sum(int(o.spec.at) == t for o in mine)
                for t in seconds
            ]
            line = ax.plot(seconds, measured, label=f"P{priority} TTFT")[0]
            ax.plot(seconds, assigned, linestyle=":", color=line.get_color(), label=f"P{priority} SLO")
        ax.set_title(policy)
        ax.set_xlabel("time (s)")
        ax.set_yscale("log")
        ax.set_xlim(0, duration_s)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT (s), per-second mean")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_ramp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="round-robin,hyperflexis")
    parser.add_argument("--qps", type=float, default=15.0, help="per client (priority level)")
    parser.add_argument("--join-every", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--profile", default="qwen-7b")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/experiment-b"))


def ramp_main(args: argparse.Namespace) -> int:
    pyplot()  # fail now, not after the runs, if matplotlib is missing
    workload = priority_ramp(HYPERFLEXIS_4TASK, args.qps, args.join_every, args.duration, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[Outcome]] = {}
    report: dict[str, list[dict[str, float]]] = {}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        print(f"[experiment] {policy}: {len(workload)} requests over {args.duration:.0f} s", file=sys.stderr)
        with Stack(policy, args.engines, args.profile, args.time_scale, "priority") as stack:
            assert stack.gateway is not None
            results[policy] = asyncio.run(
                replay(
                    stack.gateway.url,
                    MODEL,
                    workload,
                    args.time_scale,
                    args.seed,
                    label=policy,
                    explicit_slo=False,
                )
            )
        report[policy] = windows(results[policy], 0, args.duration)
    lines = [
        f"{'policy':<14} {'window':>8} {'P0 reqs':>8} {'TTFT<=assigned':>15} {'TTFT<=0.875s':>13} "
        f"{'mean TTFT':>10} {'mean SLO':>9}"
    ]
    for policy, rows in report.items():
        for r in rows:
            lines.append(
                f"{policy:<14} {r['window_start_s']:>6.0f}s {r['requests']:>8.0f} "
                f"{r['ttft_met_assigned']:>15.1%} {r['ttft_met_bound']:>13.1%} "
                f"{r['mean_ttft_s']:>9.3f}s {r['mean_assigned_ttft_s']:>8.3f}s"
            )
    table = "\n".join(lines)
    print(table)
    (args.out / "table.txt").write_text(table + "\n")
    (args.out / "results.json").write_text(report_json(report, indent=2))
    png = args.out / "ttft_over_time.png"
    plot(results, png, args.duration)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'table.txt'} and {png}")
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
