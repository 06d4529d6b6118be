"""``slogate experiment prefix``: KV-cache-aware routing offline (issue 14's acceptance run).

Four collocated simulated engines whose KV cache (``--kv-blocks`` blocks each, 2,048 by default:
32k tokens, a sixth of the profile's) is smaller than the workload's working set, behind the
gateway's own dispatch core, prefix index and affinity store (fed by the dispatches and the
engines' KV events, as live). Two workloads:

* ``prefix-sessions``: 200 sessions x 5 turns whose prompts re-send the growing history;
* ``prefix-trap``: 80 % of the requests start with one long system prompt (the hot-spot trap);
* ``prefix-history``: sessions as in the first, with no system prompt shared between them: only a
  session's own history can be found cached, so routing alone decides the hit rate.

Each policy (routing profile) runs over a QPS sweep per workload. Per point: the prefix-cache hit
rate *as the engines report it* (prompt tokens found computed over prompt tokens queried, summed
over the engines: vLLM's ``prefix_cache_hits / prefix_cache_queries``), TTFT p50/p99, SLO
attainment, and per-engine load as max/mean of the requests each engine served (and of the time
each spent stepping). Alongside, the hit rate an oracle would get (every request finds the longest
prefix any earlier request sent, in whole blocks, cached wherever it goes): the ceiling.

The verdict per workload is taken at the highest QPS where round robin still attains >= 50 %:
each of ours (``--ours``: prefix-aware and hyperflexis-prefix by default) against the issue's four
targets: hit rate >= 2x round robin's, TTFT p99 <= least load's, max/mean load <= 1.3, attainment
>= every peer-style profile's. With ``--seeds N`` every point is run with N seeds and reported as
their mean (the range of hit rate and attainment beside it; max/mean load is the worst seed's).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import percentile, summarize
from gateway.experiments.workload import RequestSpec
from gateway.report_json import report_json
from gateway.simulator.pool import run_jobs
from gateway.simulator.scenario import Scenario, Simulation

ROUND_ROBIN = "round-robin"
LEAST_LOAD = "least-load"
PEERS = ("sglang", "llm-d", "dynamo")
OURS = ("prefix-aware", "hyperflexis-prefix")
POLICIES = (ROUND_ROBIN, LEAST_LOAD, *PEERS, "gimbal", "hyperflexis", *OURS)
WORKLOADS = ("prefix-sessions", "prefix-trap", "prefix-history")
HIT_RATIO = 2.0
MAX_IMBALANCE = 1.3


@dataclass(frozen=True, slots=True)
class Point:
    workload: str
    policy: str
    qps: float
    requests: int
    #: prompt tokens the engines found cached / prompt tokens they were asked for
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    attainment: float
    errors: int
    preemptions: int
    #: engine -> requests it served / seconds it spent stepping
    served: dict[str, int]
    busy: dict[str, float]
    #: seeds averaged into this point, and the range over them
    seeds: int = 1
    hit_range: tuple[float, float] | None = None
    attainment_range: tuple[float, float] | None = None
    #: the worst seed's max/mean (None: computed from ``served`` / ``busy``)
    worst_imbalance: float | None = None
    worst_busy_imbalance: float | None = None

    @property
    def imbalance(self) -> float:
        """max/mean of the requests served per engine."""
        if self.worst_imbalance is not None:
            return self.worst_imbalance
        return _max_over_mean(list(self.served.values()))

    @property
    def busy_imbalance(self) -> float:
        if self.worst_busy_imbalance is not None:
            return self.worst_busy_imbalance
        return _max_over_mean(list(self.busy.values()))


def combine(points: Sequence[Point]) -> Point:
    """One point's seeds as one: means of the rates and percentiles, sums of the counts, the
    worst seed's imbalance."""
    if len(points) == 1:
        return points[0]
    n = len(points)
    first = points[0]
    served: dict[str, int] = {}
    busy: dict[str, float] = {}
    for p in points:
        for e, k in p.served.items():
            served[e] = served.get(e, 0) + k
        for e, b in p.busy.items():
            busy[e] = busy.get(e, 0.0) + b
    hits = [p.hit_rate for p in points]
    attained = [p.attainment for p in points]
    return Point(
        first.workload,
        first.policy,
        first.qps,
        sum(p.requests for p in points),
        sum(hits) / n,
        sum(p.ttft_p50_s for p in points) / n,
        sum(p.ttft_p99_s for p in points) / n,
        sum(attained) / n,
        sum(p.errors for p in points),
        sum(p.preemptions for p in points),
        served,
        busy,
        n,
        (min(hits), max(hits)),
        (min(attained), max(attained)),
        max(p.imbalance for p in points),
        max(p.busy_imbalance for p in points),
    )


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else math.nan


