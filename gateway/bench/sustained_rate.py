"""``slogate bench rate``: added latency under a sustained request rate, over time.

A complaint users make of Python proxies in front of LLM engines is that their latency climbs to
seconds at modest request rates: work or memory that grows with what has been served, a queue
that builds up inside the proxy. The overhead benchmark measures one request at a time and
closed-loop concurrency; this one sends open-loop arrivals (Poisson, at a fixed rate, whatever the
answers do) for a while, first straight to a zero-latency simulated engine, then through a gateway
in front of it on the same arrival schedule, and compares the two window by window.

Reported per rate: whether the client kept its schedule, errors, added latency p50 / p99, the
median and p99 through the gateway over the run's first and second halves (the second half's
median must not be worse than the first's: latency that climbs shows there), the gateway's CPU per
request at that rate and its resident memory before and after.
A plot shows p50 and p99 per window, direct and through the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from gateway.bench.harness import (
    checks_table,
    cpu_seconds,
    engine_entry,
    idle_cpu_rate,
    percentile,
    progress,
    rss_mb,
    spawn_gateway,
    spawn_zero_engine,
)
from gateway.procs import ChildProcess
from gateway.report_json import report_json

MODEL = "bench-rate"
#: how much worse the second half's median through the gateway may be than the first's before its
#: latency "climbs": this share of the first half's, and at least this many ms. Judged on the
#: median: a latency that grows with what the proxy has served moves all of it, while the p99 of a
#: half moves by several milliseconds with one episode of the machine's noise (at 300/s one run in
#: four had three windows at 13-33 ms, in the engine-alone run as much); the p99s are reported.
CLIMB_RATIO = 0.5
CLIMB_SLACK_MS = 1.0
#: the client kept its schedule when its sends were at most this late (p99, ms); later, it sent
#: bursts and the run says nothing of the rate
SEND_LAG_MS = 10.0
#: a request not answered within this long counts as an error (the run goes on)
REQUEST_TIMEOUT_S = 30.0
#: requests a rate's run may schedule (rate x seconds)
MIN_REQUESTS = 20
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True, slots=True)
class Sample:
    #: seconds from the phase's start at which the request was due (its scheduled moment)
    sent_s: float
    latency_s: float
    ok: bool


@dataclass
class Window:
    start_s: float
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float


@dataclass
class RatePoint:
    rate: float
    seconds: float
    #: the schedule's own rate (a Poisson sample of ``rate``)
    offered_rate: float
    requests: int
    #: requests through the gateway not answered 200 (or not at all within REQUEST_TIMEOUT_S)
    errors: int
    #: the same, straight to the engine (the reference run is void if it has any)
    direct_errors: int
    added_p50_ms: float
    added_p99_ms: float
    #: the median and p99 through the gateway over the run's first and second halves
    first_half_p50_ms: float
    second_half_p50_ms: float
    first_half_p99_ms: float
    second_half_p99_ms: float
    #: the gateway's CPU while the run lasted, less what it spends idle (its monitor), per request
    cpu_ms_per_request: float
    rss_before_mb: float
    rss_after_mb: float
    #: the client's lateness against its own schedule (p99, ms): a loaded machine's client that
    #: falls behind sends bursts, not the rate
    send_lag_p99_ms: float
    windows: list[Window] = field(default_factory=list)

    @property
    def climbs(self) -> bool:
        """Whether the median rose from the first half to the second (also when a half has no
        answered request to tell by: NaN)."""
        if not (math.isfinite(self.first_half_p50_ms) and math.isfinite(self.second_half_p50_ms)):
            return True
        allowed = self.first_half_p50_ms * (1 + CLIMB_RATIO)
        return self.second_half_p50_ms > max(allowed, self.first_half_p50_ms + CLIMB_SLACK_MS)

    def checks(self) -> list[tuple[str, str, str, bool]]:
        at = f" at {self.rate:g}/s"
        return [
            (
                f"the client kept its schedule{at}",
                f"{self.offered_rate:.1f}/s offered, sends late by {self.send_lag_p99_ms:.1f} ms (p99)",
                f"<= {SEND_LAG_MS:g} ms",
                self.send_lag_p99_ms <= SEND_LAG_MS,
            ),
            (
                f"errors{at}",
                f"{self.errors} (engine alone: {self.direct_errors})",
                "0",
                self.errors == 0 and self.direct_errors == 0,
            ),
            (
                f"p50 through the gateway, second half vs first{at}",
                f"{self.second_half_p50_ms:.2f} vs {self.first_half_p50_ms:.2f} ms",
                f"no more than +{CLIMB_RATIO:.0%} (or +{CLIMB_SLACK_MS:g} ms)",
                not self.climbs,
            ),
            (
                f"p99 through the gateway, second half vs first{at}",
                f"{self.second_half_p99_ms:.2f} vs {self.first_half_p99_ms:.2f} ms",
                "(reported)",
                True,
            ),
            (
                f"added p50 / p99{at}",
                f"{self.added_p50_ms:.2f} / {self.added_p99_ms:.2f} ms",
                "(reported)",
                True,
            ),
            (f"gateway CPU per request{at}", f"{self.cpu_ms_per_request:.3f} ms", "(reported)", True),
            (
                f"gateway memory{at}",
                f"{self.rss_before_mb:.0f} -> {self.rss_after_mb:.0f} MB",
                "(reported)",
                True,
            ),
        ]


def schedule(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) at ``rate`` per second for ``seconds``."""
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _phase(
    session: aiohttp.ClientSession, url: str, body: bytes, times: list[float]
) -> tuple[list[Sample], list[float]]:
    """Send one request at each of ``times`` (open loop) to ``url``; the samples and how late the
    client sent each one. Latency is timed from the scheduled moment, not from when the client got
    round to sending: a client that falls behind must not hide the wait it caused."""
    samples: list[Sample] = []
    lags: list[float] = []
    headers = {"Content-Type": "application/json"}
    start = time.perf_counter()

    async def one(at: float) -> None:
        lags.append(max(0.0, time.perf_counter() - start - at))
        ok = False
        try:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            pass  # (an error sample: the run goes on)
        samples.append(Sample(at, time.perf_counter() - start - at, ok))

    tasks: list[asyncio.Task[None]] = []
    for at in times:
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    return samples, lags


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3 if values else float("nan")


