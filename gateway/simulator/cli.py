"""``slogate simulate``: compare routing policies on a workload over a QPS range, offline.

Every (policy, QPS, seed) point is an independent virtual-time run of the gateway's own dispatch
core in front of simulated engines (:mod:`gateway.simulator.scenario`); points run in parallel
worker processes, one per core. Writes a Markdown table, the points as JSON, and PNG plots.

A policy is a routing profile name (``profiles/routing``) or path; ``+prio`` after it makes the
engines order their own queues by the TTFT deadline the gateway sends (the engines'
priority scheduling, a strong SLO-aware baseline for any routing profile).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from gateway.experiments.plotting import pyplot
from gateway.experiments.priority_ramp import plot as plot_ramp
from gateway.experiments.replay import Outcome
from gateway.experiments.runner import PRIO_SUFFIX, split_prio
from gateway.experiments.workload import OUTPUT_BOUNDS
from gateway.experiments.workloads import read_workload
from gateway.report_json import report_json
from gateway.simulator.autoscale import WARM_SOURCES, AutoscaleConfig
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.report import Row, plot_curves, row, table
from gateway.simulator.scenario import RunResult, Scenario, run


def disturbance_argument(text: str) -> Disturbance:
    try:
        return Disturbance.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_disturb_argument(parser: argparse.ArgumentParser, where: str = "") -> None:
    """``--disturb`` (repeatable) into ``args.disturbances``, for simulate and the grid."""
    parser.add_argument(
        "--disturb",
        dest="disturbances",
        action="append",
        type=disturbance_argument,
        default=[],
        metavar="KIND:START:END[:MAGNITUDE[:ENGINE]]",
        help=f"inject{where} slow-engine (x slower; a 5th field names the engine, e.g. "
        "slow-engine:10:40:3:decode-1), stale-scrapes, gateway-stall (s late) or relay-delay "
        "(tokens and ends reach the gateway s late, e.g. relay-delay:0:1000:0.02); repeatable",
    )


def parse_rates(text: str) -> list[float]:
    """``a:b:step`` (inclusive) or a comma-separated list; every rate > 0."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0:
                raise ValueError
            rates, value = [], start
            while value <= stop + 1e-9 * max(1.0, abs(stop)):
                rates.append(round(value, 9))
                value = start + step * len(rates)
        else:
            rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"slogate simulate: --qps must be a:b:step or a comma list of numbers, got {text!r}"
        ) from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"slogate simulate: --qps needs rates > 0, got {text!r}")
    return rates


