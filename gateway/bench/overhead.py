"""``slogate bench overhead``: what the gateway adds over calling the engine directly.

A zero-latency simulated engine and a single-worker gateway run as child processes; this process
is the load generator (aiohttp, one connection per concurrent client). CPU is read from
``/proc/<pid>/task/*/schedstat`` (nanoseconds on CPU, all threads), so the figures are CPU per
request of the gateway process alone, not wall time of a shared machine.

Measured: gateway CPU per non-streaming request; CPU per relayed SSE event (extra CPU of a
streamed request over a plain one, divided by the events relayed); added p50/p99 latency at
concurrency 1; RPS at concurrency 32; CPU per request at concurrency 256 vs 1; idle RSS. With
``--tracing``, a gateway with tracing off and one with it on (spans made, batched and dropped),
measured alternately: on may add at most a set tolerance over off, and off must meet the untraced
added-latency target (see :class:`TracingCost`).

Then the paced case, on a fresh gateway in front of an engine that spaces tokens 20 ms apart
(what a real engine does, and what the zero-latency engine does not: there, events arrive in
bursts the relay handles in few reads). 200 concurrent streams run at two lengths; the gateway's
CPU per stream grows with the events relayed, and the two points separate the cost per event
(the slope) from the cost per request (the intercept).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from gateway.bench.harness import (
    StreamTrace,
    checks_table,
    cpu_seconds,
    engine_entry,
    idle_rates,
    kernel_seconds,
    median_run,
    paced_profile,
    percentile,
    progress,
    rss_mb,
    spawn_gateway,
    spawn_paced_engine,
    spawn_zero_engine,
    traced_stream,
    wait_until_served,
)
from gateway.procs import ChildProcess, spawn_listening
from gateway.realengines.servers import RunningEngine, start_llamacpp, start_vllm
from gateway.report_json import report_json
from gateway.simulator.cli import positive_int

MODEL = "bench-model"
PACED_MODEL = "bench-paced"


@dataclass
class OverheadResult:
    cpu_ms_per_request: float
    cpu_us_per_sse_event: float
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    added_ttft_p50_ms: float
    rps_c32: float
    cpu_ms_per_request_c1: float
    cpu_ms_per_request_c256: float
    cpu_ratio_c256_vs_c1: float
    idle_rss_mb: float
    stream_tokens: int
    #: connections the client opened while the c=256 CPU was measured (0: a warm pool's figure)
    connections_opened_c256: int = 0
    paced: PacedResult | None = None
    dispatchers: DispatcherLatency | None = None
    tracing: TracingCost | None = None

    def checks(self) -> list[tuple[str, str, str, bool]]:
        """(figure, measured, target, met) rows for the issue's targets."""
        return [
            (
                "CPU per non-streaming request",
                f"{self.cpu_ms_per_request:.3f} ms",
                "<= 1.0 ms",
                self.cpu_ms_per_request <= 1.0,
            ),
            (
                "CPU per relayed SSE event",
                f"{self.cpu_us_per_sse_event:.1f} µs",
                "<= 30 µs",
                self.cpu_us_per_sse_event <= 30.0,
            ),
            ("added latency p50 (c=1)", f"{self.added_p50_ms:.3f} ms", "<= 1 ms", self.added_p50_ms <= 1.0),
            ("added latency p99 (c=1)", f"{self.added_p99_ms:.3f} ms", "<= 3 ms", self.added_p99_ms <= 3.0),
            (
                "added TTFT p50 (c=1)",
                f"{self.added_ttft_p50_ms:.3f} ms",
                "<= 1 ms",
                self.added_ttft_p50_ms <= 1.0,
            ),
            ("RPS at c=32", f"{self.rps_c32:.0f}", "(reported)", True),
            (
                "CPU/request c=256 vs c=1",
                f"{self.cpu_ms_per_request_c256:.3f} / {self.cpu_ms_per_request_c1:.3f} ms "
                f"(x{self.cpu_ratio_c256_vs_c1:.2f})",
                "within 20 %",
                self.cpu_ratio_c256_vs_c1 <= 1.2,
            ),
            ("idle RSS", f"{self.idle_rss_mb:.1f} MB", "<= 150 MB", self.idle_rss_mb <= 150.0),
            *(self.paced.checks() if self.paced else []),
            *(self.dispatchers.checks() if self.dispatchers else []),
            *(self.tracing.checks() if self.tracing else []),
        ]


