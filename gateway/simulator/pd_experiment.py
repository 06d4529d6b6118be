"""``slogate experiment pd``: prefill/decode disaggregation offline, two comparisons.

1. **Placement** (HyperFlexis §5.1 / §8.1.2, its RR-PD baseline): P prefill + D decode engines,
   a QPS sweep, each point run with

   * ``one-shot RR``: round robin on both stages, the pair fixed when the request is dispatched
     (peer gateways);
   * ``two-stage``: the prefill placed by the gateway's dispatch core with ``--policy`` (HyperFlexis
     by default), the decode engine chosen by :func:`policies.decode_placement.place_decode` when
     the prefill ends;
   * ``RR + two-stage decode``: round-robin prefills, decode placed at prefill end (what the
     decode stage alone changes).

   Per QPS: SLO attainment (TTFT and TPOT), E2E p50/p99 and per-engine load (stages run and busy
   share per engine). The verdict: at the highest QPS where one-shot RR attains < 50 %, two-stage
   should attain >= 2.5x.
2. **Transfers** (MFS §4): the same fleet with a constrained KV link (``--link-gbps``) at
   ``--transfer-qps``, two-stage placement, transfers into each decode engine in FIFO vs RMLQ
   order: TTFT attainment per link speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import summarize
from gateway.simulator.scenario import Scenario, run

TARGET_RATIO = 2.5
ONE_SHOT = "one-shot RR"
TWO_STAGE = "two-stage"
RR_TWO_STAGE = "RR + two-stage decode"


@dataclass(frozen=True, slots=True)
class Point:
    part: str  # "placement" | "transfer"
    series: str
    qps: float
    link_gbps: float | None
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    e2e_p50_s: float
    e2e_p99_s: float
    errors: int
    requests: int
    #: engine -> stages it ran (prefills on prefill engines, decodes on decode engines)
    served: dict[str, int]
    #: engine -> share of the run's makespan it spent running steps
    busy: dict[str, float]
    ttft_by_task: dict[str, float]


def _series(name: str, policy: str) -> tuple[str, str, str]:
    """(routing profile, P/D mode, transfer order) of a series."""
    return {
        ONE_SHOT: ("round-robin", "one-shot", "fifo"),
        TWO_STAGE: (policy, "two-stage", "fifo"),
        RR_TWO_STAGE: ("round-robin", "two-stage", "fifo"),
        "FIFO transfers": (policy, "two-stage", "fifo"),
        "RMLQ transfers": (policy, "two-stage", "rmlq"),
    }[name]


def _scenario(args: argparse.Namespace, series: str, qps: float, link_gbps: float | None) -> Scenario:
    profile, mode, order = _series(series, args.policy)
    return Scenario(
        workload=args.workload,
        qps=qps,
        policy=profile,
        engine_profile=args.profile,
        slo_profile="hyperflexis-4task",
        duration_s=args.duration,
        requests=max(1, int(qps * args.duration)),
        seed=args.seed,
        pd=args.pd,
        pd_mode=mode,
        transfer_order=order,
        link_gbps=link_gbps,
        disaggregation=args.disaggregation,
    )


def _run(part: str, series: str, scenario: Scenario) -> Point:
    result = run(scenario)
    s = summarize(result.outcomes)
    tasks = sorted({o.spec.task for o in result.outcomes})
    by_task = {t: summarize([o for o in result.outcomes if o.spec.task == t]).ttft_attainment for t in tasks}
    span = max(result.makespan_s, 1e-9)
    return Point(
        part,
        series,
        scenario.qps,
        scenario.link_gbps,
        s.attainment,
        s.ttft_attainment,
        s.tpot_attainment,
        s.e2e_p50_s,
        s.e2e_p99_s,
        s.errors,
        s.requests,
        dict(result.served_by_engine),
        {e: b / span for e, b in result.busy_by_engine.items()},
        by_task,
    )


def _spread(point: Point, prefix: str) -> str:
    """Stages per engine of one pool as ``min-max`` and the busiest engine's busy share."""
    served = [n for e, n in point.served.items() if e.startswith(prefix)]
    busy = [b for e, b in point.busy.items() if e.startswith(prefix)]
    if not served:
        return "-"
    return f"{min(served)}-{max(served)} ({max(busy, default=0):.0%})"


