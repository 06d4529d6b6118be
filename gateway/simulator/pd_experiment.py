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
3. **Decode placement where the decode stage matters**: long outputs with a tight-TPOT class
   (``--decode-workload``, ``tpot-bound``), the SAME prefill dispatcher (``--policy``) in every
   arm, so only the decode engine's choice differs:

   * ``one-shot RR``: decode engine round robin, fixed when the prefill is dispatched;
   * ``one-shot least-load``: decode engine with the least estimated load at the same moment (the
     stronger peer baseline);
   * ``two-stage``: :func:`policies.decode_placement.place_decode` when the prefill ends;

   in three fleets: more prefill than decode capacity (decode the bottleneck), one decode engine
   on a 2x slower accelerator (its ``time_scale``, known to the gateway), one decode engine slowed
   3x for the middle half of the run (not told). Per point: SLO, TTFT and TPOT attainment, the
   tight class's TPOT attainment, E2E p50/p99, decodes and busy share per decode engine.

Every request goes through the prefill pool (``--disaggregation always``) so that the
comparisons are of placement alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import summarize
from gateway.report_json import report_json
from gateway.simulator.cli import pd_counts
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.pool import run_jobs
from gateway.simulator.scenario import Scenario, run

TARGET_RATIO = 2.5
ONE_SHOT = "one-shot RR"
TWO_STAGE = "two-stage"
RR_TWO_STAGE = "RR + two-stage decode"
LEAST_LOAD = "one-shot least-load"
#: the decode-placement arms (same prefill dispatcher) and their P/D modes
DECODE_ARMS = {ONE_SHOT: "one-shot", LEAST_LOAD: "one-shot-least-load", TWO_STAGE: "two-stage"}


@dataclass(frozen=True, slots=True)
class DecodeCase:
    """A fleet where the decode stage matters (part 3)."""

    name: str
    pd: tuple[int, int]
    qps: tuple[float, ...]
    decode_speeds: tuple[float, ...] = ()
    #: slow this decode engine 3x for the middle half of the arrivals (the gateway is not told)
    slowed: str | None = None


DECODE_CASES = (
    DecodeCase("long outputs, 4P:2D", (4, 2), (30.0, 36.0)),
    DecodeCase("decode-1 2x slower (known), 3P:2D", (3, 2), (24.0, 30.0), decode_speeds=(1.0, 0.5)),
    DecodeCase("decode-1 slowed 3x mid-run (unknown), 3P:2D", (3, 2), (24.0, 30.0), slowed="decode-1"),
)


@dataclass(frozen=True, slots=True)
class Point:
    part: str  # "placement" | "transfer" | "decode"
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
    #: part 3: the fleet's name, and the TPOT attainment of the class with the tightest TPOT
    case: str = ""
    tight_tpot_attainment: float = math.nan


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


def _decode_scenario(args: argparse.Namespace, case: DecodeCase, series: str, qps: float) -> Scenario:
    duration = args.decode_duration
    slowed: tuple[Disturbance, ...] = ()
    if case.slowed is not None:
        slowed = (Disturbance("slow-engine", duration / 4, 3 * duration / 4, 3.0, case.slowed),)
    return Scenario(
        workload=args.decode_workload,
        qps=qps,
        policy=args.policy,
        engine_profile=args.profile,
        slo_profile="hyperflexis-4task",
        duration_s=duration,
        requests=max(1, int(qps * duration)),
        seed=args.seed,
        pd=case.pd,
        pd_mode=DECODE_ARMS[series],
        decode_speeds=case.decode_speeds,
        disturbances=slowed,
        disaggregation=args.disaggregation,
    )


def _run(part: str, series: str, scenario: Scenario, case: str = "") -> Point:
    result = run(scenario)
    s = summarize(result.outcomes)
    tasks = sorted({o.spec.task for o in result.outcomes})
    by_task = {t: summarize([o for o in result.outcomes if o.spec.task == t]).ttft_attainment for t in tasks}
    tight = min(result.outcomes, key=lambda o: o.spec.tpot_s).spec.task if result.outcomes else ""
    tight_tpot = summarize([o for o in result.outcomes if o.spec.task == tight]).tpot_attainment
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
        case,
        tight_tpot,
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
    lines += render_decode([p for p in points if p.part == "decode"])
    return "\n".join(lines)


def _per_decode_engine(point: Point) -> str:
    engines = sorted(e for e in point.served if e.startswith("decode-"))
    return " / ".join(f"{point.served[e]} ({point.busy.get(e, 0.0):.0%})" for e in engines)


