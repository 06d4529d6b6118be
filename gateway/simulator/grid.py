"""``slogate experiment grid``: the dispatcher against strong baselines across loads, workloads and
engines that are slower or faster than the gateway was told, offline.

Load is a fraction of the fleet's measured capacity (:mod:`gateway.simulator.capacity`) and is
sustained for ``--duration`` seconds of arrivals, so the end of the arrivals does not decide the
result. Every cell reports each policy's attainment (and per task), E2E p50/p99 and cost. Each
candidate (``--candidate``, HyperFlexis by default; several, comma-separated, are variants of one
another) is judged against the best of the policies that are not candidates: its ratio to it and
a verdict per cell, and the verdicts counted.
The priority ramp (HyperFlexis Fig. 6) is one more cell, at its own rates.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import summarize
from gateway.experiments.runner import split_prio
from gateway.report_json import report_json
from gateway.simulator.calibration import replay_live
from gateway.simulator.capacity import engine_capacity
from gateway.simulator.cli import add_disturb_argument, add_output_bound_argument
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.pool import run_jobs
from gateway.simulator.scenario import RunResult, Scenario, run

#: the issue's bars: never more than this below the best baseline; this ratio where it must win
MAX_DEFICIT = 0.02
MIN_WIN_RATIO = 1.3
OVERLOAD = 1.2


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    speed: float
    load: float  # fraction of capacity; 0 for the ramp, which has its own rates
    qps: float

    @property
    def name(self) -> str:
        if self.load == 0:
            return f"{self.workload} speed {self.speed:g}x"
        return f"{self.workload} speed {self.speed:g}x load {self.load:g}x"

    @property
    def must_win(self) -> bool:
        """Cells where the candidate should attain >= MIN_WIN_RATIO x the best baseline."""
        return self.load >= OVERLOAD or self.load == 0 or self.workload == "tpot-bound"


@dataclass(frozen=True, slots=True)
class Result:
    cell: Cell
    policy: str
    attainment: float
    by_task: dict[str, float]
    e2e_p50_s: float
    e2e_p99_s: float
    errors: int
    cost_units: float
    requests: int
    #: requests per task (what ``by_task`` is a share of), for pooling runs of several seeds
    task_requests: dict[str, int] = field(default_factory=dict)
    seeds: int = 1


def pooled(runs: list[Result]) -> Result:
    """One result for runs of the same cell and policy under different seeds: attainment over
    every request of every run (per task likewise); E2E percentiles and cost are the runs' means."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    requests = sum(r.requests for r in runs)
    tasks = sorted({t for r in runs for t in r.by_task})
    task_requests = {t: sum(r.task_requests.get(t, 0) for r in runs) for t in tasks}
    by_task = {
        t: sum(r.by_task.get(t, 0.0) * r.task_requests.get(t, 0) for r in runs) / max(1, task_requests[t])
        for t in tasks
    }
    return Result(
        first.cell,
        first.policy,
        sum(r.attainment * r.requests for r in runs) / max(1, requests),
        by_task,
        _mean_of_served([r.e2e_p50_s for r in runs]),
        _mean_of_served([r.e2e_p99_s for r in runs]),
        sum(r.errors for r in runs),
        sum(r.cost_units for r in runs) / len(runs),
        requests,
        task_requests,
        sum(r.seeds for r in runs),
    )


def _scenario(
    cell: Cell,
    policy: str,
    engines: int,
    duration_s: float,
    seed: int,
    disturbances: tuple[Disturbance, ...] = (),
    output_bound: str = "exact",
) -> Scenario:
    profile, prio = split_prio(policy)
    ramp = cell.load == 0
    return Scenario(
        workload=cell.workload,
        qps=cell.qps,
        policy=profile,
        engines=1 if ramp else engines,
        slo_profile="priority" if ramp else "hyperflexis-4task",
        explicit_slo=not ramp,
        duration_s=None if ramp else duration_s,
        requests=None if ramp else max(1, int(cell.qps * duration_s)),
        seed=seed,
        engine_priority=prio,
        engine_speed=cell.speed,
        disturbances=disturbances,
        output_bound=output_bound,
    )


def _run(cell: Cell, policy: str, scenario: Scenario) -> Result:
    result: RunResult = run(scenario)
    s = summarize(result.outcomes)
    tasks = sorted({o.spec.task for o in result.outcomes})
    per_task = {t: [o for o in result.outcomes if o.spec.task == t] for t in tasks}
    by_task = {t: summarize(outcomes).attainment for t, outcomes in per_task.items()}
    return Result(
        cell,
        policy,
        s.attainment,
        by_task,
        s.e2e_p50_s,
        s.e2e_p99_s,
        s.errors,
        result.cost_units,
        s.requests,
        {t: len(outcomes) for t, outcomes in per_task.items()},
    )


