"""``slogate experiment prefix``: KV-cache-aware routing offline (issue 14's acceptance run).

Four collocated simulated engines whose KV cache (``--kv-blocks`` blocks each, 2,048 by default:
32k tokens, a sixth of the profile's) is smaller than the workload's working set, behind the
gateway's own dispatch core, prefix index and affinity store (fed by the dispatches and the
engines' KV events, as live). Two workloads:

* ``prefix-sessions``: 200 sessions x 5 turns whose prompts re-send the growing history;
* ``prefix-trap``: 80 % of the requests start with one long system prompt (the hot-spot trap).

Each policy (routing profile) runs over a QPS sweep per workload. Per point: the prefix-cache hit
rate *as the engines report it* (prompt tokens found computed over prompt tokens queried, summed
over the engines: vLLM's ``prefix_cache_hits / prefix_cache_queries``), TTFT p50/p99, SLO
attainment, and per-engine load as max/mean of the requests each engine served (and of the time
each spent stepping). Alongside, the hit rate an oracle would get (every request finds the longest
prefix any earlier request sent, in whole blocks, cached wherever it goes): the ceiling.

The verdict per workload is taken at the highest QPS where round robin still attains >= 50 %:
ours (``--ours``, prefix-aware by default) against the issue's four targets: hit rate >= 2x round
robin's, TTFT p99 <= least load's, max/mean load <= 1.3, attainment >= every peer-style profile's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import summarize
from gateway.experiments.workload import RequestSpec
from gateway.simulator.pool import run_jobs
from gateway.simulator.scenario import Scenario, Simulation

ROUND_ROBIN = "round-robin"
LEAST_LOAD = "least-load"
PEERS = ("sglang", "llm-d", "dynamo")
POLICIES = (ROUND_ROBIN, LEAST_LOAD, *PEERS, "gimbal", "prefix-aware")
WORKLOADS = ("prefix-sessions", "prefix-trap")
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

    @property
    def imbalance(self) -> float:
        """max/mean of the requests served per engine."""
        return _max_over_mean(list(self.served.values()))

    @property
    def busy_imbalance(self) -> float:
        return _max_over_mean(list(self.busy.values()))


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else math.nan


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
        _percentile(ttfts, 0.5),
        _percentile(ttfts, 0.99),
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


def render(points: Sequence[Point], ours: str, oracle: dict[str, float], blocks: int) -> str:
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
            name = f"**{p.policy}**" if p.policy == ours else p.policy
            lines.append(
                f"| {p.qps:g} | {name} | {p.hit_rate:.1%} | {p.ttft_p50_s:.2f} | {p.ttft_p99_s:.2f} | "
                f"{p.attainment:.1%} | {p.imbalance:.2f} | {p.busy_imbalance:.2f} | {p.preemptions} | "
                f"{p.errors} |"
            )
        v = verdict(points, workload, ours)
        lines.append("")
        if v.qps is None:
            lines.append(
                f"Verdict ({workload}): round robin never attains >= 50 % in this sweep (lower --qps)."
            )
        else:
            lines.append(
                f"Verdict ({workload}, {ours}) at {v.qps:g} QPS, the highest where round robin attains "
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
    parser.add_argument("--ours", default="prefix-aware", help="the profile the verdict is about")
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
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV cache blocks per engine")
    parser.add_argument("--requests", type=int, default=1000, help="requests per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/prefix"))


def prefix_main(args: argparse.Namespace) -> int:
    pyplot()
    if args.kv_blocks < 1 or args.requests < 1 or args.jobs < 1:
        raise SystemExit("slogate experiment prefix: --kv-blocks, --requests and --jobs must be >= 1")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    jobs = [
        scenario(w, policy, qps, args.kv_blocks, args.requests, args.seed)
        for w in workloads
        for qps in (args.sessions_qps if w == "prefix-sessions" else args.trap_qps)
        for policy in policies
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

    points = run_jobs(run_point, [(sc,) for sc in jobs], args.jobs, report)
    from gateway.experiments.workloads import load_workload

    oracle = {
        w: oracle_hit_rate(load_workload(w, qps=10.0, requests=args.requests, seed=args.seed))
        for w in workloads
    }
    text = render(points, args.ours, oracle, args.kv_blocks)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix.md").write_text(text + "\n")
    verdicts = [asdict(verdict(points, w, args.ours)) for w in workloads]
    payload = {
        "kv_blocks": args.kv_blocks,
        "oracle_hit_rate": oracle,
        "points": [
            {**asdict(p), "imbalance": p.imbalance, "busy_imbalance": p.busy_imbalance} for p in points
        ],
        "verdicts": verdicts,
    }
    (args.out / "prefix.json").write_text(json.dumps(payload, indent=2))
    png = args.out / "prefix.png"
    plot(points, png, f"prefix-aware routing: 4 engines x {args.kv_blocks} KV blocks (simulated)")
    print(
        f"[prefix] done in {time.perf_counter() - started:.0f} s; "
        f"wrote {args.out}/prefix.md, prefix.json, {png}"
    )
    return 0
