"""Tables and plots of simulated comparisons: one row per (policy, QPS), the papers' figure style."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import Outcome, Summary, summarize


@dataclass(frozen=True, slots=True)
class Row:
    policy: str
    qps: float
    summary: Summary
    cost_units: float
    #: SLO attainment per task (the workload's class of each request)
    by_task: dict[str, float]
    #: attainment of each seed's run; the summary pools their requests
    runs: tuple[float, ...]
    events: int
    wall_s: float


def row(
    policy: str,
    qps: float,
    runs: Sequence[Sequence[Outcome]],
    costs: Sequence[float],
    events: int,
    wall_s: float,
) -> Row:
    everything = [o for run in runs for o in run]
    tasks = sorted({o.spec.task for o in everything})
    return Row(
        policy,
        qps,
        summarize(everything),
        sum(costs) / max(1, len(costs)),
        {t: summarize([o for o in everything if o.spec.task == t]).attainment for t in tasks},
        tuple(summarize(run).attainment for run in runs),
        events,
        wall_s,
    )


def table(rows: Sequence[Row]) -> str:
    """A Markdown table: attainment (both, TTFT, TPOT), E2E p50 / p99, errors, cost, per task."""
    tasks = sorted({t for r in rows for t in r.by_task})
    head = (
        "| policy | QPS | SLO attainment | TTFT ok | TPOT ok | E2E p50 (s) | E2E p99 (s) | errors "
        "| cost (units) | runs min-max |" + "".join(f" {t} |" for t in tasks)
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=lambda r: (r.qps, r.policy)):
        s = r.summary
        spread = f"{min(r.runs, default=0):.1%}-{max(r.runs, default=0):.1%}" if len(r.runs) > 1 else "-"
        lines.append(
            f"| {r.policy} | {r.qps:g} | {s.attainment:.1%} | {s.ttft_attainment:.1%} | "
            f"{s.tpot_attainment:.1%} | {s.e2e_p50_s:.2f} | {s.e2e_p99_s:.2f} | {s.errors} | "
            f"{r.cost_units:,.0f} | {spread} |"
            + "".join(f" {r.by_task.get(t, math.nan):.1%} |" for t in tasks)
        )
    return "\n".join(lines)


def plot_curves(rows: Sequence[Row], path: Path, title: str) -> None:
    """Attainment (both / TTFT / TPOT) and E2E p99 against QPS, one line per policy."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels: tuple[tuple[Any, str, Callable[[Summary], float]], ...] = (
        (axes[0][0], "SLO attainment (%)", lambda s: 100 * s.attainment),
        (axes[0][1], "TTFT attainment (%)", lambda s: 100 * s.ttft_attainment),
        (axes[1][0], "TPOT attainment (%)", lambda s: 100 * s.tpot_attainment),
        (axes[1][1], "E2E p99 (s)", lambda s: s.e2e_p99_s),
    )
    for ax, label, value in panels:
        for policy in sorted({r.policy for r in rows}):
            mine = sorted((r for r in rows if r.policy == policy), key=lambda r: r.qps)
            ax.plot([r.qps for r in mine], [value(r.summary) for r in mine], marker="o", label=policy)
        ax.set_xlabel("request rate (QPS)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if "%" in label:
            ax.set_ylim(0, 102)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