def verdict(points: list[Point]) -> tuple[float | None, float, float, bool]:
    """(QPS, one-shot attainment, two-stage attainment, met) at the highest QPS where one-shot RR
    attains < 50 %; QPS None when it never does in the sweep."""
    placement = [p for p in points if p.part == "placement"]
    below = sorted((p.qps for p in placement if p.series == ONE_SHOT and p.attainment < 0.5), reverse=True)
    if not below:
        return None, math.nan, math.nan, False
    qps = below[0]
    base = next(p.attainment for p in placement if p.series == ONE_SHOT and p.qps == qps)
    mine = next((p.attainment for p in placement if p.series == TWO_STAGE and p.qps == qps), math.nan)
    met = mine >= TARGET_RATIO * base if base > 0 else mine > 0
    return qps, base, mine, met


def render(points: list[Point]) -> str:
    lines = [
        "### Placement: one-shot RR pairing vs two-stage (decode placed when the prefill ends)",
        "",
        "| QPS | series | SLO attainment | TTFT ok | TPOT ok | E2E p50 (s) | E2E p99 (s) | errors "
        "| prefills per engine | decodes per engine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    note = (
        "Per engine: stages run, min-max over the pool (the busiest engine's share of the run spent "
        "stepping; a decode engine steps whenever it holds a request, so ~100 % there means busy, "
        "not saturated)."
    )
    for p in sorted((p for p in points if p.part == "placement"), key=lambda p: (p.qps, p.series)):
        lines.append(
            f"| {p.qps:g} | {p.series} | {p.attainment:.1%} | {p.ttft_attainment:.1%} | "
            f"{p.tpot_attainment:.1%} | {p.e2e_p50_s:.2f} | {p.e2e_p99_s:.2f} | {p.errors} | "
            f"{_spread(p, 'prefill-')} | {_spread(p, 'decode-')} |"
        )
    qps, base, mine, met = verdict(points)
    lines += ["", note, ""]
    if qps is None:
        lines.append("Verdict: one-shot RR never attains < 50 % in this sweep (raise --qps).")
    else:
        ratio = mine / base if base > 0 else math.inf
        lines.append(
            f"Verdict: at {qps:g} QPS (the highest where one-shot RR attains < 50 %) one-shot RR "
            f"{base:.1%}, two-stage {mine:.1%}: {ratio:.2f}x (target >= {TARGET_RATIO}x: "
            f"{'met' if met else 'NOT met'})."
        )
    transfer = [p for p in points if p.part == "transfer"]
    if transfer:
        tasks = sorted({t for p in transfer for t in p.ttft_by_task})
        lines += [
            "",
            "### KV transfers over a constrained link: FIFO vs RMLQ (two-stage placement)",
            "",
            "| link (GB/s) | QPS | order | TTFT attainment | SLO attainment | E2E p50 (s) | E2E p99 (s) |"
            + "".join(f" TTFT {t} |" for t in tasks),
            "|" + "---|" * (7 + len(tasks)),
        ]
        for p in sorted(transfer, key=lambda p: (p.link_gbps or 0.0, p.series)):
            lines.append(
                f"| {p.link_gbps:g} | {p.qps:g} | {p.series} | {p.ttft_attainment:.1%} | "
                f"{p.attainment:.1%} | {p.e2e_p50_s:.2f} | {p.e2e_p99_s:.2f} |"
                + "".join(f" {p.ttft_by_task.get(t, math.nan):.1%} |" for t in tasks)
            )
    return "\n".join(lines)


