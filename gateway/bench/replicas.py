"""``slogate bench replicas``: several gateway replicas in front of the same engines, each counting
only its own requests (``state_store: memory``) or every replica's (``redis``).

``--replicas`` gateway processes (``slogate serve``, ``max_engine_load: L`` each) stand in front of
``--engines`` simulated engines that stream one token every ``--token-gap-ms`` to each request
they hold, however many: an engine's own queue never fills, so what runs on it is what the
gateways sent. Open-loop Poisson arrivals at ``--load`` of the fleet's seats (engines x L) are
spread over the replicas in turn, as a Kubernetes Service spreads them; the same schedule for
every mode. Each answer names its engine (``x-slogate-engine``), and the times of its first and
last token bound its stay there. Reported per mode:

- the most requests any engine held at once, and the share of the engines' busy time spent above
  L (requests x seconds over the limit, over requests x seconds);
- how unevenly the engines were loaded: the spread (coefficient of variation) of their mean
  number of requests;
- time to first token, p50 and p99 (what sharing costs: a request waits in its replica's queue
  rather than on an engine over its limit), and errors;
- the gateways' CPU per request, their idle CPU (monitor, and the exchange's rounds) subtracted,
  the exchange's own CPU (redis mode's idle CPU less memory mode's) and the store's commands per
  second.

A plot shows each engine's requests over time, per mode, against the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import orjson

from gateway.bench.harness import (
    checks_table,
    cpu_seconds,
    engine_entry,
    paced_profile,
    percentile,
    progress,
    spawn_gateway,
    spawn_paced_engine,
    wait_until_served,
)
from gateway.bench.replica_sessions import SessionFigures, run_sessions
from gateway.bench.sustained_rate import schedule
from gateway.procs import ChildProcess
from gateway.state.local_redis import LocalRedis, RedisUnavailable

MODEL = "bench-replicas"
#: single: one gateway takes every request (its own count is exact: what it measures above the
#: limit is the measurement's own error, a token's arrival order across connections); memory:
#: the replicas each count their own requests (and the engines' scrapes); redis: every replica's
MODES = ("single", "memory", "redis")
#: the shared mode's target: engine time above the limit, as a share of all engine time
SHARED_OVER_LIMIT = 0.01
#: the shared mode's target for conversations: their later turns on their previous engine (the
#: imbalance guard may move one when its engine is far busier than another)
SESSIONS_KEPT = 0.9
#: a request not answered within this long counts as an error (the run goes on)
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Stay:
    """One answered request: its engine and the times (seconds from the start) of its first and
    last token, and when it was due."""

    engine: str
    due_s: float
    first_s: float
    last_s: float


@dataclass
class ModePoint:
    mode: str
    requests: int
    errors: int
    #: the most requests any engine held at once
    peak: int
    #: per engine, the most it held at once
    peaks: dict[str, int]
    #: requests x seconds above the limit over requests x seconds, all engines
    over_limit_share: float
    #: coefficient of variation of the engines' mean number of requests
    imbalance: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    cpu_ms_per_request: float
    #: the gateways' idle CPU (every replica's, ms per second): monitor, and the exchange's rounds
    idle_cpu_ms_per_s: float
    store_commands_per_s: float
    #: per engine, (time, requests held) at each change, for the plot
    steps: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    #: the conversations part (gateway/bench/replica_sessions.py); None when not run
    sessions: SessionFigures | None = None


def occupancy(
    stays: Sequence[Stay], limit: int
) -> tuple[dict[str, int], float, dict[str, float], dict[str, list[tuple[float, int]]]]:
    """Per engine the peak and mean number of requests held; the share of requests x seconds
    above ``limit``; and each engine's (time, held) steps."""
    by_engine: dict[str, list[tuple[float, int]]] = {}
    for stay in stays:
        events = by_engine.setdefault(stay.engine, [])
        events.append((stay.first_s, 1))
        events.append((stay.last_s, -1))
    start = min((s.first_s for s in stays), default=0.0)
    end = max((s.last_s for s in stays), default=0.0)
    peaks: dict[str, int] = {}
    means: dict[str, float] = {}
    steps: dict[str, list[tuple[float, int]]] = {}
    busy = over = 0.0
    for engine, events in by_engine.items():
        # (ends before starts at one instant: a request leaving as another comes is not two)
        events.sort(key=lambda e: (e[0], e[1]))
        held, at, peak, area = 0, start, 0, 0.0
        trace = [(start, 0)]
        for t, change in events:
            area += held * (t - at)
            busy += held * (t - at)
            over += max(0, held - limit) * (t - at)
            held += change
            at = t
            peak = max(peak, held)
            trace.append((t, held))
        peaks[engine] = peak
        means[engine] = area / (end - start) if end > start else 0.0
        steps[engine] = trace
    return peaks, (over / busy if busy else 0.0), means, steps