def _disaggregation(text: str) -> str:
    from gateway.simulator.pd import disaggregation_params

    try:
        disaggregation_params(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _speeds(text: str) -> tuple[float, ...]:
    try:
        speeds = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        speeds = ()
    if not speeds or any(not v > 0 for v in speeds):
        raise argparse.ArgumentTypeError(f"expected a comma list of speeds > 0, got {text!r}")
    return speeds


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return number


def pd_counts(text: str) -> tuple[int, int]:
    """``P:D`` -> (prefill engines, decode engines), each at least 1."""
    prefill, sep, decode = text.partition(":")
    try:
        counts = (int(prefill), int(decode))
    except ValueError:
        counts = (0, 0)
    if not sep or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--pd takes P:D with P, D >= 1 (e.g. 2:2), got {text!r}")
    return counts


def scenario_for(args: argparse.Namespace, policy: str, qps: float, seed: int) -> Scenario:
    profile, prio = split_prio(policy)
    ramp = read_workload(args.workload).kind == "ramp"
    return Scenario(
        workload=args.workload,
        qps=qps,
        policy=profile,
        engines=args.engines,
        engine_profile=args.profile,
        # a priority ramp sends only x-priority and lets the priority profile map it (Fig. 6)
        slo_profile=args.slo_profile or ("priority" if ramp else "hyperflexis-4task"),
        explicit_slo=not ramp,
        requests=args.requests,
        duration_s=args.duration,
        seed=seed,
        engine_priority=prio or args.engine_priority,
        output_bound=getattr(args, "output_bound", "exact"),
        disturbances=tuple(getattr(args, "disturbances", ())),
        pd=getattr(args, "pd", None),
        pd_mode=getattr(args, "pd_mode", "two-stage"),
        transfer_order=getattr(args, "transfer_order", "fifo"),
        link_gbps=getattr(args, "link_gbps", None),
        decode_speeds=tuple(getattr(args, "decode_speeds", None) or ()),
        disaggregation=getattr(args, "disaggregation", None),
        autoscale=autoscale_for(args),
    )


def autoscale_for(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The scaler of ``--autoscale [POLICY]`` with its bounds (None without the flag)."""
    policy = getattr(args, "autoscale", None)
    if policy is None:
        return None
    pd = getattr(args, "pd", None)
    start = sum(pd) if pd is not None else args.engines
    # P/D: each pool keeps at least one engine; collocated: --min-engines (default --engines)
    low = 1 if pd is not None else (args.min_engines or start)
    high = args.max_engines or 2 * start
    try:
        return AutoscaleConfig(policy, low, high, args.warm_pool, args.warm_source)
    except ValueError as exc:
        raise SystemExit(f"slogate simulate: --autoscale: {exc}") from None


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", default="hyperflexis-4task", help="name in loadtest/workloads or a path"
    )
    parser.add_argument(
        "--policies",
        default="least-load,least-load+prio,hyperflexis",
        help="routing profiles, comma-separated; a '+prio' suffix turns on the engines' priority scheduling",
    )
    parser.add_argument("--qps", default="4:16:4", help="a:b:step (inclusive) or a comma list")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--profile", default="qwen-7b", help="engine profile (profiles/engines)")
    parser.add_argument("--slo-profile", default=None, help="gateway SLO profile (default per workload)")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per point (default: the workload's)"
    )
    parser.add_argument("--duration", type=float, default=None, help="arrivals for this many seconds")
    parser.add_argument("--engine-priority", action="store_true", help="priority scheduling on every engine")
    add_output_bound_argument(parser)
    parser.add_argument("--seed", type=int, default=None, help="first seed (default 0; --calibrate: 3)")
    parser.add_argument("--repeat", type=int, default=1, help="seeds per point; requests are pooled")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--out", type=Path, default=Path("results/simulate"))
    add_disturb_argument(parser)
    parser.add_argument(
        "--pd",
        type=pd_counts,
        default=None,
        metavar="P:D",
        help="disaggregated: P prefill and D decode engines instead of --engines collocated ones",
    )
    parser.add_argument(
        "--pd-mode",
        choices=("two-stage", "one-shot", "one-shot-least-load"),
        default="two-stage",
        help="with --pd: decode placed when the prefill ends, or the pair fixed when the prefill is "
        "dispatched (decode round robin, or least loaded)",
    )
    parser.add_argument(
        "--disaggregation",
        type=_disaggregation,
        default=None,
        metavar="MODE",
        help="with --pd: always | never | conditional[:min_prompt_tokens] instead of the routing "
        "profile's disaggregation section (default: the profile's, as live)",
    )
    parser.add_argument(
        "--decode-speeds",
        type=_speeds,
        default=None,
        metavar="S0,S1,...",
        help="with --pd: each decode engine's speed relative to its profile (its time_scale), e.g. 1,0.5",
    )
    parser.add_argument(
        "--transfer-order", choices=("fifo", "rmlq"), default="fifo", help="with --pd: KV transfer order"
    )
    parser.add_argument(
        "--link-gbps", type=float, default=None, help="with --pd: KV link GB/s (default: the profile's)"
    )
    parser.add_argument(
        "--autoscale",
        nargs="?",
        const="hyperflexis",
        default=None,
        metavar="POLICY",
        help="scale the fleet during the run: hyperflexis (Algorithm 3, the default) or threshold "
        "(HPA-like); --engines (or --pd) is the fleet at the start",
    )
    parser.add_argument("--min-engines", type=int, default=None, help="with --autoscale (default --engines)")
    parser.add_argument(
        "--max-engines", type=int, default=None, help="with --autoscale (default 2x the start)"
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        default=0,
        help="with --autoscale: engines kept warm (runtime up, no weights)",
    )
    parser.add_argument(
        "--warm-source",
        choices=WARM_SOURCES,
        default="peer",
        help="with --autoscale: where a warm engine's weights come from (peer: device to device)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="instead: replay the calibration scenario live (processes) and offline, per policy, and compare",
    )


def calibrate_main(args: argparse.Namespace) -> int:
    from gateway.simulator.calibration import calibration_scenario, compare, render

    comparisons = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        print(f"[simulate] calibration: {policy}, live (real time) and offline", file=sys.stderr, flush=True)
        scenario = calibration_scenario(
            policy, seed=3 if args.seed is None else args.seed, output_bound=args.output_bound
        )
        comparisons.append(compare(scenario))
    text = render(comparisons)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text(text + "\n")
    return 0 if all(c.ok for c in comparisons) else 1


def simulate_main(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate_main(args)
    pyplot()  # fail now, not after the runs, if matplotlib is missing
    if args.engines < 1 or args.repeat < 1 or args.jobs < 1:
        raise SystemExit("slogate simulate: --engines, --repeat and --jobs must be >= 1")
    try:
        read_workload(args.workload)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"slogate simulate: {exc}") from None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs = [(split_prio(p)[0], split_prio(p)[1] or args.engine_priority) for p in policies]
    if len(set(runs)) != len(runs):
        # (their results would be filed under one label, one run's over the other's)
        why = " (--engine-priority gives every policy deadline scheduling: drop '+prio')"
        raise SystemExit(
            f"slogate simulate: --policies {args.policies!r} names the same run twice"
            + (why if args.engine_priority else "")
        )
    rates = parse_rates(args.qps)
    first = 0 if args.seed is None else args.seed
    seeds = range(first, first + args.repeat)
    points = [scenario_for(args, p, q, s) for q in rates for p in policies for s in seeds]
    args.out.mkdir(parents=True, exist_ok=True)
    fleet = f"{args.engines}" if args.pd is None else f"P/D {args.pd[0]}:{args.pd[1]} ({args.pd_mode})"
    if points and points[0].autoscale is not None:
        fleet += f", {points[0].autoscale.label()}"
    print(
        f"[simulate] {len(points)} runs: {len(policies)} policies x {len(rates)} rates x "
        f"{args.repeat} seeds, {fleet} x {args.profile}, workload {args.workload}, "
        f"{min(args.jobs, len(points))} processes",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    results: dict[tuple[str, float], list[RunResult]] = {}
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(points))) as pool:
        futures = {pool.submit(run, point): (policy, point) for point, policy in _labelled(points, args)}
        for done, future in enumerate(as_completed(futures), start=1):
            policy, point = futures[future]
            result = future.result()
            results.setdefault((policy, point.qps), []).append(result)
            attained = sum(o.met for o in result.outcomes) / max(1, len(result.outcomes))
            print(
                f"[simulate] ({done}/{len(points)}) {policy} @ {point.qps:g} QPS seed {point.seed}: "
                f"{attained:.1%} attained, {len(result.outcomes)} requests, {result.events:,} events "
                f"in {result.wall_s:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    rows = [
        row(
            policy,
            qps,
            [r.outcomes for r in runs],
            [r.cost_units for r in runs],
            sum(r.events for r in runs),
            sum(r.wall_s for r in runs),
        )
        for (policy, qps), runs in results.items()
    ]
    text = table(rows)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "points.json").write_text(report_json([_as_json(r) for r in rows], indent=2))
    curves = args.out / "attainment_vs_qps.png"
    plot_curves(rows, curves, f"{args.workload}: {fleet} x {args.profile} (simulated)")
    written = [args.out / "table.md", args.out / "points.json", curves]
    if read_workload(args.workload).kind == "ramp":
        for qps in rates:
            ramp = args.out / f"ttft_over_time_{qps:g}qps.png"
            by_policy: dict[str, list[Outcome]] = {
                policy: [o for r in results[(policy, qps)] for o in r.outcomes] for policy in policies
            }
            horizon = max((o.spec.at for outs in by_policy.values() for o in outs), default=0.0)
            plot_ramp(by_policy, ramp, horizon)
            written.append(ramp)
    print(f"[simulate] done in {time.perf_counter() - started:.1f} s; wrote " + ", ".join(map(str, written)))
    return 0


def _labelled(points: list[Scenario], args: argparse.Namespace) -> list[tuple[Scenario, str]]:
    """Each scenario with the policy name as the user wrote it (``+prio`` kept)."""
    out = []
    for point in points:
        name = point.policy + (PRIO_SUFFIX if point.engine_priority and not args.engine_priority else "")
        out.append((point, name))
    return out


def _as_json(r: Row) -> dict[str, object]:
    return {
        "policy": r.policy,
        "qps": r.qps,
        "cost_units": r.cost_units,
        **asdict(r.summary),
        "attainment_by_task": r.by_task,
        "attainment_per_run": list(r.runs),
        "events": r.events,
        "wall_s": r.wall_s,
    }


def add_output_bound_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-bound",
        choices=OUTPUT_BOUNDS,
        default="exact",
        help="the max_tokens clients send: each answer's own length (exact, as if known) or its "
        "task's 99th percentile (task-p99: what a dispatcher can know in practice)",
    )