def cells(
    workloads: list[str], speeds: list[float], loads: list[float], engines: int, ramp_qps: float
) -> list[Cell]:
    if any(not load > 0 for load in loads):
        # (load 0 marks the priority ramp's cell, which has rates of its own)
        raise ValueError(f"loads are fractions of capacity, each > 0: got {loads}")
    out: list[Cell] = []
    for workload in workloads:
        for speed in speeds:
            capacity = engines * engine_capacity(workload, speed=speed)
            out.extend(Cell(workload, speed, load, round(load * capacity, 3)) for load in loads)
    if ramp_qps > 0:
        out.append(Cell("priority-ramp", 1.0, 0.0, ramp_qps))
    return out


def verdicts(
    results: list[Result], candidate: str, contenders: Collection[str] = ()
) -> list[tuple[Cell, float, float, str]]:
    """Per cell: the candidate's attainment, the best baseline's (every policy but the candidate
    and its ``contenders``, other variants of it that are not baselines), and how the cell fares:
    ``BELOW`` (more than MAX_DEFICIT under the best baseline); in a cell that must show a win,
    ``1.3x win``, ``no 1.3x win`` or ``1.3x impossible`` (the best baseline is above 1/1.3);
    elsewhere ``ok``; ``n/a`` with no result for the candidate or no baseline."""
    out = []
    for cell in dict.fromkeys(r.cell for r in results):
        mine = [r for r in results if r.cell == cell]
        own = next((r.attainment for r in mine if r.policy == candidate), float("nan"))
        best = max(
            (r.attainment for r in mine if r.policy != candidate and r.policy not in contenders),
            default=float("nan"),
        )
        if math.isnan(own) or math.isnan(best):
            verdict = "n/a"  # (no result for the candidate, or no baseline in the cell)
        elif own < best - MAX_DEFICIT:
            verdict = "BELOW"
        elif not cell.must_win:
            verdict = "ok"
        elif best >= 1 / MIN_WIN_RATIO:
            verdict = "1.3x impossible"
        elif own >= MIN_WIN_RATIO * best and own > 0:
            verdict = "1.3x win"
        else:
            verdict = "no 1.3x win"
        out.append((cell, own, best, verdict))
    return out


def render(results: list[Result], candidates: list[str]) -> str:
    """Every policy's attainment per cell, then each candidate against the best baseline (every
    policy not in ``candidates``): ratio and verdict per cell, and the verdicts counted."""
    policies = list(dict.fromkeys(r.policy for r in results))
    judged = {c: verdicts(results, c, [o for o in candidates if o != c]) for c in candidates}
    head = "| cell | QPS | " + " | ".join(policies) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cell in dict.fromkeys(r.cell for r in results):
        mine = {r.policy: r for r in results if r.cell == cell}
        lines.append(
            f"| {cell.name} | {cell.qps:g} | "
            + " | ".join(f"{mine[p].attainment:.1%}" if p in mine else "-" for p in policies)
            + " |"
        )
    baselines = [p for p in policies if p not in candidates]
    head = (
        "| cell | best baseline | "
        + " | ".join(candidates)
        + " | "
        + " | ".join(f"{c} / best" for c in candidates)
        + " | verdict ("
        + " / ".join(candidates)
        + ") |"
    )
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    rows = zip(*(judged[c] for c in candidates), strict=True)
    for row in rows:
        cell, _, best, _ = row[0]
        got = {r.policy: r.attainment for r in results if r.cell == cell}
        ran = [p for p in baselines if p in got]
        top = f"{max(ran, key=got.__getitem__)} {best:.1%}" if ran else "-"
        lines.append(
            f"| {cell.name} | {top} | "
            + " | ".join(f"{own:.1%}" for _, own, _, _ in row)
            + " | "
            + " | ".join(_ratio(own, best) for _, own, best, _ in row)
            + " | "
            + " / ".join(verdict for *_, verdict in row)
            + " |"
        )
    lines.append("")
    for c in candidates:
        counted = Counter(v for *_, v in judged[c])
        must = sum(1 for cell, *_ in judged[c] if cell.must_win)
        lines.append(
            f"{c}: "
            + ", ".join(f"{n} {v}" for v, n in sorted(counted.items()))
            + f" ({len(judged[c])} cells, {must} that must show a {MIN_WIN_RATIO:g}x win)"
        )
    return "\n".join(lines)