def spread(values: Sequence[float]) -> float:
    """Coefficient of variation (0: even)."""
    if len(values) < 2 or not any(values):
        return 0.0
    return statistics.pstdev(values) / statistics.fmean(values)


async def _send_all(urls: Sequence[str], body: bytes, times: Sequence[float]) -> tuple[list[Stay], int]:
    """One streamed request at each of ``times`` (open loop), to the replicas in turn."""
    stays: list[Stay] = []
    errors = 0
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(i: int, due: float) -> None:
            nonlocal errors
            first = last = 0.0
            try:
                async with session.post(
                    urls[i % len(urls)] + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response:
                    engine = response.headers.get("x-slogate-engine", "")
                    if response.status != 200 or not engine:
                        await response.read()
                        errors += 1
                        return
                    async for chunk in response.content.iter_any():
                        now = time.perf_counter() - start
                        if b"data:" in chunk:
                            first = first or now
                            last = now
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                return
            if not first:
                errors += 1
                return
            stays.append(Stay(engine, due, first, last))

        tasks = []
        for i, due in enumerate(times):
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    return stays, errors


def _store_commands(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        stats: dict[str, object] = client.info("stats")  # type: ignore[assignment]
        return int(str(stats["total_commands_processed"]))
    finally:
        client.close()


async def _idle_cpu(pids: Sequence[int], seconds: float = 1.0) -> float:
    before, t0 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
    await asyncio.sleep(seconds)
    return (sum(cpu_seconds(p) for p in pids) - before) / (time.perf_counter() - t0)


async def _measure(
    mode: str,
    gateways: Sequence[ChildProcess],
    redis_url: str | None,
    body: bytes,
    times: Sequence[float],
    limit: int,
) -> ModePoint:
    async with aiohttp.ClientSession() as session:
        for gateway in gateways:
            await wait_until_served(session, gateway.url, MODEL)
    pids = [g.pid for g in gateways]
    idle = await _idle_cpu(pids)
    commands0 = _store_commands(redis_url) if redis_url else 0
    cpu0, t0 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
    stays, errors = await _send_all([g.url for g in gateways], body, times)
    elapsed = time.perf_counter() - t0
    cpu = sum(cpu_seconds(p) for p in pids) - cpu0 - idle * elapsed
    commands = (_store_commands(redis_url) - commands0) / elapsed if redis_url else 0.0
    peaks, over, means, steps = occupancy(stays, limit)
    ttft = [(s.first_s - s.due_s) * 1000 for s in stays]
    return ModePoint(
        mode=mode,
        requests=len(times),
        errors=errors,
        peak=max(peaks.values(), default=0),
        peaks=dict(sorted(peaks.items())),
        over_limit_share=over,
        imbalance=spread(list(means.values())),
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p99_ms=percentile(ttft, 0.99),
        cpu_ms_per_request=cpu * 1000 / max(1, len(times)),
        idle_cpu_ms_per_s=idle * 1000,
        store_commands_per_s=commands,
        steps=steps,
    )


async def _conversations(
    gateways: Sequence[ChildProcess], sessions: int, turns: int, tokens: int, run: str
) -> SessionFigures:
    urls = [g.url for g in gateways]
    async with aiohttp.ClientSession() as session:
        for url in urls:
            await wait_until_served(session, url, MODEL)
    pids = [g.pid for g in gateways]
    if len(gateways) > 1:
        await asyncio.sleep(1.0)  # (the replicas find each other within a round or two)
    idle = await _idle_cpu(pids)
    cpu0, t0 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
    result = await run_sessions(MODEL, urls, sessions, turns, tokens, run, REQUEST_TIMEOUT_S)
    cpu = sum(cpu_seconds(p) for p in pids) - cpu0 - idle * (time.perf_counter() - t0)
    return replace(result, cpu_ms_per_turn=cpu * 1000 / max(1, result.answered))


@dataclass
class ReplicaBench:
    replicas: int
    engines: int
    limit: int
    load: float
    rate: float
    seconds: float
    tokens: int
    token_gap_ms: float
    sync_interval_s: float
    points: list[ModePoint]

    def checks(self) -> list[tuple[str, str, str, bool]]:
        rows = []
        for p in self.points:
            rows.append(
                (
                    f"{p.mode}: engine time above max_engine_load {self.limit}",
                    f"{p.over_limit_share:.2%} (most held at once: {p.peak})",
                    f"<= {SHARED_OVER_LIMIT:.0%}" if p.mode == "redis" else "(reported)",
                    p.over_limit_share <= SHARED_OVER_LIMIT if p.mode == "redis" else True,
                )
            )
            rows.append((f"{p.mode}: errors", f"{p.errors} of {p.requests}", "0", p.errors == 0))
            if p.sessions is not None:
                shared = p.mode == "redis"
                for group, turns in (
                    ("with x-session-id", p.sessions.with_session),
                    ("prompt only", p.sessions.prompt_only),
                ):
                    rows.append(
                        (
                            f"{p.mode}: conversations {group}: later turns on their previous engine, "
                            "prompt cached",
                            f"{turns.kept:.1%}, {turns.cached:.1%} ({turns.later_turns} turns)",
                            f">= {SESSIONS_KEPT:.0%} kept" if shared else "(reported)",
                            turns.kept >= SESSIONS_KEPT if shared else True,
                        )
                    )
                rows.append(
                    (
                        f"{p.mode}: conversations: errors, mean prompt, gateway CPU per turn",
                        f"{p.sessions.errors}, {p.sessions.mean_prompt_tokens:.0f} tokens, "
                        f"{p.sessions.cpu_ms_per_turn:.2f} ms",
                        "0 errors",
                        p.sessions.errors == 0,
                    )
                )
            rows.append(
                (
                    f"{p.mode}: TTFT p50 / p99, engine load spread",
                    f"{p.ttft_p50_ms:.1f} / {p.ttft_p99_ms:.1f} ms, {p.imbalance:.3f}",
                    "(reported)",
                    True,
                )
            )
            rows.append(
                (
                    f"{p.mode}: gateway CPU per request, idle CPU, store commands",
                    f"{p.cpu_ms_per_request:.3f} ms, {p.idle_cpu_ms_per_s:.1f} ms/s, "
                    f"{p.store_commands_per_s:.0f}/s",
                    "(reported)",
                    True,
                )
            )
        return rows


def run_replica_bench(
    replicas: int = 2,
    engines: int = 4,
    limit: int = 4,
    load: float = 0.9,
    seconds: float = 20.0,
    tokens: int = 32,
    token_gap_ms: float = 20.0,
    sync_interval_s: float = 0.5,
    push_delay_s: float = 0.002,
    modes: Sequence[str] = MODES,
    seed: int = 0,
    report: Callable[[str], None] = progress,
    sessions: int = 0,
    turns: int = 4,
) -> ReplicaBench:
    """Blocking. Raises :class:`RedisUnavailable` when a mode needs Redis and there is none."""
    service_s = tokens * token_gap_ms / 1000
    rate = load * engines * limit / service_s
    times = schedule(rate, seconds, seed)
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about load balancing."}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    points = []
    with tempfile.TemporaryDirectory(prefix="slogate-bench-replicas-") as tmp, ExitStack() as stack:
        profile = paced_profile(Path(tmp), token_gap_ms / 1000)
        redis = stack.enter_context(LocalRedis()) if "redis" in modes else None
        report(f"starting {engines} paced engines ({tokens} tokens, {token_gap_ms:g} ms apart)")
        entries = [
            engine_entry(stack.enter_context(spawn_paced_engine(MODEL, profile, f"engine-{i}")), MODEL)
            for i in range(engines)
        ]
        for i, mode in enumerate(modes):
            count = 1 if mode == "single" else replicas
            report(
                f"[{i + 1}/{len(modes)}] {mode}: {count} gateway(s), {len(times)} requests at "
                f"{rate:.1f}/s ({load:.0%} of {engines} x {limit} seats) for {seconds:g} s"
            )
            store_url = redis.url if mode == "redis" and redis is not None else None
            store_env: dict[str, str] = {}
            if store_url is not None:
                store_env = {
                    "SLOGATE_STATE_STORE": "redis",
                    "SLOGATE_REDIS_URL": store_url,
                    "SLOGATE_REPLICA_SYNC_INTERVAL_S": str(sync_interval_s),
                    "SLOGATE_REPLICA_PUSH_DELAY_S": str(push_delay_s),
                }
            env = store_env | {"SLOGATE_MAX_ENGINE_LOAD": str(limit)}
            with ExitStack() as gateways:
                procs_g = [
                    gateways.enter_context(spawn_gateway(entries, env | {"SLOGATE_REPLICA_ID": f"bench-{j}"}))
                    for j in range(count)
                ]
                point = asyncio.run(_measure(mode, procs_g, store_url, body, times, limit))
            report(
                f"[{i + 1}/{len(modes)}] {mode}: {point.over_limit_share:.2%} of engine time above "
                f"{limit}, most held {point.peak}; TTFT p50/p99 {point.ttft_p50_ms:.1f}/"
                f"{point.ttft_p99_ms:.1f} ms; {point.errors} errors"
            )
            if sessions:
                # (gateways of their own: the prefix-aware profile would draw the load part's
                # identical prompts together), and no max_engine_load: routing alone decides
                env = store_env | {"SLOGATE_ROUTING_PROFILE": "prefix-aware"}
                with ExitStack() as gateways:
                    procs_g = [
                        gateways.enter_context(
                            spawn_gateway(entries, env | {"SLOGATE_REPLICA_ID": f"bench-sessions-{j}"})
                        )
                        for j in range(count)
                    ]
                    point.sessions = asyncio.run(_conversations(procs_g, sessions, turns, tokens, mode))
                with_session, prompt_only = point.sessions.with_session, point.sessions.prompt_only
                report(
                    f"[{i + 1}/{len(modes)}] {mode}: {sessions} conversations x {turns} turns: later "
                    f"turns on their previous engine {with_session.kept:.1%} with a session id, "
                    f"{prompt_only.kept:.1%} without; prompt cached {with_session.cached:.1%} / "
                    f"{prompt_only.cached:.1%}; {point.sessions.errors} errors"
                )
            points.append(point)
    return ReplicaBench(
        replicas, engines, limit, load, rate, seconds, tokens, token_gap_ms, sync_interval_s, points
    )


def plot(bench: ReplicaBench, path: Path) -> None:
    from gateway.experiments.plotting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(
        len(bench.points), 1, figsize=(10, 3 * len(bench.points)), squeeze=False, sharex=True
    )
    for ax, point in zip(axes[:, 0], bench.points, strict=True):
        for engine, steps in sorted(point.steps.items()):
            ax.step([t for t, _ in steps], [n for _, n in steps], where="post", label=engine, linewidth=0.8)
        ax.axhline(bench.limit, color="black", linestyle="--", linewidth=1, label="max_engine_load")
        ax.set_title(
            f"state_store: {point.mode}: {point.over_limit_share:.1%} of engine time above the limit, "
            f"most held {point.peak}"
        )
        ax.set_ylabel("requests on the engine")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="upper right")
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sessions(bench: ReplicaBench, path: Path) -> bool:
    """Kept and cached shares of the conversations' later turns, per mode (False: none ran)."""
    points = [p for p in bench.points if p.sessions is not None]
    if not points:
        return False
    from gateway.experiments.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(points))
    groups = [(p.sessions.with_session, p.sessions.prompt_only) for p in points if p.sessions is not None]
    bars = (
        ("with a session id: on the previous turn's engine", [100 * w.kept for w, _ in groups]),
        ("with a session id: prompt tokens cached", [100 * w.cached for w, _ in groups]),
        ("prompt only: on the previous turn's engine", [100 * o.kept for _, o in groups]),
        ("prompt only: prompt tokens cached", [100 * o.cached for _, o in groups]),
    )
    for i, (label, heights) in enumerate(bars):
        ax.bar([x - 0.3 + 0.2 * i for x in xs], heights, width=0.2, label=label)
    ax.set_xticks(list(xs), [f"state_store: {p.mode}" for p in points])
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of later turns / of their prompt")
    ax.set_title(f"conversations through {bench.replicas} replicas in turn (prefix-aware routing)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(bench: ReplicaBench) -> str:
    lines = checks_table(bench.checks())
    lines.append(
        f"({bench.replicas} gateway replicas, {bench.engines} engines, max_engine_load {bench.limit}; "
        f"{bench.rate:.1f} requests/s ({bench.load:.0%} of the seats) for {bench.seconds:g} s, "
        f"{bench.tokens} tokens {bench.token_gap_ms:g} ms apart; replicas exchange every "
        f"{bench.sync_interval_s:g} s; CPU: every replica's, their idle CPU subtracted)"
    )
    return "\n".join(lines)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="gateway processes")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines")
    parser.add_argument("--max-engine-load", type=int, default=4, help="each gateway's max_engine_load")
    parser.add_argument("--load", type=float, default=0.9, help="offered load, a share of the fleet's seats")
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per mode")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request streams")
    parser.add_argument("--token-gap-ms", type=float, default=20.0, help="between an engine's tokens")
    parser.add_argument("--sync-interval-s", type=float, default=0.5, help="replica_sync_interval_s")
    parser.add_argument("--push-delay-s", type=float, default=0.002, help="replica_push_delay_s")
    parser.add_argument("--modes", default=",".join(MODES), help="state stores to compare: memory,redis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sessions",
        type=int,
        default=32,
        help="conversations whose turns go through the replicas in turn (prefix-aware routing); 0: none",
    )
    parser.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    parser.add_argument("--out", type=Path, default=Path("results/bench-replicas"))