@dataclass
class DispatcherLatency:
    """Per routing profile, same engine, same gateway build: added p50 latency at concurrency 1
    (an idle engine must take a request at once whatever the dispatcher; HyperFlexis used to wait
    for its next 10 ms tick) and throughput at concurrency 8 in front of a zero-latency engine the
    gateway's default latency prior overestimates (a slow prior must not pace a fast engine)."""

    added_p50_ms: dict[str, float]
    throughput_rps: dict[str, float] = field(default_factory=dict)
    #: the clients of the throughput case, and the engine behind both gateways
    concurrency: int = 8
    engine: str = "zero"
    #: each gateway's own CPU per request in the throughput case (ms)
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)

    def checks(self) -> list[tuple[str, str, str, bool]]:
        base = self.added_p50_ms.get("least-load")
        base_rps = self.throughput_rps.get("least-load")
        rows = []
        for profile, added in self.added_p50_ms.items():
            if profile == "least-load" or base is None:
                continue
            # (the 0.2 ms bar is for the zero-latency engine: a real engine's own jitter between
            # requests is larger than it, so there the difference is reported, not judged)
            judged = self.engine == "zero"
            rows.append(
                (
                    f"{profile} over least-load, added p50 (c=1{'' if judged else ', ' + self.engine})",
                    f"{added - base:+.3f} ms ({added:.3f} vs {base:.3f})",
                    "<= 0.2 ms" if judged else "(reported)",
                    added - base <= 0.2 or not judged,
                )
            )
            rps = self.throughput_rps.get(profile)
            if rps is not None and base_rps:
                rows.append(
                    (
                        f"{profile} throughput vs least-load (c={self.concurrency}, {self.engine} engine, "
                        "default prior)",
                        f"{rps:.0f} vs {base_rps:.0f} req/s ({rps / base_rps:.0%})",
                        ">= 90%",
                        rps >= 0.9 * base_rps,
                    )
                )
            cpu, base_cpu = self.cpu_ms_per_request.get(profile), self.cpu_ms_per_request.get("least-load")
            if cpu is not None and base_cpu is not None:
                rows.append(
                    (
                        f"{profile} gateway CPU per request vs least-load (c={self.concurrency})",
                        f"{cpu:.3f} vs {base_cpu:.3f} ms ({cpu - base_cpu:+.3f})",
                        "(reported)",
                        True,
                    )
                )
        return rows


THROUGHPUT_CONCURRENCY = 8


#: throughput rounds per profile: the profiles alternate round by round, so a busy moment of a
#: shared machine weighs on both alike (run one after the other, least-load alone moved between
#: 2,100 and 3,000 requests/s from run to run here)
THROUGHPUT_ROUNDS = 5


