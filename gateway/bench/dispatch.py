"""``slogate bench dispatch``: what the dispatch loop costs at scale and under overload.

The real dispatch loop (:class:`DispatchLoop` over :class:`DispatchCore`) runs on a real event
loop in front of in-process engines that are never contacted: each assignment finishes after a
service time (first token at a tenth of it), each engine is "scraped" every ``scrape_s`` (its KV
usage from what it holds, as the monitor would record it), and every completion brings a new
arrival, so the queue stays at its target depth and the fleet stays saturated. The measurement
starts once the standing queue has turned over (:func:`steady_state_after`): with 10,000 queued
at 1,000 placements a second a request waits 10 s, twice its TTFT target, and the queue then
holds late requests as it does for as long as the overload lasts.

Measured: wall time inside the dispatcher (arrivals, loop steps, deliveries, engine-change
events) per placement, and as a share of the run: the event loop's time the dispatcher takes.
The harness's own work (tasks standing in for clients and engines) is not counted as dispatch.
The same calls are also timed in CPU time of the thread (``cpu_us_per_placement``): on a machine
shared with other work, wall time inside a call includes the time the process was descheduled,
CPU time does not (the meter's own clock reads are measured once and taken out).
HyperFlexis runs with the shipped `hyperflexis` profile's parameters and queue order (its
demotion plan included). ``floor`` is a dispatcher that decides nothing (first come, first served
onto any free slot, :mod:`gateway.bench.dispatch_floor`): what the harness and the fleet's
bookkeeping cost, so that what the others spend above it is their own. Targets from the issue:
<= 50 µs per placement and < 10 % of the loop at 256 engines / 10,000 queued.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gateway.api.errors import GatewayError
from gateway.bench.dispatch_floor import FloorLoop
from gateway.bench.harness import median_run
from gateway.dispatch.build import RoutingProfile
from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.offline import offline_fleet
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.report_json import report_json
from gateway.router import Router
from gateway.runtime import GcPauses, tune_gc
from policies.api import EngineState, RequestView
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL
from policies.pipeline import compile_profile
from policies.queue_order import make_order
from profiles import PROFILES_DIR as DEFAULT_PROFILES_DIR

TARGET_US_PER_PLACEMENT = 50.0
TARGET_LOOP_SHARE = 0.10
PROMPT, OUTPUT = 200, 50
BLOCK = 16


@dataclass(frozen=True, slots=True)
class DispatchPoint:
    dispatcher: str
    engines: int
    queued_target: int
    placements: int
    placements_per_s: float
    us_per_placement: float
    loop_share: float
    mean_queued: float
    wall_s: float
    #: CPU time of the thread inside the dispatcher per placement (not inflated by preemption)
    cpu_us_per_placement: float = 0.0
    #: turns of the dispatch loop's task per placement
    steps_per_placement: float = 0.0
    #: seconds run before measuring (steady_state_after)
    warmup_s: float = 0.0
    #: the longest single dispatcher call (ms): how long it held the event loop at once, a stall
    #: in every stream the gateway relays
    max_call_ms: float = 0.0
    #: the wall µs per placement by where it was spent: arrivals (submit), the loop's turns
    #: (step, its timer, deliveries) and engine events (completions, first tokens, scrapes)
    split_us: tuple[tuple[str, float], ...] = ()
    #: the process's garbage collections in the measured time (the harness's objects and the
    #: dispatcher's, wherever they ran): per placement, and the longest (a stall like a long call)
    gc_us_per_placement: float = 0.0
    max_gc_pause_ms: float = 0.0
    #: with repeats, every run's µs per placement (this point is the median run, whole)
    runs_us: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.us_per_placement <= TARGET_US_PER_PLACEMENT and self.loop_share < TARGET_LOOP_SHARE


class _Meter:
    """Accumulates wall time and thread CPU time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.parts: dict[str, float] = {}
        self.cpu_seconds = 0.0
        self.calls = 0
        self.longest = 0.0
        self.cpu_overhead_s = self._calibrate()

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = self.longest = 0.0
        self.calls = 0
        for part in self.parts:  # (in place: the wrappers hold this dict)
            self.parts[part] = 0.0

    @property
    def cpu_net_seconds(self) -> float:
        """CPU time inside the wrapped calls, less what the meter's own clock reads cost."""
        return max(0.0, self.cpu_seconds - self.calls * self.cpu_overhead_s)

    @staticmethod
    def _calibrate(rounds: int = 20_000) -> float:
        """CPU time an empty timed call reads on its own clocks (the thread clock is a system
        call: a fraction of a microsecond, small but not nothing against a placement)."""
        wall, cpu = time.perf_counter, time.thread_time
        best = float("inf")
        for _ in range(5):
            total = 0.0
            for _ in range(rounds // 5):
                c0 = cpu()
                wall()
                wall()
                total += cpu() - c0
            best = min(best, total / (rounds // 5))
        return best

    def wrap(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        wall, cpu = time.perf_counter, time.thread_time
        self.parts.setdefault(part, 0.0)
        parts = self.parts

        def timed(*args: Any, **kwargs: Any) -> Any:
            c0 = cpu()
            t0 = wall()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = wall()
                c1 = cpu()
                self.seconds += t1 - t0
                parts[part] += t1 - t0
                if t1 - t0 > self.longest:
                    self.longest = t1 - t0
                self.cpu_seconds += c1 - c0
                self.calls += 1

        return timed


def _dispatch_loop(fleet: Fleet, dispatcher: str, slots: int) -> DispatchLoop | FloorLoop:
    if dispatcher == "floor":
        return FloorLoop(fleet, slots)
    if dispatcher not in ("pipeline", "hyperflexis"):
        raise ValueError(f"unknown dispatcher {dispatcher!r}: pipeline, hyperflexis or floor")
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    hyperflexis = dispatcher == "hyperflexis"
    # HyperFlexis as the shipped profile runs it (its demotion plan included)
    shipped = RoutingProfile.load(DEFAULT_PROFILES_DIR / "routing" / "hyperflexis.yaml").dispatcher
    limits = ClassLimits(max_queued=1_000_000, queue_timeout_s=3600.0)
    return DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            shipped.order if hyperflexis else make_order("fcfs", {}),
            lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE),
            lambda _: limits,
            hyperflexis=shipped.hyperflexis if hyperflexis else None,
            max_engine_load=None if hyperflexis else slots,
            tightest_ttft_s=5.0,
        )
    )


async def _run_point(
    dispatcher: str,
    engines: int,
    queued: int,
    slots: int,
    service_s: float,
    seconds: float,
    seed: int,
    warmup_s: float,
    pauses: GcPauses,
) -> DispatchPoint:
    """One point; ``pauses`` (installed by the caller, which removes it whatever happens here)
    times the process's garbage collections."""
    rng = random.Random(seed)
    fleet = offline_fleet({"m": engines})
    capacity_tokens = slots * (PROMPT + OUTPUT)
    for engine_id in fleet.records:
        fleet.record_state(engine_id, _state(0, capacity_tokens), 0.0)
    loop_obj = _dispatch_loop(fleet, dispatcher, slots)
    meter = _Meter()
    core = loop_obj.core
    core.submit = meter.wrap(core.submit, "arrivals")  # type: ignore[method-assign]
    core.step = meter.wrap(core.step, "turns")  # type: ignore[method-assign]
    core.next_wake = meter.wrap(core.next_wake, "turns")  # type: ignore[method-assign]
    loop_obj._deliver = meter.wrap(loop_obj._deliver, "turns")  # type: ignore[method-assign]
    fleet.listeners[:] = [meter.wrap(listener, "engine events") for listener in fleet.listeners]
    tune_gc()  # as `slogate serve` runs (gateway.runtime)
    loop_obj.start()
    loop = asyncio.get_running_loop()
    placements = 0
    counting = False
    seq = 0
    tasks: set[asyncio.Task[None]] = set()
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal seq, placements
        seq += 1
        rid = f"r{seq}"
        prompt = rng.randint(PROMPT // 2, PROMPT * 3 // 2)
        view = RequestView(rid, "m", prompt, OUTPUT, arrival=time.monotonic())
        entry = RunningEntry(prompt, OUTPUT, 0.1, 0.0)
        try:
            record = await loop_obj.place(view, 5.0, 0.1, "bench", entry)
        except GatewayError:
            return
        if counting:
            placements += 1
        entry.dispatched_at = time.monotonic()
        service = service_s * rng.uniform(0.5, 1.5)
        loop.call_later(service / 10, fleet.mark_prefilled, record.engine_id, rid)
        loop.call_later(service, _finish, record.engine_id, rid)

    def _finish(engine_id: str, rid: str) -> None:
        loop_obj.release(engine_id, rid)
        if not stop.is_set():
            _spawn()

    def _spawn() -> None:
        task = loop.create_task(client())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def scrape(engine_id: str, offset: float) -> None:
        # what the monitor would record: the engine's KV use from what it holds
        await asyncio.sleep(offset)
        record = fleet.records[engine_id]
        while not stop.is_set():
            used = sum(r.prompt_tokens + r.max_tokens for r in record.running.values())
            fleet.record_state(engine_id, _state(used, capacity_tokens), time.monotonic())
            await asyncio.sleep(1.0)

    scrapers = [
        loop.create_task(scrape(e, i / engines))
        for i, e in enumerate(fleet.records)
        if dispatcher == "hyperflexis"
    ]
    for _ in range(queued + engines * slots):
        _spawn()
    await asyncio.sleep(warmup_s)  # fill the fleet, reach a steady state
    counting = True
    meter.reset()
    pauses.reset()
    steps0 = loop_obj.steps
    depth_samples: list[int] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await asyncio.sleep(0.1)
        depth_samples.append(core.queued())
    wall = time.perf_counter() - t0
    counting = False
    spent = meter.seconds
    split = tuple((part, s / max(1, placements) * 1e6) for part, s in meter.parts.items())
    cpu_spent = meter.cpu_net_seconds
    steps = loop_obj.steps - steps0
    gc_spent, gc_longest = pauses.total_s, pauses.longest_s
    stop.set()
    for task in [*tasks, *scrapers]:
        task.cancel()
    await asyncio.gather(*tasks, *scrapers, return_exceptions=True)
    await loop_obj.stop()
    return DispatchPoint(
        dispatcher=dispatcher,
        engines=engines,
        queued_target=queued,
        placements=placements,
        placements_per_s=placements / wall,
        us_per_placement=spent / max(1, placements) * 1e6,
        loop_share=spent / wall,
        mean_queued=sum(depth_samples) / max(1, len(depth_samples)),
        wall_s=wall,
        cpu_us_per_placement=cpu_spent / max(1, placements) * 1e6,
        steps_per_placement=steps / max(1, placements),
        warmup_s=warmup_s,
        max_call_ms=meter.longest * 1e3,
        split_us=split,
        gc_us_per_placement=gc_spent / max(1, placements) * 1e6,
        max_gc_pause_ms=gc_longest * 1e3,
    )


def steady_state_after(queued: int, rate: float, seconds: float) -> float:
    """Seconds to run before measuring: until the standing queue has turned over once (its
    requests then span every age up to their whole wait, the ones already late included, as they
    do for as long as the overload lasts), and at least a short fill of the fleet. Measured from
    the start instead, a queue that waits longer than the TTFT target looked cheaper: nothing in
    it was late yet."""
    return max(min(2.0, seconds / 2), 1.1 * queued / rate)


def _state(used_tokens: int, capacity_tokens: int) -> EngineState:
    blocks = capacity_tokens // BLOCK
    return EngineState(
        kv_usage=min(1.0, used_tokens / capacity_tokens), block_size=BLOCK, num_gpu_blocks=blocks
    )


def run_dispatch_bench(
    engines: list[int],
    queued: list[int],
    dispatchers: list[str],
    slots: int = 8,
    rate: float = 1000.0,
    seconds: float = 3.0,
    progress: Callable[[str], None] | None = None,
    repeats: int = 1,
) -> list[DispatchPoint]:
    """Every (dispatcher, engines, queued) point; the service time is set so the saturated fleet
    completes about ``rate`` requests a second whatever its size. With ``repeats``, each point is
    run that many times and the run with the median µs per placement is kept whole
    (:func:`~gateway.bench.harness.median_run`), every run's figure beside it: on a shared machine
    one run moves by 20 %."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    points = []
    total = len(engines) * len(queued) * len(dispatchers)
    pauses = GcPauses().install()
    try:
        for dispatcher in dispatchers:
            for n in engines:
                for q in queued:
                    service_s = n * slots / rate
                    warmup_s = steady_state_after(q, rate, seconds)
                    args = (dispatcher, n, q, slots, service_s, seconds, n + q, warmup_s, pauses)
                    runs = [runner(_run_point(*args)) for _ in range(repeats)]
                    point = median_run(runs, lambda r: r.us_per_placement)
                    if repeats > 1:
                        point = replace(point, runs_us=tuple(r.us_per_placement for r in runs))
                    points.append(point)
                    if progress is not None:
                        progress(_progress_line(point, len(points), total))
    finally:
        pauses.uninstall()
    return points


def _progress_line(point: DispatchPoint, done: int, total: int) -> str:
    return (
        f"[{done}/{total}] {point.dispatcher:11s} {point.engines:4d} engines "
        f"{point.queued_target:6d} queued: "
        f"{point.us_per_placement:6.1f} µs/placement "
        f"({point.cpu_us_per_placement:5.1f} CPU), "
        f"{point.loop_share:6.1%} of the loop, {point.steps_per_placement:.2f} turns each, "
        f"longest call {point.max_call_ms:.1f} ms "
        f"(longest collection {point.max_gc_pause_ms:.1f} ms, "
        f"collections {point.gc_us_per_placement:.1f} µs/placement); "
        + ", ".join(f"{part} {us:.1f}" for part, us in point.split_us)
        + f" µs (after {point.warmup_s:.1f} s of warm-up)"
        + (
            f"; the median of {len(point.runs_us)} runs: "
            + " / ".join(f"{us:.1f}" for us in point.runs_us)
            + " µs"
            if point.runs_us
            else ""
        )
    )


def render_table(points: list[DispatchPoint]) -> str:
    lines = [
        "| dispatcher | engines | queued (target / mean) | placements/s | µs per placement | "
        "CPU µs per placement | loop share | longest call (ms) | µs in arrivals / turns / engine events "
        "| GC µs per placement / longest (ms) | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        runs = f" (runs {' / '.join(f'{us:.1f}' for us in p.runs_us)})" if p.runs_us else ""
        lines.append(
            f"| {p.dispatcher} | {p.engines} | {p.queued_target} / {p.mean_queued:.0f} | "
            f"{p.placements_per_s:.0f} | {p.us_per_placement:.1f}{runs} | {p.cpu_us_per_placement:.1f} | "
            f"{p.loop_share:.1%} | {p.max_call_ms:.1f} | "
            f"{' / '.join(f'{us:.1f}' for _, us in p.split_us)} | "
            f"{p.gc_us_per_placement:.1f} / {p.max_gc_pause_ms:.1f} | "
            f"{'(the floor)' if p.dispatcher == 'floor' else 'met' if p.ok else 'MISSED'} |"
        )
    us, share = TARGET_US_PER_PLACEMENT, TARGET_LOOP_SHARE
    lines.append(f"targets: <= {us:.0f} µs per placement and < {share:.0%} of the loop")
    return "\n".join(lines)


def plot(points: list[DispatchPoint], path: Path) -> None:
    from gateway.experiments.plotting import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dispatcher in sorted({p.dispatcher for p in points}):
        for q in sorted({p.queued_target for p in points}):
            series = sorted(
                (p for p in points if p.dispatcher == dispatcher and p.queued_target == q),
                key=lambda p: p.engines,
            )
            xs = [p.engines for p in series]
            label = f"{dispatcher}, {q} queued"
            left.plot(xs, [p.us_per_placement for p in series], marker="o", label=label)
            right.plot(xs, [100 * p.loop_share for p in series], marker="o", label=label)
    left.axhline(TARGET_US_PER_PLACEMENT, color="grey", linestyle="--", label="target")
    right.axhline(100 * TARGET_LOOP_SHARE, color="grey", linestyle="--", label="target")
    for ax, title in ((left, "dispatch cost per placement (µs)"), (right, "share of the event loop (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_dispatch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="16,64,256", help="comma-separated engine counts")
    parser.add_argument("--queued", default="1000,10000", help="comma-separated standing queue depths")
    parser.add_argument(
        "--dispatchers",
        default="pipeline,hyperflexis,floor",
        help="pipeline (least load), hyperflexis, and floor: FIFO onto any free slot, what the "
        "harness and the fleet's bookkeeping cost (gateway/bench/dispatch_floor.py)",
    )
    parser.add_argument("--slots", type=int, default=8, help="requests each engine holds at once")
    parser.add_argument("--rate", type=float, default=1000.0, help="completions per second of the fleet")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per point")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per point; the median run is reported whole, with every run's figure",
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench-dispatch"))


def bench_dispatch_main(args: argparse.Namespace) -> int:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    if args.repeats < 1:
        print(f"slogate bench dispatch: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2

    points = run_dispatch_bench(
        ints(args.engines),
        ints(args.queued),
        [d for d in args.dispatchers.split(",") if d],
        slots=args.slots,
        rate=args.rate,
        seconds=args.seconds,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        repeats=args.repeats,
    )
    table = render_table(points)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "points.json").write_text(report_json([asdict(p) for p in points], indent=2))
    plot(points, args.out / "dispatch_cost.png")
    print(f"wrote {args.out / 'table.md'}, {args.out / 'points.json'}, {args.out / 'dispatch_cost.png'}")
    return 0