def _windows(direct: list[Sample], via: list[Sample], seconds: float, width: float) -> list[Window]:
    windows = []
    start = 0.0
    while start < seconds:
        d = [s.latency_s for s in direct if start <= s.sent_s < start + width and s.ok]
        g = [s.latency_s for s in via if start <= s.sent_s < start + width and s.ok]
        if d and g:
            windows.append(Window(start, _ms(d, 0.5), _ms(d, 0.99), _ms(g, 0.5), _ms(g, 0.99)))
        start += width
    return windows


async def _measure(
    engine: ChildProcess, gateway: ChildProcess, rate: float, seconds: float, window_s: float, seed: int
) -> RatePoint:
    message = {"role": "user", "content": "Say hello to the rate benchmark."}
    body = orjson.dumps({"model": MODEL, "messages": [message], "max_tokens": 8})
    times = schedule(rate, seconds, seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # warm-up: both pools opened about as wide as the rate will need
        warm = schedule(rate, min(2.0, seconds), seed + 1)
        await _phase(session, engine.url + "/v1/chat/completions", body, warm)
        await _phase(session, gateway.url + "/v1/chat/completions", body, warm)
        progress(f"rate {rate:g}/s: {len(times)} requests straight to the engine over {seconds:g} s")
        direct, _ = await _phase(session, engine.url + "/v1/chat/completions", body, times)
        progress(f"rate {rate:g}/s: the same schedule through the gateway")
        idle = await idle_cpu_rate(gateway.pid)
        rss_before = rss_mb(gateway.pid)
        c0 = cpu_seconds(gateway.pid)
        t0 = time.perf_counter()
        via, lags = await _phase(session, gateway.url + "/v1/chat/completions", body, times)
        elapsed = time.perf_counter() - t0
        cpu = max(0.0, cpu_seconds(gateway.pid) - c0 - idle * elapsed)
        rss_after = rss_mb(gateway.pid)

    def ok(samples: list[Sample], lo: float, hi: float) -> list[float]:
        return [s.latency_s for s in samples if lo <= s.sent_s < hi and s.ok]

    def added(q: float) -> float:
        return _ms(ok(via, 0.0, seconds), q) - _ms(ok(direct, 0.0, seconds), q)

    half = seconds / 2
    return RatePoint(
        rate=rate,
        seconds=seconds,
        offered_rate=len(times) / seconds,
        requests=len(via),
        errors=sum(not s.ok for s in via),
        direct_errors=sum(not s.ok for s in direct),
        added_p50_ms=added(0.5),
        added_p99_ms=added(0.99),
        first_half_p50_ms=_ms(ok(via, 0.0, half), 0.5),
        second_half_p50_ms=_ms(ok(via, half, seconds), 0.5),
        first_half_p99_ms=_ms(ok(via, 0.0, half), 0.99),
        second_half_p99_ms=_ms(ok(via, half, seconds), 0.99),
        cpu_ms_per_request=cpu / max(1, len(via)) * 1e3,
        rss_before_mb=rss_before,
        rss_after_mb=rss_after,
        send_lag_p99_ms=percentile(lags, 0.99) * 1e3 if lags else 0.0,
        windows=_windows(direct, via, seconds, window_s),
    )


def run_rate_bench(
    rates: list[float],
    seconds: float = 20.0,
    window_s: float = 2.0,
    seed: int = 0,
    report: Callable[[str], None] = progress,
) -> list[RatePoint]:
    """Each rate against a fresh zero-latency engine and a fresh single-worker gateway. Blocking."""
    points = []
    for i, rate in enumerate(rates):
        report(f"[{i + 1}/{len(rates)}] starting a zero-latency engine and a gateway for {rate:g}/s")
        with spawn_zero_engine(MODEL) as engine, spawn_gateway([engine_entry(engine, MODEL)]) as gateway:
            point = asyncio.run(_measure(engine, gateway, rate, seconds, window_s, seed + i))
        report(
            f"[{i + 1}/{len(rates)}] {rate:g}/s: added p50/p99 "
            f"{point.added_p50_ms:.2f}/{point.added_p99_ms:.2f} ms, gateway p50 by half "
            f"{point.first_half_p50_ms:.2f} -> {point.second_half_p50_ms:.2f} ms, "
            f"{point.errors} errors"
        )
        points.append(point)
    return points


def plot(points: list[RatePoint], path: Path) -> None:
    from gateway.experiments.plotting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(points), figsize=(5.5 * len(points), 4), squeeze=False)
    for ax, point in zip(axes[0], points, strict=True):
        xs = [w.start_s for w in point.windows]
        for side, color in (("direct", "tab:blue"), ("gateway", "tab:orange")):
            name = "engine" if side == "direct" else "gateway"
            p50 = [getattr(w, f"{side}_p50_ms") for w in point.windows]
            p99 = [getattr(w, f"{side}_p99_ms") for w in point.windows]
            ax.plot(xs, p50, color=color, label=f"{name} p50")
            ax.plot(xs, p99, color=color, linestyle="--", label=f"{name} p99")
        ax.set_title(f"{point.rate:g} requests/s (open loop)")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(points: list[RatePoint]) -> str:
    lines = checks_table([row for p in points for row in p.checks()])
    for p in points:
        lines.append(
            f"({p.rate:g}/s: {p.requests} requests over {p.seconds:g} s, the gateway's idle CPU "
            "subtracted; plot: latency per window, straight to the engine and through the gateway)"
        )
    return "\n".join(lines)


