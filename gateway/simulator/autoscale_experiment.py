"""``slogate experiment autoscale``: bursts with autoscaling, offline (issue 12's "burst with
autoscaling").

Two bursty workloads on the HyperFlexis 4-task set, rates as multiples of the measured capacity of
one engine (:func:`gateway.simulator.capacity.engine_capacity`):

* ``step``: ``--base`` x the minimum fleet's capacity, then ``--burst`` x it for ``--burst-s``
  seconds from ``--burst-at``, then the base rate again until ``--total-s`` (the fleet must grow,
  then shrink);
* ``gamma``: the ``bursty`` workload (Gamma arrivals, cv 4) at ``--gamma-load`` x the minimum
  fleet's capacity for ``--total-s`` seconds.

Arms, all with the same dispatcher (``--policy``, HyperFlexis by default), so only the fleet
differs: fixed fleets of ``--min`` and ``--max`` engines, the threshold (HPA-like) scaler and
HyperFlexis Algorithm 3 (:mod:`policies.scaling`), each without a warm pool (cold starts: runtime
plus weights from disk) and with one of ``--warm-pool`` engines (weights from a running peer).
With ``--pd P:D`` the fleets are P/D (fixed ``P:D`` and the largest split of ``--max``; the
scalers scale each pool and Algorithm 3 flips roles).

Per arm: SLO, TTFT and TPOT attainment, E2E p50/p99, engine-seconds (HyperFlexis eq. 3 active
time) and warm-pool engine-seconds, scale actions, seconds of arrivals in 5-second windows below
90 % attainment, and (step) the time from the burst's start until every later window of the burst
attains >= 90 % (the time to recover). Writes ``table.md``, ``points.json`` and ``autoscale.png``
(arrival rate, serving engines and windowed attainment over time per arm).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import Outcome, summarize
from gateway.experiments.workload import RequestSpec
from gateway.experiments.workloads import load_workload
from gateway.report_json import report_json
from gateway.simulator.autoscale import AutoscaleConfig
from gateway.simulator.capacity import engine_capacity
from gateway.simulator.pool import run_jobs
from gateway.simulator.scenario import Scenario, run

WINDOW_S = 5.0
RECOVERED = 0.9


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    #: fixed fleet size (collocated engines or P+D), or the scaler
    engines: int
    pd: tuple[int, int] | None = None
    scaler: str | None = None
    warm_pool: int = 0


@dataclass(frozen=True, slots=True)
class Job:
    shape: str  # "step" | "gamma"
    arm: Arm
    policy: str
    base_qps: float
    burst_qps: float
    burst_at: float
    burst_s: float
    total_s: float
    min_engines: int
    max_engines: int
    seed: int
    profile: str


@dataclass(frozen=True, slots=True)
class Point:
    shape: str
    arm: str
    requests: int
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    e2e_p50_s: float
    e2e_p99_s: float
    errors: int
    engine_s: float
    warm_s: float
    actions: dict[str, int]
    below_s: float
    recover_s: float
    peak_engines: int
    wall_s: float
    #: (window start, arrivals, attainment) per window; (time, serving engines) per decision
    windows: list[tuple[float, int, float]]
    timeline: list[tuple[float, int]]


def step_burst(
    base_qps: float, burst_qps: float, burst_at: float, burst_s: float, total_s: float, seed: int
) -> list[RequestSpec]:
    """The 4-task set at ``base_qps``, with ``burst_qps`` instead during the burst."""
    pieces = (
        (0.0, burst_at, base_qps),
        (burst_at, burst_s, burst_qps),
        (burst_at + burst_s, total_s - burst_at - burst_s, base_qps),
    )
    specs: list[RequestSpec] = []
    for i, (start, length, qps) in enumerate(pieces):
        if length <= 0:
            continue
        part = load_workload(
            "hyperflexis-4task", qps=qps, duration_s=length, requests=10**9, seed=seed * 10 + i
        )
        specs += [replace(s, at=s.at + start) for s in part if s.at < length]
    return sorted(specs, key=lambda s: s.at)


def _scenario(job: Job) -> tuple[Scenario, list[RequestSpec] | None]:
    arm = job.arm
    autoscale = None
    if arm.scaler is not None:
        autoscale = AutoscaleConfig(arm.scaler, job.min_engines, job.max_engines, arm.warm_pool)
    workload = "hyperflexis-4task" if job.shape == "step" else "bursty"
    scenario = Scenario(
        workload=workload,
        qps=job.base_qps,
        policy=job.policy,
        engines=arm.engines,
        engine_profile=job.profile,
        duration_s=job.total_s,
        requests=10**9,
        seed=job.seed,
        pd=arm.pd,
        autoscale=autoscale,
    )
    specs = None
    if job.shape == "step":
        specs = step_burst(job.base_qps, job.burst_qps, job.burst_at, job.burst_s, job.total_s, job.seed)
    return scenario, specs


def windows(outcomes: list[Outcome], total_s: float) -> list[tuple[float, int, float]]:
    """Attainment of the requests arriving in each WINDOW_S window."""
    count = max(1, math.ceil(total_s / WINDOW_S))
    buckets: list[list[Outcome]] = [[] for _ in range(count)]
    for o in outcomes:
        buckets[min(count - 1, int(o.spec.at // WINDOW_S))].append(o)
    return [
        (i * WINDOW_S, len(b), sum(o.met for o in b) / len(b) if b else math.nan)
        for i, b in enumerate(buckets)
    ]


def recovery(wins: list[tuple[float, int, float]], start: float, end: float) -> float:
    """Seconds from ``start`` until every later window before ``end`` attains >= RECOVERED
    (0: never below; inf: not within [start, end))."""
    inside = [(t, a) for t, n, a in wins if start <= t < end and n]
    last_bad = max((t for t, a in inside if a < RECOVERED), default=None)
    if last_bad is None:
        return 0.0
    recovered_at = last_bad + WINDOW_S
    return recovered_at - start if recovered_at < end else math.inf


def run_job(job: Job) -> Point:
    scenario, specs = _scenario(job)
    started = time.perf_counter()
    result = run(scenario, specs)
    s = summarize(result.outcomes)
    wins = windows(result.outcomes, job.total_s)
    below = sum(WINDOW_S for _, n, a in wins if n and a < RECOVERED)
    recover = math.nan
    if job.shape == "step":
        recover = recovery(wins, job.burst_at, job.burst_at + job.burst_s)
    report = result.autoscale
    engines = job.arm.pd[0] + job.arm.pd[1] if job.arm.pd else job.arm.engines
    timeline = [(0.0, engines)]
    if report is not None:
        timeline = [(t, sum(counts.values())) for t, counts, _ in report.timeline]
    return Point(
        job.shape,
        job.arm.name,
        s.requests,
        s.attainment,
        s.ttft_attainment,
        s.tpot_attainment,
        s.e2e_p50_s,
        s.e2e_p99_s,
        s.errors,
        result.engine_s,
        report.warm_s if report is not None else 0.0,
        dict(report.actions) if report is not None else {},
        below,
        recover,
        max((n for _, n in timeline), default=engines),
        time.perf_counter() - started,
        wins,
        timeline,
    )


def arms(args: argparse.Namespace) -> list[Arm]:
    lo, hi, warm = args.min, args.max, args.warm_pool
    if args.pd is not None:
        p, d = args.pd
        big = (hi // 2 + hi % 2, hi // 2)
        out = [
            Arm(f"fixed {p}P:{d}D", p + d, args.pd),
            Arm(f"fixed {big[0]}P:{big[1]}D", hi, big),
        ]
        for scaler in ("threshold", "hyperflexis"):
            out.append(Arm(f"{scaler} {p + d}-{hi}, cold", p + d, args.pd, scaler))
            out.append(Arm(f"{scaler} {p + d}-{hi}, warm pool {warm}", p + d, args.pd, scaler, warm))
        return out
    out = [Arm(f"fixed {lo}", lo), Arm(f"fixed {hi}", hi)]
    for scaler in ("threshold", "hyperflexis"):
        out.append(Arm(f"{scaler} {lo}-{hi}, cold", lo, None, scaler))
        out.append(Arm(f"{scaler} {lo}-{hi}, warm pool {warm}", lo, None, scaler, warm))
    return out


def _fmt_s(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "not in burst" if math.isinf(value) else f"{value:.0f}"


def render(points: list[Point], header: str) -> str:
    lines = [header, ""]
    for shape in ("step", "gamma"):
        mine = [p for p in points if p.shape == shape]
        if not mine:
            continue
        lines.append(f"### {'step burst' if shape == 'step' else 'bursty Gamma arrivals (cv 4)'}")
        lines.append("")
        head = (
            "| arm | SLO attainment | TTFT ok | TPOT ok | E2E p50 (s) | E2E p99 (s) | errors | engine-s "
            "| warm-pool engine-s | peak engines | actions | s below 90% | time to recover (s) |"
        )
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for p in mine:
            acts = ", ".join(f"{k} {v}" for k, v in sorted(p.actions.items())) or "-"
            lines.append(
                f"| {p.arm} | {p.attainment:.1%} | {p.ttft_attainment:.1%} | {p.tpot_attainment:.1%} | "
                f"{p.e2e_p50_s:.2f} | {p.e2e_p99_s:.2f} | {p.errors} | {p.engine_s:,.0f} | {p.warm_s:,.0f} | "
                f"{p.peak_engines} | {acts} | {p.below_s:.0f} | {_fmt_s(p.recover_s)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(points: list[Point], path: Path, title: str) -> None:
    plt = pyplot()
    shapes = [s for s in ("step", "gamma") if any(p.shape == s for p in points)]
    fig, axes = plt.subplots(3, len(shapes), figsize=(7 * len(shapes), 9), squeeze=False)
    for col, shape in enumerate(shapes):
        mine = [p for p in points if p.shape == shape]
        rate_ax, engine_ax, att_ax = axes[0][col], axes[1][col], axes[2][col]
        first = mine[0]
        rate_ax.plot([t for t, _, _ in first.windows], [n / WINDOW_S for _, n, _ in first.windows], color="k")
        rate_ax.set_ylabel("arrivals (QPS)")
        rate_ax.set_title("step burst" if shape == "step" else "bursty Gamma (cv 4)")
        for p in mine:
            engine_ax.step([t for t, _ in p.timeline], [n for _, n in p.timeline], where="post", label=p.arm)
            att_ax.plot(
                [t for t, n, _ in p.windows if n],
                [100 * a for _, n, a in p.windows if n],
                label=p.arm,
                alpha=0.8,
            )
        engine_ax.set_ylabel("serving engines")
        att_ax.set_ylabel(f"SLO attainment per {WINDOW_S:g} s (%)")
        att_ax.set_xlabel("arrival time (s)")
        att_ax.set_ylim(0, 102)
        for ax in (rate_ax, engine_ax, att_ax):
            ax.grid(alpha=0.3)
        engine_ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pd(text: str) -> tuple[int, int]:
    from gateway.simulator.cli import pd_counts

    return pd_counts(text)


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", default="hyperflexis", help="the dispatcher (routing profile) in every arm"
    )
    parser.add_argument("--profile", default="qwen-7b", help="engine profile (profiles/engines)")
    parser.add_argument("--min", type=int, default=2, help="engines at the start and at least")
    parser.add_argument("--max", type=int, default=8, help="engines at most")
    parser.add_argument("--warm-pool", type=int, default=None, help="warm-pool engines (default max - min)")
    parser.add_argument("--pd", type=_pd, default=None, metavar="P:D", help="P/D fleets starting at P:D")
    parser.add_argument("--base", type=float, default=0.6, help="base rate, x the min fleet's capacity")
    parser.add_argument("--burst", type=float, default=2.5, help="burst rate, x the min fleet's capacity")
    parser.add_argument("--burst-at", type=float, default=60.0)
    parser.add_argument("--burst-s", type=float, default=60.0)
    parser.add_argument("--total-s", type=float, default=240.0, help="seconds of arrivals")
    parser.add_argument(
        "--gamma-load", type=float, default=1.0, help="bursty Gamma: x the min fleet's capacity"
    )
    parser.add_argument("--shapes", default="step,gamma", help="step and/or gamma")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/autoscale"))


def autoscale_main(args: argparse.Namespace) -> int:
    pyplot()
    if args.min < 1 or args.max < args.min:
        raise SystemExit("slogate experiment autoscale: need 1 <= --min <= --max")
    if args.warm_pool is None:
        args.warm_pool = args.max - (sum(args.pd) if args.pd else args.min)
    start_engines = sum(args.pd) if args.pd else args.min
    capacity = engine_capacity("hyperflexis-4task", args.profile)
    # a P/D engine pair does about one collocated engine's work: count the fleet's capacity by pairs
    fleet_capacity = capacity * (start_engines / 2 if args.pd else start_engines)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    jobs = []
    for shape in shapes:
        if shape not in ("step", "gamma"):
            raise SystemExit(f"slogate experiment autoscale: unknown shape {shape!r} (step, gamma)")
        base = args.base if shape == "step" else args.gamma_load
        for arm in arms(args):
            jobs.append(
                Job(
                    shape,
                    arm,
                    args.policy,
                    base * fleet_capacity,
                    args.burst * fleet_capacity,
                    args.burst_at,
                    args.burst_s,
                    args.total_s,
                    args.min if args.pd is None else 1,
                    args.max,
                    args.seed,
                    args.profile,
                )
            )
    fleet = f"P/D from {args.pd[0]}:{args.pd[1]}" if args.pd else f"{args.min}-{args.max} engines"
    print(
        f"[autoscale] {len(jobs)} runs ({fleet}, {args.profile}: {capacity:.1f} QPS per engine; "
        f"{min(args.jobs, len(jobs))} processes)",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()

    def report(done: int, job: tuple[Job], p: Point) -> None:
        print(
            f"[autoscale] ({done}/{len(jobs)}) {job[0].shape} / {p.arm}: {p.attainment:.1%} attained, "
            f"{p.engine_s:,.0f} engine-s, {p.requests} requests in {p.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    points = run_jobs(run_job, [(job,) for job in jobs], args.jobs, report)
    order = {(j.shape, j.arm.name): i for i, j in enumerate(jobs)}
    points.sort(key=lambda p: order[(p.shape, p.arm)])
    header = (
        f"{fleet}, {args.profile} ({capacity:.1f} QPS per engine on the 4-task set), dispatcher "
        f"{args.policy}; step: {args.base:g}x -> {args.burst:g}x -> {args.base:g}x the starting fleet's "
        f"capacity ({args.base * fleet_capacity:.0f} -> {args.burst * fleet_capacity:.0f} QPS) at "
        f"{args.burst_at:g}-{args.burst_at + args.burst_s:g} s of {args.total_s:g} s; gamma: "
        f"{args.gamma_load:g}x ({args.gamma_load * fleet_capacity:.0f} QPS mean) for {args.total_s:g} s"
    )
    text = render(points, header)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "points.json").write_text(report_json([asdict(p) for p in points], indent=1, default=str))
    png = args.out / "autoscale.png"
    plot(points, png, f"burst with autoscaling: {fleet}, {args.profile} (simulated)")
    print(
        f"[autoscale] done in {time.perf_counter() - started:.1f} s; wrote {args.out / 'table.md'}, "
        f"{args.out / 'points.json'}, {png}",
        file=sys.stderr,
    )
    return 0