async def _throughput(
    gateways: dict[str, ChildProcess], n: int, model: str, concurrency: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Requests/s of each gateway at ``concurrency`` (``n`` requests each, in alternating rounds),
    and each gateway's own CPU per request (ms) over its rounds: on a machine whose cores the load
    generator, the gateways and the engines share, throughput moves with what else runs, while
    what the gateway spends per request does not."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = LoadGenerator(session, 1, model)
        for gateway in gateways.values():
            await load.run_plain(gateway.url, 50, concurrency)  # warm up
        walls = dict.fromkeys(gateways, 0.0)
        cpu = dict.fromkeys(gateways, 0.0)
        per_round = max(1, n // THROUGHPUT_ROUNDS)
        for _ in range(THROUGHPUT_ROUNDS):
            for profile, gateway in gateways.items():
                c0 = cpu_seconds(gateway.pid)
                _, wall = await load.run_plain(gateway.url, per_round, concurrency)
                cpu[profile] += cpu_seconds(gateway.pid) - c0
                walls[profile] += wall
    total = per_round * THROUGHPUT_ROUNDS
    return (
        {profile: total / wall for profile, wall in walls.items()},
        {profile: 1e3 * spent / total for profile, spent in cpu.items()},
    )


async def _added_p50(
    engines: dict[str, str], gateways: dict[str, ChildProcess], n: int, model: str
) -> dict[str, float]:
    """Each gateway's added p50 at concurrency 1 over its engine (URL), the profiles alternating
    request by request."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = LoadGenerator(session, 1, model)
        for gateway in gateways.values():
            await wait_until_served(session, gateway.url, model, timeout_s=120.0)
            await load.run_plain(gateway.url, 100, 1)
        direct: dict[str, list[float]] = {profile: [] for profile in gateways}
        via: dict[str, list[float]] = {profile: [] for profile in gateways}
        for _ in range(n):
            for profile, gateway in gateways.items():
                direct[profile].append(await load.plain(engines[profile]))
                via[profile].append(await load.plain(gateway.url))
    return {p: statistics.median(via[p]) - statistics.median(direct[p]) for p in gateways}


def run_dispatcher_latency(
    n: int,
    profiles: tuple[str, ...] = ("least-load", "hyperflexis"),
    engine: str | RunningEngine = "zero",
    concurrency: int = THROUGHPUT_CONCURRENCY,
) -> DispatcherLatency:
    """Added p50 at concurrency 1 and throughput at ``concurrency`` for each routing profile,
    each with its own gateway, all running at once and measured alternately. ``engine``:
    ``zero`` gives each gateway a fresh zero-latency simulated engine; ``vllm`` (CPU) or
    ``llamacpp`` puts one real engine with its tiny model behind all of them (the real-engine
    tier's: ``slogate real-engine prepare`` provisions it), or a real engine already running."""
    kind = engine if isinstance(engine, str) else engine.kind
    progress(
        f"dispatcher latency ({kind} engine): {', '.join(profiles)}, {n} requests each at c=1, "
        f"{20 * n} each at c={concurrency}, alternating"
    )
    with ExitStack() as stack:
        if engine == "zero":
            model = MODEL
            zero = {
                p: stack.enter_context(spawn_zero_engine(MODEL, name=f"bench-engine-{p}")) for p in profiles
            }
            urls = {p: e.url for p, e in zero.items()}
            entries = {p: engine_entry(e, MODEL) for p, e in zero.items()}
        else:
            real = stack.enter_context(_real_engine(engine)) if isinstance(engine, str) else engine
            model = real.model
            urls = dict.fromkeys(profiles, real.url)
            entry = {"url": real.url, "kind": real.kind, "model": real.model, "name": real.name}
            entries = dict.fromkeys(profiles, entry)
        gateways = {
            p: stack.enter_context(spawn_gateway([entries[p]], env={"SLOGATE_ROUTING_PROFILE": p}))
            for p in profiles
        }
        added = asyncio.run(_added_p50(urls, gateways, n, model))
        rps, cpu_ms = asyncio.run(_throughput(gateways, 20 * n, model, concurrency))
    return DispatcherLatency({p: ms * 1000 for p, ms in added.items()}, rps, concurrency, kind, cpu_ms)


def _real_engine(kind: str) -> RunningEngine:
    if kind == "vllm":
        return start_vllm("bench-vllm")
    if kind == "llamacpp":
        return start_llamacpp("bench-llamacpp")
    raise ValueError(f"unknown engine {kind!r}: zero, vllm or llamacpp")


#: what tracing on may add over tracing off (ms) before the bench says NO: room for three spans
#: per request made, batched and dropped (tens of µs each in Python), below what per-token span
#: work (64 tokens x 6 µs), an export on the request path or a context leak would cost
TRACING_ON_TOLERANCE_MS = {
    "added p50 (c=1)": 0.3,
    "CPU per plain request": 0.4,
    "CPU per streamed request": 0.4,
}
#: tracing off must meet the gateway's own added-latency target (the main table's p50 row)
TRACING_OFF_ADDED_P50_MS = 1.0


@dataclass
class TracingCost:
    """Tracing off vs on: two fresh gateways in front of one engine, measured alternately at
    concurrency 1 (so both see the same machine), added p50 and each gateway's CPU per plain and
    per streamed request. "on" makes, batches and drops every span (``tracing_exporter: none``):
    the cost of tracing itself, not of an exporter's network I/O.

    What "off costs nothing measurable" can be checked against: off is a few ``is None`` tests
    per request, and this build has no variant without them to compare with, so the off gateway
    is held to the untraced target (added p50 <= 1 ms); the on rows fail past their tolerance."""

    added_p50_ms: dict[str, float]
    cpu_ms_per_request: dict[str, float]
    cpu_ms_per_stream: dict[str, float]

    def checks(self) -> list[tuple[str, str, str, bool]]:
        off_added = self.added_p50_ms["off"]
        rows = [
            (
                "tracing off: added p50 (c=1)",
                f"{off_added:.3f} ms",
                f"<= {TRACING_OFF_ADDED_P50_MS:g} ms (untraced target)",
                off_added <= TRACING_OFF_ADDED_P50_MS,
            )
        ]
        for name, figures in (
            ("added p50 (c=1)", self.added_p50_ms),
            ("CPU per plain request", self.cpu_ms_per_request),
            ("CPU per streamed request", self.cpu_ms_per_stream),
        ):
            off, on = figures["off"], figures["on"]
            tolerance = TRACING_ON_TOLERANCE_MS[name]
            rows.append(
                (
                    f"tracing on vs off: {name}",
                    f"{on - off:+.3f} ms ({on:.3f} vs {off:.3f})",
                    f"<= +{tolerance:g} ms",
                    on - off <= tolerance,
                )
            )
        return rows


TRACING_MODES: dict[str, dict[str, str]] = {
    "off": {},
    "on": {"SLOGATE_TRACING": "true", "SLOGATE_TRACING_EXPORTER": "none"},
}


async def _tracing_case(
    engine: ChildProcess, gateways: dict[str, ChildProcess], n: int, stream_tokens: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per mode: (added p50 s, CPU s per plain request, CPU s per streamed request) at concurrency 1."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = LoadGenerator(session, stream_tokens)
        for gateway in gateways.values():
            await wait_until_served(session, gateway.url, MODEL)
            await load.run_plain(gateway.url, 100, 1)
            for _ in range(10):
                await load.stream(gateway.url)
        direct: dict[str, list[float]] = {mode: [] for mode in gateways}
        via: dict[str, list[float]] = {mode: [] for mode in gateways}
        for _ in range(n):
            # alternate the modes request by request: a busy moment of a shared machine hits both
            for mode, gateway in gateways.items():
                direct[mode].append(await load.plain(engine.url))
                via[mode].append(await load.plain(gateway.url))
        added = {mode: statistics.median(via[mode]) - statistics.median(direct[mode]) for mode in gateways}
        # CPU: each gateway's own (schedstat) over a phase where the modes again alternate, so
        # a load that changes over the run weighs on both alike; a phase covers each gateway's
        # work after its last byte too (the request span ends then)
        streams = max(20, n // 4)

        async def phase(rounds: int, one: Callable[[str], Awaitable[object]]) -> dict[str, float]:
            start = {mode: cpu_seconds(gateway.pid) for mode, gateway in gateways.items()}
            for _ in range(rounds):
                for gateway in gateways.values():
                    await one(gateway.url)
            return {mode: (cpu_seconds(g.pid) - start[mode]) / rounds for mode, g in gateways.items()}

        per_request = await phase(n, load.plain)
        per_stream = await phase(streams, load.stream)
    return added, per_request, per_stream


def run_tracing_cost(n: int, stream_tokens: int) -> TracingCost:
    progress(
        f"tracing off and on: {n} requests each at c=1, alternating, then {max(20, n // 4)} streams each"
    )
    with (
        spawn_zero_engine(MODEL) as engine,
        spawn_gateway([engine_entry(engine, MODEL)], env=TRACING_MODES["off"]) as off,
        spawn_gateway([engine_entry(engine, MODEL)], env=TRACING_MODES["on"]) as on,
    ):
        added, cpu, cpu_stream = asyncio.run(_tracing_case(engine, {"off": off, "on": on}, n, stream_tokens))

    def ms(figures: dict[str, float]) -> dict[str, float]:
        return {mode: value * 1e3 for mode, value in figures.items()}

    return TracingCost(ms(added), ms(cpu), ms(cpu_stream))


@dataclass
class PacedResult:
    """Gateway CPU relaying ``streams`` concurrent streams whose tokens come ``token_gap_ms`` apart."""

    streams: int
    token_gap_ms: float
    #: the two stream lengths (tokens) and, for each, events relayed and gateway CPU per stream
    tokens: tuple[int, int]
    events_per_stream: tuple[float, float]
    cpu_ms_per_stream: tuple[float, float]
    #: slope: extra CPU per extra event relayed
    cpu_us_per_sse_event: float
    #: intercept: CPU of a streamed request less its events (parse, dispatch, connect, accounting)
    cpu_ms_per_request: float
    #: largest gap between two chunks of one stream (the engine's pacing plus every delay)
    max_gap_ms: float
    #: the gateway's CPU with no request (monitor scrapes), subtracted from the figures above
    idle_cpu_ms_per_s: float
    #: the same measurement through a bare relay on the same stack (gateway.bench.relay_floor)
    floor: PacedResult | None = None
    #: CPU per event of every repeat (this result is the median one's)
    runs_us_per_event: tuple[float, ...] = ()
    #: the part of ``cpu_us_per_sse_event`` spent in the kernel (the socket read and write and
    #: the epoll wake of each event), from /proc's clock ticks
    kernel_us_per_sse_event: float = 0.0
    #: connections the client opened to the gateway during the measured waves: 0 when the warm-up
    #: opened every one they use (otherwise each one's set-up is counted as per-request CPU). The
    #: gateway's own to the engine are not seen from here: they follow the same waves
    connections_opened: int = 0

    def checks(self) -> list[tuple[str, str, str, bool]]:
        where = f"{self.streams} streams, {self.token_gap_ms:g} ms apart"
        floor = self.floor
        return [
            (
                f"paced: CPU per relayed SSE event ({where})",
                f"{self.cpu_us_per_sse_event:.1f} µs",
                "<= 20 µs",
                self.cpu_us_per_sse_event <= 20.0,
            ),
            (
                "paced: of the CPU per event, in the kernel (socket read and write, epoll)",
                f"{self.kernel_us_per_sse_event:.1f} µs",
                "(reported)",
                True,
            ),
            (
                "paced: CPU per streamed request, events aside",
                f"{self.cpu_ms_per_request:.3f} ms",
                "<= 0.5 ms",
                self.cpu_ms_per_request <= 0.5,
            ),
            (
                "paced: CPU per whole stream (short / long)",
                f"{self.cpu_ms_per_stream[0]:.2f} / {self.cpu_ms_per_stream[1]:.2f} ms "
                f"({self.events_per_stream[0]:.0f} / {self.events_per_stream[1]:.0f} events)",
                "(reported)",
                True,
            ),
            *(
                [
                    (
                        "paced: a bare relay on the same stack, per event (in the kernel) / per stream",
                        f"{floor.cpu_us_per_sse_event:.1f} µs ({floor.kernel_us_per_sse_event:.1f}) "
                        f"/ {floor.cpu_ms_per_request:.3f} ms",
                        "(the floor)",
                        True,
                    ),
                    (
                        "paced: the gateway's own code per event (above the floor)",
                        f"{self.cpu_us_per_sse_event - floor.cpu_us_per_sse_event:.1f} µs",
                        "(reported)",
                        True,
                    ),
                ]
                if floor is not None
                else []
            ),
        ]


class LoadGenerator:
    def __init__(self, session: aiohttp.ClientSession, stream_tokens: int, model: str = MODEL) -> None:
        self.session = session
        self.plain_body = orjson.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                "max_tokens": 1,
            }
        )
        self.stream_body = orjson.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                "max_tokens": stream_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )
        self.headers = {"Content-Type": "application/json", "X-Sim-Output-Len": str(stream_tokens)}

    async def plain(self, base: str) -> float:
        t0 = time.perf_counter()
        async with self.session.post(
            base + "/v1/chat/completions", data=self.plain_body, headers=self.headers
        ) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{base}: HTTP {r.status}")
        return time.perf_counter() - t0

    async def stream(self, base: str) -> tuple[float, float, int]:
        """(TTFT, total, events) of one streamed request."""
        t0 = time.perf_counter()
        ttft = 0.0
        events = 0
        async with self.session.post(
            base + "/v1/chat/completions", data=self.stream_body, headers=self.headers
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"{base}: HTTP {r.status}")
            async for chunk in r.content.iter_any():
                if not ttft:
                    ttft = time.perf_counter() - t0
                events += chunk.count(b"\n\n")
        return ttft, time.perf_counter() - t0, events

    async def run_plain(self, base: str, total: int, concurrency: int) -> tuple[list[float], float]:
        """``total`` plain requests from ``concurrency`` clients; (latencies, wall seconds)."""
        latencies: list[float] = []
        remaining = total

        async def client() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                latencies.append(await self.plain(base))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


class _ConnectionsOpened:
    """Counts the connections a client session opens (``trace`` goes to the session): a figure
    measured on a warm pool must open none, or their set-up is counted in it."""

    def __init__(self) -> None:
        self.count = 0
        self.trace = aiohttp.TraceConfig()
        self.trace.on_connection_create_end.append(self._opened)

    async def _opened(self, *_: object) -> None:
        self.count += 1


async def _measure(engine: ChildProcess, gateway: ChildProcess, n: int, stream_tokens: int) -> OverheadResult:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    opened = _ConnectionsOpened()
    async with aiohttp.ClientSession(connector=connector, trace_configs=[opened.trace]) as session:
        load = LoadGenerator(session, stream_tokens)
        gw_pid = gateway.pid
        idle_rss = rss_mb(gw_pid)

        progress("warm-up")
        await load.run_plain(engine.url, 50, 4)
        await load.run_plain(gateway.url, 200, 4)
        for _ in range(20):
            await load.stream(gateway.url)

        progress(f"latency at c=1: {n} direct, {n} through the gateway (interleaved)")
        direct: list[float] = []
        via: list[float] = []
        for _ in range(n):
            direct.append(await load.plain(engine.url))
            via.append(await load.plain(gateway.url))

        progress(f"CPU per plain request at c=1 ({n} requests)")
        c0 = cpu_seconds(gw_pid)
        await load.run_plain(gateway.url, n, 1)
        cpu_c1 = (cpu_seconds(gw_pid) - c0) / n

        streams = max(20, n // 4)
        progress(f"streams: {streams} x {stream_tokens} tokens, TTFT direct vs gateway")
        ttft_direct: list[float] = []
        ttft_via: list[float] = []
        for _ in range(min(streams, 200)):
            ttft_direct.append((await load.stream(engine.url))[0])
            ttft_via.append((await load.stream(gateway.url))[0])
        c0 = cpu_seconds(gw_pid)
        events = 0
        for _ in range(streams):
            events += (await load.stream(gateway.url))[2]
        cpu_stream = (cpu_seconds(gw_pid) - c0) / streams
        per_event = max(0.0, cpu_stream - cpu_c1) / (events / streams)

        progress(f"RPS at c=32 ({n * 2} requests)")
        _, wall = await load.run_plain(gateway.url, n * 2, 32)
        rps = n * 2 / wall

        progress(f"CPU per request at c=256 ({n * 2} requests)")
        # (its connections opened first: the figure is a warm pool's, as the c=1 one is)
        await load.run_plain(gateway.url, 256, 256)
        opened_before = opened.count
        c0 = cpu_seconds(gw_pid)
        await load.run_plain(gateway.url, n * 2, 256)
        cpu_c256 = (cpu_seconds(gw_pid) - c0) / (n * 2)
        opened_c256 = opened.count - opened_before

    d50, d99 = percentile(direct, 0.5), percentile(direct, 0.99)
    g50, g99 = percentile(via, 0.5), percentile(via, 0.99)
    return OverheadResult(
        cpu_ms_per_request=cpu_c1 * 1e3,
        cpu_us_per_sse_event=per_event * 1e6,
        direct_p50_ms=d50 * 1e3,
        direct_p99_ms=d99 * 1e3,
        gateway_p50_ms=g50 * 1e3,
        gateway_p99_ms=g99 * 1e3,
        added_p50_ms=(g50 - d50) * 1e3,
        added_p99_ms=(g99 - d99) * 1e3,
        added_ttft_p50_ms=(statistics.median(ttft_via) - statistics.median(ttft_direct)) * 1e3,
        rps_c32=rps,
        cpu_ms_per_request_c1=cpu_c1 * 1e3,
        cpu_ms_per_request_c256=cpu_c256 * 1e3,
        cpu_ratio_c256_vs_c1=cpu_c256 / cpu_c1 if cpu_c1 else float("inf"),
        connections_opened_c256=opened_c256,
        idle_rss_mb=idle_rss,
        stream_tokens=stream_tokens,
    )


async def _measure_paced(
    gateway: ChildProcess,
    model: str,
    streams: int,
    gap_ms: float,
    tokens: tuple[int, int],
    waves: int,
    idle_s: float = 1.0,
) -> PacedResult:
    connector = aiohttp.TCPConnector(limit=0)
    opened = _ConnectionsOpened()
    async with aiohttp.ClientSession(connector=connector, trace_configs=[opened.trace]) as session:
        url = gateway.url + "/v1/chat/completions"
        await wait_until_served(session, gateway.url, model)

        def request(length: int) -> tuple[bytes, dict[str, str]]:
            body = orjson.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                    "max_tokens": length,
                    "ignore_eos": True,
                    "stream": True,
                }
            )
            return body, {"Content-Type": "application/json", "X-Sim-Output-Len": str(length)}

        # a wave as wide as the measured ones, right before them (the gateway's pool keeps an
        # idle connection 4 s): every connection the waves use (client to relay, relay to engine)
        # is open and pooled before the meter starts. Warmed by 20 streams, the first measured
        # wave opened the other 180 of each, and that one-off cost (about 0.1 ms per short
        # stream) was counted as per-request CPU and taken off the per-event slope
        progress(f"paced: warm-up, {min(streams, 20)} streams, the gateway at rest, a wave of {streams}")
        body, headers = request(tokens[0])
        # (first requests pay one-off costs; then the settled gateway's CPU at rest)
        await asyncio.gather(*(traced_stream(session, url, body, headers) for _ in range(min(streams, 20))))
        idle, idle_kernel = await idle_rates(gateway.pid, idle_s)
        await asyncio.gather(*(traced_stream(session, url, body, headers) for _ in range(streams)))

        opened_before = opened.count
        cpu = [0.0, 0.0]
        kernel = [0.0, 0.0]
        traces: list[list[StreamTrace]] = [[], []]
        progress(f"paced: {waves} x 2 waves of {streams} streams, {tokens[0]} and {tokens[1]} tokens")
        # short and long waves alternate, so a drift in the machine's speed (this VM's moves by
        # +-20 % over minutes) weighs on both lengths alike instead of on the slope between them
        for _ in range(waves):
            for i, length in enumerate(tokens):
                body, headers = request(length)
                c0, k0, t0 = cpu_seconds(gateway.pid), kernel_seconds(gateway.pid), time.perf_counter()
                traces[i] += await asyncio.gather(
                    *(traced_stream(session, url, body, headers) for _ in range(streams))
                )
                elapsed = time.perf_counter() - t0
                cpu[i] += cpu_seconds(gateway.pid) - c0 - idle * elapsed
                kernel[i] += kernel_seconds(gateway.pid) - k0 - idle_kernel * elapsed
        cpu_per_stream = [cpu[i] / len(traces[i]) for i in (0, 1)]
        events_per_stream = [sum(t.events for t in traces[i]) / len(traces[i]) for i in (0, 1)]
        max_gap = max((g for wave in traces for t in wave for _, g in t.gaps()), default=0.0)
        opened_measured = opened.count - opened_before

    more_events = events_per_stream[1] - events_per_stream[0]
    per_event = (cpu_per_stream[1] - cpu_per_stream[0]) / more_events
    kernel_per_event = (kernel[1] / len(traces[1]) - kernel[0] / len(traces[0])) / more_events
    return PacedResult(
        streams=streams,
        token_gap_ms=gap_ms,
        tokens=tokens,
        events_per_stream=(events_per_stream[0], events_per_stream[1]),
        cpu_ms_per_stream=(cpu_per_stream[0] * 1e3, cpu_per_stream[1] * 1e3),
        cpu_us_per_sse_event=per_event * 1e6,
        cpu_ms_per_request=(cpu_per_stream[0] - per_event * events_per_stream[0]) * 1e3,
        max_gap_ms=max_gap * 1e3,
        idle_cpu_ms_per_s=idle * 1e3,
        kernel_us_per_sse_event=kernel_per_event * 1e6,
        connections_opened=opened_measured,
    )


def run_paced(
    streams: int = 200,
    gap_ms: float = 20.0,
    tokens: tuple[int, int] = (16, 64),
    waves: int = 2,
    floor: bool = False,
    repeats: int = 1,
    idle_s: float = 1.0,
) -> PacedResult:
    """A paced engine and a fresh gateway; gateway CPU per event and per request; with ``floor``,
    the same through a bare relay on the same stack, in front of the same engine. ``repeats``
    times, the gateway's and the floor's measurements alternating; the median run of each is
    returned (one run's figures, not a mix). ``idle_s``: how long each run first reads the idle
    process's CPU (subtracted from its waves). Blocking."""
    if not 0 < tokens[0] < tokens[1]:
        raise ValueError(f"paced stream lengths must be two increasing token counts, got {tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    progress(f"starting an engine pacing tokens {gap_ms:g} ms apart and a single-worker gateway")
    with tempfile.TemporaryDirectory(prefix="slogate-bench-") as tmp:
        profile = paced_profile(Path(tmp), gap_ms / 1e3)
        with ExitStack() as stack:
            engine = stack.enter_context(spawn_paced_engine(PACED_MODEL, profile))
            gateway = stack.enter_context(spawn_gateway([engine_entry(engine, PACED_MODEL)]))
            relay = None
            if floor:
                command = [sys.executable, "-m", "gateway.bench.relay_floor", engine.url]
                relay = stack.enter_context(spawn_listening(command, "relay-floor"))
            runs: list[PacedResult] = []
            floors: list[PacedResult] = []
            for i in range(repeats):
                progress(f"paced: the gateway (run {i + 1} of {repeats})")
                runs.append(
                    asyncio.run(_measure_paced(gateway, PACED_MODEL, streams, gap_ms, tokens, waves, idle_s))
                )
                if relay is not None:
                    progress(f"paced: a bare relay on the same stack (run {i + 1} of {repeats})")
                    floors.append(
                        asyncio.run(
                            _measure_paced(relay, PACED_MODEL, streams, gap_ms, tokens, waves, idle_s)
                        )
                    )
            result = _median_run(runs)
            if floors:
                result.floor = _median_run(floors)
            return result


def _median_run(runs: list[PacedResult]) -> PacedResult:
    """The run with the median CPU per event (the higher middle of an even count), with every
    run's figure in ``runs_us_per_event``."""
    median = median_run(runs, lambda r: r.cpu_us_per_sse_event)
    median.runs_us_per_event = tuple(r.cpu_us_per_sse_event for r in runs)
    return median


def run_overhead(
    n: int = 2000,
    stream_tokens: int = 64,
    paced_streams: int = 200,
    paced_gap_ms: float = 20.0,
    paced_tokens: tuple[int, int] = (16, 64),
    paced_waves: int = 2,
    dispatchers: bool = True,
    tracing: bool = False,
    paced_floor: bool = False,
    paced_repeats: int = 3,
    paced_idle_s: float = 1.0,
    dispatcher_requests: int = 50,
) -> OverheadResult:
    """Start the engine and the gateway, measure, stop both; then the paced case on a fresh pair
    (``paced_streams=0`` skips it). Blocking."""
    progress("starting a zero-latency simulated engine and a single-worker gateway")
    with spawn_zero_engine(MODEL) as engine, spawn_gateway([engine_entry(engine, MODEL)]) as gateway:
        result = asyncio.run(_measure(engine, gateway, n, stream_tokens))
    if paced_streams > 0:
        result.paced = run_paced(
            paced_streams, paced_gap_ms, paced_tokens, paced_waves, paced_floor, paced_repeats, paced_idle_s
        )
    if dispatchers:
        result.dispatchers = run_dispatcher_latency(max(dispatcher_requests, n // 2))
    if tracing:
        result.tracing = run_tracing_cost(max(50, n // 2), stream_tokens)
    return result


def render_table(result: OverheadResult) -> str:
    lines = checks_table(result.checks())
    lines.append(
        f"(direct p50/p99 {result.direct_p50_ms:.3f}/{result.direct_p99_ms:.3f} ms, "
        f"gateway p50/p99 {result.gateway_p50_ms:.3f}/{result.gateway_p99_ms:.3f} ms; "
        f"streams of {result.stream_tokens} tokens; connections opened while the c=256 CPU was "
        f"measured: {result.connections_opened_c256})"
    )
    if result.tracing:
        lines.append(
            "(tracing off is a few `is None` tests per request; with no build without them to compare "
            "against, the off gateway is held to the untraced target, and on to a tolerance over off)"
        )
    if result.paced:
        paced = result.paced
        lines.append(
            f"(paced: streams of {paced.tokens[0]} and {paced.tokens[1]} tokens; largest gap between "
            f"chunks {paced.max_gap_ms:.1f} ms"
            + (f", the bare relay's {paced.floor.max_gap_ms:.1f} ms" if paced.floor is not None else "")
            + f"; idle gateway CPU {paced.idle_cpu_ms_per_s:.2f} ms/s subtracted; connections opened "
            f"while measured: {paced.connections_opened}, after a warm-up wave as wide as the others)"
        )
        if len(paced.runs_us_per_event) > 1:
            floor = paced.floor.runs_us_per_event if paced.floor is not None else ()
            lines.append(
                "(paced, CPU per event of each run, the median above: gateway "
                + " / ".join(f"{v:.1f}" for v in paced.runs_us_per_event)
                + (" µs; the floor " + " / ".join(f"{v:.1f}" for v in floor) + " µs)" if floor else " µs)")
            )
    return "\n".join(lines)


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default 2000)")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument(
        "--paced-streams", type=int, default=200, help="concurrent streams of the paced case (0 skips it)"
    )
    parser.add_argument(
        "--paced-gap-ms", type=float, default=20.0, help="ms between tokens in the paced case"
    )
    parser.add_argument(
        "--paced-tokens",
        type=_two_lengths,
        default=(16, 64),
        help="the paced case's two stream lengths, e.g. 16,64",
    )
    parser.add_argument("--paced-waves", type=int, default=2, help="waves of streams per paced length")
    parser.add_argument(
        "--paced-repeats",
        type=positive_int,
        default=3,
        help="paced measurements (each with the floor's, alternating); the median is reported",
    )
    parser.add_argument(
        "--paced-floor",
        action="store_true",
        help="also run the paced case through a bare relay on the same stack (the per-event floor)",
    )
    parser.add_argument(
        "--no-dispatchers",
        action="store_true",
        help="skip comparing added latency at c=1 under least-load and hyperflexis",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also compare tracing off vs on (spans made and dropped) on fresh gateways: added p50 and "
        "CPU per plain and streamed request at c=1",
    )


def _two_lengths(value: str) -> tuple[int, int]:
    try:
        short, long = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two token counts like 16,64, got {value!r}") from None
    if not 0 < short < long:
        raise argparse.ArgumentTypeError(f"expected 0 < short < long, got {value!r}")
    return short, long


def bench_overhead_main(args: argparse.Namespace) -> int:
    result = run_overhead(
        args.requests,
        args.stream_tokens,
        args.paced_streams,
        args.paced_gap_ms,
        args.paced_tokens,
        args.paced_waves,
        not args.no_dispatchers,
        args.tracing,
        args.paced_floor,
        args.paced_repeats,
    )
    print(render_table(result))
    if args.json:
        args.json.write_text(report_json(asdict(result), indent=2))
    return 0


def add_dispatchers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=["zero", "vllm", "llamacpp"],
        default="zero",
        help="zero: a zero-latency simulated engine per gateway; vllm (CPU) / llamacpp: one real "
        "engine with its tiny model behind every gateway (slogate real-engine prepare)",
    )
    parser.add_argument(
        "--profiles", default="least-load,hyperflexis", help="routing profiles, comma-separated"
    )
    parser.add_argument(
        "--requests", type=positive_int, default=200, help="requests at c=1 (20x as many at c=N)"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=THROUGHPUT_CONCURRENCY,
        help="clients of the throughput case",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")


def bench_dispatchers_main(args: argparse.Namespace) -> int:
    profiles = tuple(p for p in args.profiles.split(",") if p)
    if "least-load" not in profiles:
        raise SystemExit("slogate bench dispatchers: --profiles must include least-load (the reference)")
    result = run_dispatcher_latency(args.requests, profiles, args.engine, args.concurrency)
    print("\n".join(checks_table(result.checks())))
    for profile in profiles:
        print(
            f"{profile}: added p50 {result.added_p50_ms[profile]:.3f} ms (c=1), "
            f"{result.throughput_rps[profile]:.0f} requests/s (c={args.concurrency}), "
            f"gateway CPU {result.cpu_ms_per_request[profile]:.3f} ms per request there"
        )
    if args.json:
        args.json.write_text(report_json(asdict(result), indent=2))
    return 0
