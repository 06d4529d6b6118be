"""``slogate experiment``: replay workloads against the live gateway with simulated engines.

For every (policy, QPS) point the runner starts fresh simulated engines (time-scaled) and a
gateway with that routing profile as child processes, replays a Poisson workload, and reports SLO
attainment, E2E latency and cost (instance active time, HyperFlexis eq.(3): engines x makespan,
in 50 ms units) per policy. Results go to a JSON file, a table on stdout and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.dispatch.build import RoutingProfile
from gateway.experiments.plotting import pyplot
from gateway.experiments.replay import Outcome, Summary, replay, summarize
from gateway.experiments.workload import HYPERFLEXIS_2TASK, HYPERFLEXIS_4TASK, TaskSpec, poisson_workload
from gateway.procs import ChildProcess, spawn_listening, spawn_sim_engine
from gateway.report_json import report_json
from profiles import PROFILES_DIR as DEFAULT_PROFILES_DIR

PRIO_SUFFIX = "+prio"


def split_prio(policy: str) -> tuple[str, bool]:
    """``"<profile>+prio"`` -> (profile, True): the engines schedule by the forwarded deadline."""
    return (policy.removesuffix(PRIO_SUFFIX), True) if policy.endswith(PRIO_SUFFIX) else (policy, False)


def routing_profile_path(name: str) -> Path:
    """A routing profile by name (profiles/routing/<name>.yaml) or path."""
    if name.endswith((".yaml", ".yml")):
        return Path(name)
    return DEFAULT_PROFILES_DIR / "routing" / f"{name}.yaml"


MODEL = "exp-model"
TASK_SETS: dict[str, tuple[TaskSpec, ...]] = {
    "hyperflexis-4task": HYPERFLEXIS_4TASK,
    "hyperflexis-2task": HYPERFLEXIS_2TASK,
}
COST_UNIT_S = 0.05  # HyperFlexis §7.5: one unit = one instance active for 50 ms


@dataclass(frozen=True, slots=True)
class PointResult:
    policy: str
    qps: float
    summary: Summary
    cost_units: float
    #: SLO attainment per task (the class the request was sent as)
    by_task: dict[str, float]
    #: attainment of each repetition (one per seed); the summary pools their requests
    runs: tuple[float, ...] = ()


def _progress(message: str) -> None:
    print(f"[experiment] {message}", file=sys.stderr, flush=True)


class Stack:
    """Simulated engines + one gateway, as child processes; stopped on exit."""

    def __init__(
        self,
        policy: str,
        engines: int,
        profile: str,
        time_scale: float,
        slo_profile: str,
        engine_speed: float = 1.0,
    ) -> None:
        # "<profile>+prio", or a profile that asks for it (engine_scheduling: deadline): engines
        # order their own queues by the TTFT deadline the gateway forwards
        base, prio = split_prio(policy)
        self.deadline_engines = (
            prio or RoutingProfile.load(routing_profile_path(base)).dispatcher.deadline_engines
        )
        self.policy = base
        self.engine_args: tuple[str, ...] = (
            "--profile",
            profile,
            "--model",
            MODEL,
            "--time-scale",
            str(time_scale),
        )
        if self.deadline_engines:
            self.engine_args += ("--scheduling-policy", "priority")
        if engine_speed != 1.0:  # (the gateway keeps the profile as its prior: it learns the speed)
            self.engine_args += ("--speed", repr(engine_speed))
        self.n_engines = engines
        self.profile = profile
        self.time_scale = time_scale
        self.slo_profile = slo_profile
        self.engines: list[ChildProcess] = []
        self.gateway: ChildProcess | None = None

    def __enter__(self) -> Stack:
        try:
            for i in range(self.n_engines):
                self.engines.append(
                    spawn_sim_engine(*self.engine_args, "--engine-id", f"sim-{i}", name=f"sim-{i}")
                )
            engines = [
                {
                    "url": e.url,
                    "kind": "sim",
                    "model": MODEL,
                    "name": e.name,
                    "latency_profile": self.profile,
                    "time_scale": self.time_scale,
                    "priority_scheduling": self.deadline_engines,
                }
                for e in self.engines
            ]
            env = {
                "SLOGATE_ENGINES": json.dumps(engines),
                "SLOGATE_PORT": "0",
                "SLOGATE_ROUTING_PROFILE": self.policy,
                "SLOGATE_SLO_PROFILE": self.slo_profile,
                "SLOGATE_LOG_LEVEL": "warning",
                "SLOGATE_MONITOR_INTERVAL_S": str(max(0.05, 1.0 / self.time_scale)),
            }
            self.gateway = spawn_listening([sys.executable, "-m", "gateway.cli", "serve"], "gateway", env=env)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for e in self.engines:
            e.stop()


def run_point(
    policy: str,
    qps: float,
    tasks: Sequence[TaskSpec],
    per_task: int,
    engines: int,
    profile: str,
    time_scale: float,
    slo_profile: str,
    seed: int,
) -> tuple[PointResult, list[Outcome]]:
    workload = poisson_workload(tasks, qps, per_task, seed=seed)
    with Stack(policy, engines, profile, time_scale, slo_profile) as stack:
        assert stack.gateway is not None
        outcomes = asyncio.run(
            replay(stack.gateway.url, MODEL, workload, time_scale, seed, label=f"{policy} {qps}")
        )
    cost = engines * summarize(outcomes).makespan_s / COST_UNIT_S
    return pooled(policy, qps, tasks, [outcomes], [cost]), outcomes


def pooled(
    policy: str,
    qps: float,
    tasks: Sequence[TaskSpec],
    runs: Sequence[Sequence[Outcome]],
    costs: Sequence[float],
) -> PointResult:
    """One table row from repeated runs of a point: requests pooled, cost averaged."""
    everything = [o for run in runs for o in run]
    by_task = {
        task.name: summarize([o for o in everything if o.spec.task == task.name]).attainment for task in tasks
    }
    return PointResult(
        policy,
        qps,
        summarize(everything),
        sum(costs) / len(costs),
        by_task,
        tuple(summarize(run).attainment for run in runs),
    )


def render(results: Sequence[PointResult]) -> str:
    tasks = list(results[0].by_task) if results else []
    header = (
        f"{'policy':<14} {'QPS':>6} {'attain':>7} {'TTFT ok':>8} {'TPOT ok':>8} {'E2E mean':>9} "
        f"{'E2E p99':>8} {'errors':>6} {'cost(units)':>11} {'runs min-max':>13}"
        + "".join(f" {t[:12]:>12}" for t in tasks)
    )
    lines = [header, "-" * len(header)]
    for r in sorted(results, key=lambda r: (r.qps, r.policy)):
        s = r.summary
        lines.append(
            f"{r.policy:<14} {r.qps:>6.2f} {s.attainment:>7.1%} {s.ttft_attainment:>8.1%} "
            f"{s.tpot_attainment:>8.1%} "
            f"{s.e2e_mean_s:>8.2f}s {s.e2e_p99_s:>7.2f}s {s.errors:>6} {r.cost_units:>11.0f}"
            f" {min(r.runs, default=0):>6.1%}-{max(r.runs, default=0):>6.1%}"
            + "".join(f" {r.by_task.get(t, 0.0):>12.1%}" for t in tasks)
        )
    return "\n".join(lines)


def plot(results: Sequence[PointResult], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy in sorted({r.policy for r in results}):
        points = sorted((r.qps, r.summary.attainment * 100) for r in results if r.policy == policy)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.set_xlabel("QPS (simulated time)")
    ax.set_ylabel("SLO attainment, TTFT and TPOT (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", choices=sorted(TASK_SETS), default="hyperflexis-4task")
    parser.add_argument("--slo-profile", default=None, help="gateway SLO profile (default: same as --tasks)")
    parser.add_argument(
        "--policies",
        default="round-robin,least-load,least-load-deadline,flow-control,wspt,hyperflexis",
        help="routing profiles; '+prio' after one turns on the engines' deadline scheduling",
    )
    parser.add_argument("--qps", default="2,4,6,8,10", help="comma-separated total QPS (simulated time)")
    parser.add_argument("--per-task", type=int, default=300)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--profile", default="qwen-7b")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="engines and clients run this much faster than real time; above ~2 the gateway, client and "
        "HTTP costs (which do not shrink) become a visible share of the shortened steps and the runs "
        "measure this machine rather than the modelled engines",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per point, seeds seed..seed+N-1; requests are pooled"
    )
    parser.add_argument("--out", type=Path, default=Path("results/experiment-a"))


def _checked_inputs(policies: list[str], qps: str, repeat: int) -> list[float]:
    """Every input checked before the first run (a bad one found at its point lost the points
    already run: nothing is written until the end); the rates. Exits 2 with the reason."""
    try:
        rates = [float(q) for q in qps.split(",")]
    except ValueError:
        rates = []
    problem = None
    if not rates or not all(0 < q < math.inf for q in rates):
        problem = f"--qps takes rates > 0, comma-separated: got {qps!r}"
    elif repeat < 1:
        problem = f"--repeat takes 1 or more, got {repeat}"
    elif not policies:
        problem = "--policies names no routing profile"
    else:
        for policy in policies:
            path = routing_profile_path(split_prio(policy)[0])
            if not path.is_file():
                problem = f"no routing profile {policy!r} ({path})"
                break
    if problem is not None:
        print(f"slogate experiment: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return rates


def experiment_main(args: argparse.Namespace) -> int:
    pyplot()  # fail now, not after the runs, if matplotlib is missing
    tasks = TASK_SETS[args.tasks]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = _checked_inputs(policies, args.qps, args.repeat)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[PointResult] = []
    total = len(policies) * len(rates) * args.repeat
    step = 0
    for qps in rates:
        for policy in policies:
            runs: list[list[Outcome]] = []
            costs: list[float] = []
            for seed in range(args.seed, args.seed + args.repeat):
                step += 1
                _progress(
                    f"({step}/{total}) policy={policy} qps={qps} seed={seed}: "
                    f"{len(tasks) * args.per_task} requests"
                )
                result, outcomes = run_point(
                    policy,
                    qps,
                    tasks,
                    args.per_task,
                    args.engines,
                    args.profile,
                    args.time_scale,
                    args.slo_profile or args.tasks,
                    seed,
                )
                _progress(f"  attainment {result.summary.attainment:.1%}")
                runs.append(outcomes)
                costs.append(result.cost_units)
            results.append(pooled(policy, qps, tasks, runs, costs))
    table = render(results)
    print(table)
    (args.out / "table.txt").write_text(table + "\n")
    (args.out / "results.json").write_text(
        report_json(
            [
                {
                    "policy": r.policy,
                    "qps": r.qps,
                    "cost_units": r.cost_units,
                    **asdict(r.summary),
                    "attainment_by_task": r.by_task,
                    "attainment_per_run": list(r.runs),
                }
                for r in results
            ],
            indent=2,
        )
    )
    png = args.out / "attainment_vs_qps.png"
    plot(results, png, f"{args.tasks}, {args.engines} x {args.profile} (sim)")
    print(f"wrote {args.out / 'results.json'}, {args.out / 'table.txt'} and {png}")
    return 0