def bench_replicas_main(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    numbers = (args.load, args.seconds, args.token_gap_ms, args.sync_interval_s)
    if (
        not modes
        or any(m not in MODES for m in modes)
        or not 1 <= args.replicas <= 16
        or not 1 <= args.engines <= 64
        or not 1 <= args.max_engine_load <= 4096
        or not 1 <= args.tokens <= 4096
        or not all(math.isfinite(v) and v > 0 for v in numbers)
        or not 0.01 <= args.sync_interval_s <= 10
        or not 0 <= args.push_delay_s <= 1
        or not (args.sessions == 0 or 2 <= args.sessions <= 1000)
        or not 2 <= args.turns <= 32
    ):
        print(
            "slogate bench replicas: --modes from memory,redis; 1-16 replicas, 1-64 engines, "
            "max_engine_load and tokens 1-4096; --load, --seconds, --token-gap-ms > 0; "
            "--sync-interval-s 0.01-10, --push-delay-s 0-1, --sessions 0 or 2-1000, --turns 2-32",
            file=sys.stderr,
        )
        return 2
    rate = args.load * args.engines * args.max_engine_load / (args.tokens * args.token_gap_ms / 1000)
    if not 10 <= rate * args.seconds <= 200_000:
        print("slogate bench replicas: the run must schedule 10 to 200,000 requests", file=sys.stderr)
        return 2
    try:
        bench = run_replica_bench(
            args.replicas,
            args.engines,
            args.max_engine_load,
            args.load,
            args.seconds,
            args.tokens,
            args.token_gap_ms,
            args.sync_interval_s,
            args.push_delay_s,
            modes,
            args.seed,
            sessions=args.sessions,
            turns=args.turns,
        )
    except RedisUnavailable as exc:
        print(f"slogate bench replicas: {exc}; or --modes memory", file=sys.stderr)
        return 2
    table = render(bench)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "points.json").write_text(json.dumps(asdict(bench), indent=2))
    plot(bench, args.out / "replicas_occupancy.png")
    wrote = [args.out / "table.md", args.out / "points.json", args.out / "replicas_occupancy.png"]
    if plot_sessions(bench, args.out / "replicas_sessions.png"):
        wrote.append(args.out / "replicas_sessions.png")
    print("wrote " + ", ".join(str(w) for w in wrote))
    return 0