def oracle_hit_rate(specs: Sequence[RequestSpec], block_size: int = 16) -> float:
    """The hit rate if every request found cached, wherever it went, the longest prefix (whole
    segments, rounded down to whole blocks) that any earlier request sent: the ceiling."""
    seen: set[tuple[tuple[int, int], ...]] = set()
    hits = total = 0
    for spec in sorted(specs, key=lambda s: s.at):
        segments = spec.segments
        shared = 0
        for end in range(1, len(segments) + 1):
            if segments[:end] in seen:
                shared = sum(n for _, n in segments[:end])
        hits += (shared // block_size) * block_size
        total += spec.prompt_tokens
        seen.update(segments[:end] for end in range(1, len(segments) + 1))
    return hits / total if total else 0.0


def scenario(workload: str, policy: str, qps: float, blocks: int, requests: int, seed: int) -> Scenario:
    return Scenario(
        workload=workload,
        qps=qps,
        policy=policy,
        engines=4,
        requests=requests,
        seed=seed,
        num_gpu_blocks=blocks,
    )


def run_point(sc: Scenario) -> Point:
    sim = Simulation(sc)
    result = sim.run()
    outcomes = result.outcomes
    s = summarize(outcomes)
    queries = sum(node.model.counters.prefix_queries for node in sim.nodes)
    hits = sum(node.model.counters.prefix_hits for node in sim.nodes)
    ttfts = [o.ttft_s for o in outcomes]
    return Point(
        sc.workload,
        sc.policy,
        sc.qps,
        s.requests,
        hits / queries if queries else 0.0,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        s.attainment,
        s.errors,
        sum(node.model.counters.preemptions for node in sim.nodes),
        dict(result.served_by_engine),
        dict(result.busy_by_engine),
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    workload: str
    qps: float | None  # the highest QPS where round robin attains >= 50 % (None: never)
    checks: tuple[tuple[str, bool, str], ...]  # (target, met, the numbers)

    @property
    def met(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def verdict(points: Sequence[Point], workload: str, ours: str) -> Verdict:
    mine = [p for p in points if p.workload == workload]
    rr_ok = sorted((p.qps for p in mine if p.policy == ROUND_ROBIN and p.attainment >= 0.5), reverse=True)
    if not rr_ok:
        return Verdict(workload, None, ())
    qps = rr_ok[0]
    at = {p.policy: p for p in mine if p.qps == qps}
    if ours not in at:
        return Verdict(workload, qps, ())
    me, rr = at[ours], at[ROUND_ROBIN]
    checks = [
        (
            f"hit rate >= {HIT_RATIO:g}x round robin's",
            me.hit_rate >= HIT_RATIO * rr.hit_rate,
            f"{me.hit_rate:.1%} vs {rr.hit_rate:.1%} "
            f"({me.hit_rate / rr.hit_rate if rr.hit_rate else math.inf:.2f}x)",
        )
    ]
    if LEAST_LOAD in at:
        ll = at[LEAST_LOAD]
        checks.append(
            (
                "TTFT p99 <= least load's",
                me.ttft_p99_s <= ll.ttft_p99_s,
                f"{me.ttft_p99_s:.2f} s vs {ll.ttft_p99_s:.2f} s",
            )
        )
    worst = max(p.imbalance for p in mine if p.policy == ours)
    checks.append(
        (
            f"max/mean load <= {MAX_IMBALANCE:g} (every QPS)",
            worst <= MAX_IMBALANCE,
            f"{me.imbalance:.2f} here, {worst:.2f} at worst",
        )
    )
    peers = [at[p] for p in PEERS if p in at]
    if peers:
        best = max(peers, key=lambda p: p.attainment)
        checks.append(
            (
                "SLO attainment >= every peer-style profile's",
                me.attainment >= best.attainment,
                f"{me.attainment:.1%} vs best peer {best.policy} {best.attainment:.1%}",
            )
        )
    return Verdict(workload, qps, tuple(checks))


def _with_range(value: float, span: tuple[float, float] | None) -> str:
    if span is None:
        return f"{value:.1%}"
    return f"{value:.1%} ({span[0]:.1%}-{span[1]:.1%})"


def render(points: Sequence[Point], ours: Sequence[str], oracle: dict[str, float], blocks: int) -> str:
    lines: list[str] = []
    order = list(dict.fromkeys(p.policy for p in points))
    order.sort(key=lambda name: POLICIES.index(name) if name in POLICIES else len(POLICIES))
    for workload in dict.fromkeys(p.workload for p in points):
        mine = [p for p in points if p.workload == workload]
        lines += [
            f"### {workload} (4 engines x {blocks} KV blocks; "
            f"oracle hit rate {oracle.get(workload, math.nan):.1%})",
            "",
            "| QPS | policy | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | SLO attainment | "
            "max/mean requests | max/mean busy | preemptions | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sorted(mine, key=lambda p: (p.qps, order.index(p.policy))):
            name = f"**{p.policy}**" if p.policy in ours else p.policy
            lines.append(
                f"| {p.qps:g} | {name} | {_with_range(p.hit_rate, p.hit_range)} | {p.ttft_p50_s:.2f} | "
                f"{p.ttft_p99_s:.2f} | {_with_range(p.attainment, p.attainment_range)} | {p.imbalance:.2f} | "
                f"{p.busy_imbalance:.2f} | {p.preemptions} | {p.errors} |"
            )
        seeds = max(p.seeds for p in mine)
        if seeds > 1:
            lines += [
                "",
                f"(each point: the mean of {seeds} seeds, the range in brackets; max/mean: worst seed)",
            ]
        lines.append("")
        for me in (m for m in ours if any(p.policy == m for p in mine)):
            v = verdict(points, workload, me)
            if v.qps is None:
                lines.append(
                    f"Verdict ({workload}): round robin never attains >= 50 % in this sweep (lower --qps)."
                )
                break
            lines.append(
                f"Verdict ({workload}, {me}) at {v.qps:g} QPS, the highest where round robin attains "
                f">= 50 %: {'all targets met' if v.met else 'NOT all targets met'}."
            )
            lines += [
                f"- {'met' if ok else 'NOT met'}: {target}: {numbers}" for target, ok, numbers in v.checks
            ]
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(points: Sequence[Point], path: Path, title: str) -> None:
    plt = pyplot()
    workloads = list(dict.fromkeys(p.workload for p in points))
    fig, grid = plt.subplots(len(workloads), 4, figsize=(20, 4.5 * len(workloads)), squeeze=False)
    metrics: tuple[tuple[str, Callable[[Point], float], str], ...] = (
        ("prefix hit rate (engines' counters)", lambda p: 100 * p.hit_rate, "%"),
        ("TTFT p99", lambda p: p.ttft_p99_s, "s"),
        ("SLO attainment", lambda p: 100 * p.attainment, "%"),
        ("max/mean requests per engine", lambda p: p.imbalance, "ratio"),
    )
    for row, workload in zip(grid, workloads, strict=True):
        mine = [p for p in points if p.workload == workload]
        for ax, (name, value, unit) in zip(row, metrics, strict=True):
            for policy in dict.fromkeys(p.policy for p in mine):
                series = sorted((p for p in mine if p.policy == policy), key=lambda p: p.qps)
                ax.plot([p.qps for p in series], [value(p) for p in series], marker="o", label=policy)
            ax.set_title(f"{workload}: {name}", fontsize=10)
            ax.set_xlabel("request rate (QPS)")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
            if name.startswith("TTFT"):
                ax.set_yscale("log")
        row[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(POLICIES), help="routing profiles, comma-separated")
    parser.add_argument(
        "--ours", default=",".join(OURS), help="the profiles the verdicts are about, comma-separated"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="workloads (loadtest/workloads), comma-separated"
    )
    parser.add_argument(
        "--sessions-qps",
        type=_floats,
        default=[8.0, 16.0, 24.0, 28.0, 32.0, 36.0, 40.0, 44.0],
        help="QPS sweep of prefix-sessions",
    )
    parser.add_argument(
        "--trap-qps",
        type=_floats,
        default=[8.0, 16.0, 20.0, 24.0, 28.0, 32.0],
        help="QPS sweep of prefix-trap (and of any other workload)",
    )
    parser.add_argument(
        "--history-qps", type=_floats, default=[4.0, 8.0, 12.0, 16.0], help="QPS sweep of prefix-history"
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds per point (seed, seed+1, ...)")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV cache blocks per engine")
    parser.add_argument("--requests", type=int, default=1000, help="requests per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/prefix"))


def prefix_main(args: argparse.Namespace) -> int:
    pyplot()
    if args.kv_blocks < 1 or args.requests < 1 or args.jobs < 1 or args.seeds < 1:
        raise SystemExit(
            "slogate experiment prefix: --kv-blocks, --requests, --jobs and --seeds must be >= 1"
        )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    ours = [p.strip() for p in args.ours.split(",") if p.strip()]
    sweeps = {"prefix-sessions": args.sessions_qps, "prefix-history": args.history_qps}
    jobs = [
        scenario(w, policy, qps, args.kv_blocks, args.requests, args.seed + k)
        for w in workloads
        for qps in sweeps.get(w, args.trap_qps)
        for policy in policies
        for k in range(args.seeds)
    ]
    print(
        f"[prefix] {len(jobs)} runs: 4 engines x {args.kv_blocks} KV blocks, {len(policies)} policies, "
        f"{', '.join(workloads)}; {args.requests} requests each",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()

    def report(done: int, _: tuple[Any, ...], p: Point) -> None:
        print(
            f"[prefix] ({done}/{len(jobs)}) {p.workload} {p.policy} @ {p.qps:g} QPS: "
            f"hit {p.hit_rate:.1%}, "
            f"TTFT p99 {p.ttft_p99_s:.2f} s, {p.attainment:.1%} attained, max/mean {p.imbalance:.2f} "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    runs = run_jobs(run_point, [(sc,) for sc in jobs], args.jobs, report)
    by_point: dict[tuple[str, str, float], list[Point]] = {}
    for p in runs:
        by_point.setdefault((p.workload, p.policy, p.qps), []).append(p)
    points = [combine(group) for group in by_point.values()]
    from gateway.experiments.workloads import load_workload

    oracle = {
        w: oracle_hit_rate(load_workload(w, qps=10.0, requests=args.requests, seed=args.seed))
        for w in workloads
    }
    text = render(points, ours, oracle, args.kv_blocks)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix.md").write_text(text + "\n")
    verdicts = [
        asdict(verdict(points, w, me)) | {"ours": me} for w in workloads for me in ours if me in policies
    ]
    payload = {
        "kv_blocks": args.kv_blocks,
        "seeds": args.seeds,
        "oracle_hit_rate": oracle,
        "points": [
            {**asdict(p), "imbalance": p.imbalance, "busy_imbalance": p.busy_imbalance} for p in points
        ],
        "verdicts": verdicts,
    }
    (args.out / "prefix.json").write_text(report_json(payload, indent=2))
    png = args.out / "prefix.png"
    plot(points, png, f"prefix-aware routing: 4 engines x {args.kv_blocks} KV blocks (simulated)")
    print(
        f"[prefix] done in {time.perf_counter() - started:.0f} s; "
        f"wrote {args.out}/prefix.md, prefix.json, {png}"
    )
    return 0