def _ratio(own: float, best: float) -> str:
    if math.isnan(own) or math.isnan(best) or (best <= 0 and own <= 0):
        return "-"  # (nothing to compare, or both attained nothing)
    return f"{own / best:.2f}" if best > 0 else "inf"


def plot(results: list[Result], path: Path) -> None:
    plt = pyplot()
    panels = sorted({(r.cell.workload, r.cell.speed) for r in results if r.cell.load > 0})
    ramps = list(dict.fromkeys(r.cell for r in results if r.cell.load == 0))
    cols = max(1, min(3, len(panels) + len(ramps)))
    rows = max(1, -(-(len(panels) + len(ramps)) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    # one colour per policy in every panel, the ramp's bars included
    policies = list(dict.fromkeys(r.policy for r in results))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {p: cycle[i % len(cycle)] for i, p in enumerate(policies)}
    for ax, cell in zip(flat[len(panels) :], ramps, strict=False):
        # the ramp has its own rates, not a load axis: a bar per policy
        mine = [r for r in results if r.cell == cell]
        ax.bar(
            [r.policy for r in mine],
            [100 * r.attainment for r in mine],
            color=[colour[r.policy] for r in mine],
        )
        ax.set_title(f"{cell.name} ({cell.qps:g} QPS)", fontsize=9)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.grid(alpha=0.3, axis="y")
    for ax, (workload, speed) in zip(flat, panels, strict=False):
        for policy in policies:
            mine = sorted(
                (
                    r
                    for r in results
                    if r.policy == policy and r.cell.workload == workload and r.cell.speed == speed
                ),
                key=lambda r: r.cell.load,
            )
            loads = [r.cell.load for r in mine]
            ax.plot(loads, [100 * r.attainment for r in mine], marker="o", label=policy, color=colour[policy])
        ax.set_title(f"{workload}, engines {speed:g}x the prior", fontsize=9)
        ax.set_xlabel("load (x capacity)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    if panels:
        axes[0][0].legend(fontsize=7)
    for ax in flat[len(panels) + len(ramps) :]:
        ax.set_visible(False)  # (the grid's last row may have panels to spare)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def live_check(results: list[Result], runs: list[tuple[Cell, str, Scenario]], out: Path | None = None) -> str:
    """Replay every run live (real time, processes) and render offline against live attainment;
    the table is (re)written to ``out`` as each run ends, and a run that fails is a row saying so."""
    by_run = {(r.cell, r.policy): r for r in results}
    lines = [
        "| cell | policy | attainment offline | attainment live | gap (points) "
        "| E2E p50 offline (s) | E2E p50 live (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (cell, policy, scenario) in enumerate(runs, 1):
        print(f"[grid live] ({i}/{len(runs)}) {cell.name}, {policy} ...", file=sys.stderr, flush=True)
        offline = by_run[(cell, policy)]
        try:
            live = replay_live(scenario)
        except Exception as exc:  # (one broken run must not lose the others' rows)
            print(
                f"[grid live] ({i}/{len(runs)}) {cell.name}, {policy}: failed: {exc}",
                file=sys.stderr,
                flush=True,
            )
            lines.append(f"| {cell.name} | {policy} | {offline.attainment:.1%} | failed: {exc} | | | |")
            if out is not None:
                out.write_text("\n".join(lines) + "\n")
            continue
        print(
            f"[grid live] ({i}/{len(runs)}) {cell.name}, {policy}: offline {offline.attainment:.1%}, "
            f"live {live.attainment:.1%}",
            file=sys.stderr,
            flush=True,
        )
        lines.append(
            f"| {cell.name} | {policy} | {offline.attainment:.1%} | {live.attainment:.1%} | "
            f"{(live.attainment - offline.attainment) * 100:+.1f} | {offline.e2e_p50_s:.3f} | "
            f"{live.e2e_p50_s:.3f} |"
        )
        if out is not None:
            out.write_text("\n".join(lines) + "\n")
    text = "\n".join(lines)
    print(text)
    return text


def _seed_list(value: str) -> list[int]:
    try:
        seeds = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {value!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct integers, at least one, got {value!r}")
    return seeds


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="hyperflexis-4task,hyperflexis-2task,tpot-bound")
    parser.add_argument(
        "--speeds", default="0.5,1,2", help="engines' true speed relative to the gateway's prior"
    )
    parser.add_argument("--loads", default="0.6,0.8,1.0,1.2,1.5", help="fractions of measured capacity")
    add_output_bound_argument(parser)
    parser.add_argument(
        "--policies",
        default="round-robin,least-load,least-load+prio,hyperflexis",
        help="routing profiles; '+prio' = the engines schedule by the gateway's TTFT deadline",
    )
    parser.add_argument(
        "--candidate",
        default="hyperflexis",
        help="the policies the verdicts are for, comma-separated: each is judged against the "
        "policies not named here (the baselines), never against another candidate",
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per cell")
    parser.add_argument(
        "--ramp-qps", type=float, default=60.0, help="total QPS of the priority ramp (0: skip)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        help="comma-separated seeds: each cell and policy runs once per seed and the runs are "
        "pooled (one seed's Poisson arrivals moved a cell's attainment by several points)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/grid"))
    add_disturb_argument(parser, " into every offline run")
    parser.add_argument(
        "--live",
        action="store_true",
        help="also replay every run in real time through engine and gateway processes, one at a "
        "time, and print offline against live attainment (pick a few cells: each run takes its "
        "--duration, and on two cores keep their QPS moderate, or the machine is measured)",
    )


def grid_main(args: argparse.Namespace) -> int:
    pyplot()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    named = [c.strip() for c in args.candidate.split(",") if c.strip()]
    if not named:
        raise SystemExit("slogate experiment grid: --candidate names no policy")
    for name in named:
        if name not in policies:
            raise SystemExit(f"slogate experiment grid: --candidate {name!r} is not in --policies")
    if not set(policies) - set(named):
        raise SystemExit("slogate experiment grid: --policies has no baseline besides the candidates")
    disturbances = tuple(args.disturbances)
    if disturbances and args.live:
        raise SystemExit("slogate experiment grid: --disturb is offline only (live runs have their own)")
    try:
        grid = cells(
            [w for w in args.workloads.split(",") if w],
            [float(x) for x in args.speeds.split(",") if x],
            [float(x) for x in args.loads.split(",") if x],
            args.engines,
            args.ramp_qps,
        )
    except ValueError as exc:
        raise SystemExit(f"slogate experiment grid: {exc}") from None
    jobs = [(cell, policy) for cell in grid for policy in policies]
    seeds: list[int] = args.seeds or [args.seed]
    total = len(jobs) * len(seeds)
    print(
        f"[grid] {len(grid)} cells x {len(policies)} policies x {len(seeds)} seeds = {total} runs",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()

    def report(done: int, job: tuple[Any, ...], result: Result) -> None:
        cell, policy, scenario = job[0], job[1], job[2]
        print(
            f"[grid] ({done}/{total}) {cell.name}, {policy}, seed {scenario.seed}: {result.attainment:.1%} "
            f"({result.requests} requests, {time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    runs = [
        (
            cell,
            policy,
            _scenario(cell, policy, args.engines, args.duration, seed, disturbances, args.output_bound),
        )
        for seed in seeds
        for cell, policy in jobs
    ]
    by_job: dict[tuple[Cell, str], list[Result]] = {}
    for result in run_jobs(_run, runs, args.jobs, report):
        by_job.setdefault((result.cell, result.policy), []).append(result)
    results = [pooled(by_job[job]) for job in jobs]
    text = render(results, named)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grid.md").write_text(text + "\n")
    (args.out / "grid.json").write_text(
        report_json(
            [
                {
                    "cell": r.cell.name,
                    "workload": r.cell.workload,
                    "speed": r.cell.speed,
                    "load": r.cell.load,
                    "qps": r.cell.qps,
                    "policy": r.policy,
                    "attainment": r.attainment,
                    "attainment_by_task": r.by_task,
                    "e2e_p50_s": r.e2e_p50_s,
                    "e2e_p99_s": r.e2e_p99_s,
                    "errors": r.errors,
                    "cost_units": r.cost_units,
                    "requests": r.requests,
                    "seeds": r.seeds,
                }
                for r in results
            ],
            indent=2,
        )
    )
    png = args.out / "grid.png"
    plot(results, png)
    if args.live:  # (the first seed's runs, against the pooled offline figures)
        live_check(results, runs[: len(jobs)], args.out / "live.md")
    print(f"[grid] done in {time.perf_counter() - started:.0f} s; wrote {args.out}/grid.md, grid.json, {png}")
    return 0


def _mean_of_served(values: list[float]) -> float:
    """The mean over the seeds that served anything (a seed with none has NaN latency)."""
    served = [v for v in values if not math.isnan(v)]
    return sum(served) / len(served) if served else math.nan