def plot(points: list[Point], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    placement = [p for p in points if p.part == "placement"]
    for series in dict.fromkeys(p.series for p in placement):
        mine = sorted((p for p in placement if p.series == series), key=lambda p: p.qps)
        qps = [p.qps for p in mine]
        axes[0].plot(qps, [100 * p.attainment for p in mine], marker="o", label=series)
        (line,) = axes[1].plot(qps, [p.e2e_p50_s for p in mine], marker="o", label=f"{series} p50")
        axes[1].plot(qps, [p.e2e_p99_s for p in mine], marker="x", ls="--", color=line.get_color())
    axes[0].set_title("SLO attainment", fontsize=10)
    axes[0].set_ylabel("%")
    axes[0].set_ylim(0, 102)
    axes[1].set_title("E2E latency (solid p50, dashed p99)", fontsize=10)
    axes[1].set_ylabel("s")
    for ax in axes[:2]:
        ax.set_xlabel("request rate (QPS)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    transfer = [p for p in points if p.part == "transfer"]
    for series in dict.fromkeys(p.series for p in transfer):
        mine = sorted((p for p in transfer if p.series == series), key=lambda p: p.link_gbps or 0.0)
        axes[2].plot(
            [p.link_gbps for p in mine], [100 * p.ttft_attainment for p in mine], marker="o", label=series
        )
    axes[2].set_title("TTFT attainment, constrained KV link", fontsize=10)
    axes[2].set_xlabel("decode engine link (GB/s)")
    axes[2].set_ylabel("%")
    axes[2].set_ylim(0, 102)
    axes[2].grid(alpha=0.3)
    if transfer:
        axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pd(text: str) -> tuple[int, int]:
    prefill, sep, decode = text.partition(":")
    try:
        counts = (int(prefill), int(decode))
    except ValueError:
        counts = (0, 0)
    if not sep or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--pd takes P:D with P, D >= 1 (e.g. 2:2), got {text!r}")
    return counts


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd", type=_pd, default=(2, 2), metavar="P:D", help="prefill:decode engines")
    parser.add_argument("--profile", default="qwen-7b", help="engine profile (profiles/engines)")
    parser.add_argument("--workload", default="hyperflexis-4task")
    parser.add_argument("--policy", default="hyperflexis", help="the two-stage prefill routing profile")
    parser.add_argument("--qps", type=_floats, default=[40.0, 60.0, 80.0, 100.0, 120.0, 140.0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point")
    parser.add_argument(
        "--link-gbps",
        type=_floats,
        default=[0.2, 0.25, 0.3, 0.35],
        help="constrained link speeds for FIFO vs RMLQ (empty list skips: use --no-transfers)",
    )
    parser.add_argument("--transfer-qps", type=float, default=40.0)
    parser.add_argument("--no-transfers", action="store_true", help="skip the FIFO vs RMLQ comparison")
    parser.add_argument(
        "--disaggregation",
        default="always",
        help="always | never | conditional[:min_prompt_tokens] (default always: every request through "
        "the prefill pool, so the comparison is the placement alone)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/pd"))


def pd_main(args: argparse.Namespace) -> int:
    pyplot()
    jobs: list[tuple[str, str, Scenario]] = [
        ("placement", series, _scenario(args, series, qps, None))
        for qps in args.qps
        for series in (ONE_SHOT, TWO_STAGE, RR_TWO_STAGE)
    ]
    if not args.no_transfers:
        jobs += [
            ("transfer", series, _scenario(args, series, args.transfer_qps, gbps))
            for gbps in args.link_gbps
            for series in ("FIFO transfers", "RMLQ transfers")
        ]
    p, d = args.pd
    print(
        f"[pd] {len(jobs)} runs: {p} prefill + {d} decode x {args.profile}, {args.workload}, "
        f"{args.duration:g} s of arrivals each",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    points: list[Point] = []
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(jobs)))) as pool:
        futures = {pool.submit(_run, part, series, sc): (part, series, sc) for part, series, sc in jobs}
        for done, future in enumerate(as_completed(futures), start=1):
            _, series, sc = futures[future]
            point = future.result()
            points.append(point)
            link = f", link {sc.link_gbps:g} GB/s" if sc.link_gbps is not None else ""
            print(
                f"[pd] ({done}/{len(jobs)}) {series} @ {sc.qps:g} QPS{link}: {point.attainment:.1%} "
                f"attained, TTFT {point.ttft_attainment:.1%} ({point.requests} requests, "
                f"{time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    text = render(points)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pd.md").write_text(text + "\n")
    (args.out / "pd.json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    png = args.out / "pd.png"
    plot(points, png, f"P/D {p}:{d} x {args.profile}, {args.workload} (simulated)")
    print(f"[pd] done in {time.perf_counter() - started:.0f} s; wrote {args.out}/pd.md, pd.json, {png}")
    return 0