def add_rate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="100,300", help="requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per rate and side")
    parser.add_argument("--window-s", type=float, default=2.0, help="width of the plot's windows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/bench-rate"))


def bench_rate_main(args: argparse.Namespace) -> int:
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        print(f"slogate bench rate: --rates takes numbers like 100,300, got {args.rates!r}", file=sys.stderr)
        return 2
    finite = all(math.isfinite(v) for v in (*rates, args.seconds, args.window_s))
    if (
        not rates
        or not finite
        or min(rates) <= 0
        or args.seconds <= 0
        or not 0.1 <= args.window_s <= args.seconds
    ):
        print(
            "slogate bench rate: rates and --seconds must be finite and > 0, --window-s between 0.1 "
            "and --seconds",
            file=sys.stderr,
        )
        return 2
    # (a run of a handful of requests says nothing; one of millions would hold them all at once)
    if not all(MIN_REQUESTS <= rate * args.seconds <= MAX_REQUESTS for rate in rates):
        print(
            f"slogate bench rate: each rate x --seconds must be {MIN_REQUESTS} to {MAX_REQUESTS:,} requests",
            file=sys.stderr,
        )
        return 2
    points = run_rate_bench(rates, args.seconds, args.window_s, args.seed)
    table = render(points)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "points.json").write_text(report_json([asdict(p) for p in points], indent=2))
    plot(points, args.out / "rate_latency.png")
    print(f"wrote {args.out / 'table.md'}, {args.out / 'points.json'}, {args.out / 'rate_latency.png'}")
    return 0