def decode_verdicts(points: list[Point]) -> list[str]:
    """Per (fleet, QPS): which arm attains most, and two-stage against the better one-shot arm."""
    out = []
    keys = dict.fromkeys((p.case, p.qps) for p in points)
    for case, qps in keys:
        arms = {p.series: p for p in points if p.case == case and p.qps == qps}
        if TWO_STAGE not in arms or len(arms) < 2:
            continue
        mine = arms[TWO_STAGE]
        rival = max((p for s, p in arms.items() if s != TWO_STAGE), key=lambda p: p.attainment)
        diff = mine.attainment - rival.attainment
        word = "wins" if diff > 0.01 else "loses" if diff < -0.01 else "ties"
        out.append(
            f"- {case} @ {qps:g} QPS: two-stage {word} ({mine.attainment:.1%} vs {rival.series} "
            f"{rival.attainment:.1%}; tight-TPOT class {mine.tight_tpot_attainment:.1%} vs "
            f"{rival.tight_tpot_attainment:.1%}; E2E p99 {mine.e2e_p99_s:.1f} s vs {rival.e2e_p99_s:.1f} s)."
        )
    return out


def render_decode(points: list[Point]) -> list[str]:
    if not points:
        return []
    lines = [
        "",
        "### Decode placement where the decode stage matters (same prefill dispatcher in every arm)",
        "",
        "| fleet | QPS | decode placement | SLO attainment | TTFT ok | TPOT ok | tight-TPOT class TPOT ok "
        "| E2E p50 (s) | E2E p99 (s) | decodes per decode engine (busy share) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = list(DECODE_ARMS)
    cases = list(dict.fromkeys(p.case for p in points))
    for p in sorted(points, key=lambda p: (cases.index(p.case), p.qps, order.index(p.series))):
        lines.append(
            f"| {p.case} | {p.qps:g} | {p.series} | {p.attainment:.1%} | {p.ttft_attainment:.1%} | "
            f"{p.tpot_attainment:.1%} | {p.tight_tpot_attainment:.1%} | {p.e2e_p50_s:.2f} | "
            f"{p.e2e_p99_s:.2f} | {_per_decode_engine(p)} |"
        )
    lines += ["", *decode_verdicts(points)]
    return lines


def plot(points: list[Point], path: Path, title: str) -> None:
    plt = pyplot()
    fig, grid = plt.subplots(2, 2, figsize=(14, 9))
    axes = list(grid.flat)
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
    _plot_decode(axes[3], [p for p in points if p.part == "decode"])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_decode(ax: Any, points: list[Point]) -> None:
    """Grouped bars: SLO attainment per (fleet, QPS), one bar per decode-placement arm."""
    ax.set_title("Decode placement, same prefill dispatcher: SLO attainment", fontsize=10)
    ax.set_ylabel("%")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3, axis="y")
    groups = list(dict.fromkeys((p.case, p.qps) for p in points))
    if not groups:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        return
    arms = [a for a in DECODE_ARMS if any(p.series == a for p in points)]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        values = [
            next((100 * p.attainment for p in points if (p.case, p.qps) == g and p.series == arm), 0.0)
            for g in groups
        ]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=arm)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{c.split(',')[0]}\n@ {q:g} QPS" for c, q in groups], fontsize=7)
    ax.legend(fontsize=8)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd", type=pd_counts, default=(2, 2), metavar="P:D", help="prefill:decode engines")
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
        "--decode-workload", default="tpot-bound", help="the workload of the decode-placement part"
    )
    parser.add_argument(
        "--decode-duration", type=float, default=60.0, help="seconds of arrivals per decode-part point"
    )
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-placement part")
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
    jobs: list[tuple[str, str, Scenario, str]] = [
        ("placement", series, _scenario(args, series, qps, None), "")
        for qps in args.qps
        for series in (ONE_SHOT, TWO_STAGE, RR_TWO_STAGE)
    ]
    if not args.no_transfers:
        jobs += [
            ("transfer", series, _scenario(args, series, args.transfer_qps, gbps), "")
            for gbps in args.link_gbps
            for series in ("FIFO transfers", "RMLQ transfers")
        ]
    if not args.no_decode:
        jobs += [
            ("decode", series, _decode_scenario(args, case, series, qps), case.name)
            for case in DECODE_CASES
            for qps in case.qps
            for series in DECODE_ARMS
        ]
    p, d = args.pd
    print(
        f"[pd] {len(jobs)} runs: {p} prefill + {d} decode x {args.profile}, {args.workload}, "
        f"{args.duration:g} s of arrivals each",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()

    def report(done: int, job: tuple[str, str, Scenario, str], point: Point) -> None:
        _, series, sc, case = job
        link = f", link {sc.link_gbps:g} GB/s" if sc.link_gbps is not None else ""
        where = f"{case}: " if case else ""
        print(
            f"[pd] ({done}/{len(jobs)}) {where}{series} @ {sc.qps:g} QPS{link}: {point.attainment:.1%} "
            f"attained, TTFT {point.ttft_attainment:.1%} ({point.requests} requests, "
            f"{time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    points = run_jobs(_run, jobs, args.jobs, report)
    text = render(points)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pd.md").write_text(text + "\n")
    (args.out / "pd.json").write_text(report_json([asdict(p) for p in points], indent=2))
    png = args.out / "pd.png"
    plot(points, png, f"P/D {p}:{d} x {args.profile}, {args.workload} (simulated)")
    print(f"[pd] done in {time.perf_counter() - started:.0f} s; wrote {args.out}/pd.md, pd.json, {png}")
    return 0
