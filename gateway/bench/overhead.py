"""``slogate bench overhead``: what the gateway adds over calling the engine directly.

A zero-latency simulated engine and a single-worker gateway run as child processes; this process
is the load generator (aiohttp, one connection per concurrent client). CPU is read from
``/proc/<pid>/task/*/schedstat`` (nanoseconds on CPU, all threads), so the figures are CPU per
request of the gateway process alone, not wall time of a shared machine.

Measured: gateway CPU per non-streaming request; CPU per relayed SSE event (extra CPU of a
streamed request over a plain one, divided by the events relayed); added p50/p99 latency at
concurrency 1; RPS at concurrency 32; CPU per request at concurrency 256 vs 1; idle RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson

from gateway.procs import ChildProcess, spawn_listening, spawn_sim_engine

MODEL = "bench-model"


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
        ]


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` in seconds (ns resolution, unlike /proc/pid/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # thread exited between listing and reading
    return total / 1e9


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class LoadGenerator:
    def __init__(self, session: aiohttp.ClientSession, stream_tokens: int) -> None:
        self.session = session
        self.plain_body = orjson.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                "max_tokens": 1,
            }
        )
        self.stream_body = orjson.dumps(
            {
                "model": MODEL,
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


async def _measure(engine: ChildProcess, gateway: ChildProcess, n: int, stream_tokens: int) -> OverheadResult:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        load = LoadGenerator(session, stream_tokens)
        gw_pid = gateway.pid
        idle_rss = rss_mb(gw_pid)

        _progress("warm-up")
        await load.run_plain(engine.url, 50, 4)
        await load.run_plain(gateway.url, 200, 4)
        for _ in range(20):
            await load.stream(gateway.url)

        _progress(f"latency at c=1: {n} direct, {n} through the gateway (interleaved)")
        direct: list[float] = []
        via: list[float] = []
        for _ in range(n):
            direct.append(await load.plain(engine.url))
            via.append(await load.plain(gateway.url))

        _progress(f"CPU per plain request at c=1 ({n} requests)")
        c0 = cpu_seconds(gw_pid)
        await load.run_plain(gateway.url, n, 1)
        cpu_c1 = (cpu_seconds(gw_pid) - c0) / n

        streams = max(20, n // 4)
        _progress(f"streams: {streams} x {stream_tokens} tokens, TTFT direct vs gateway")
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

        _progress(f"RPS at c=32 ({n * 2} requests)")
        _, wall = await load.run_plain(gateway.url, n * 2, 32)
        rps = n * 2 / wall

        _progress(f"CPU per request at c=256 ({n * 2} requests)")
        c0 = cpu_seconds(gw_pid)
        await load.run_plain(gateway.url, n * 2, 256)
        cpu_c256 = (cpu_seconds(gw_pid) - c0) / (n * 2)

    d50, d99 = _percentile(direct, 0.5), _percentile(direct, 0.99)
    g50, g99 = _percentile(via, 0.5), _percentile(via, 0.99)
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
        idle_rss_mb=idle_rss,
        stream_tokens=stream_tokens,
    )


def run_overhead(n: int = 2000, stream_tokens: int = 64) -> OverheadResult:
    """Start the engine and the gateway, measure, stop both. Blocking."""
    _progress("starting a zero-latency simulated engine and a single-worker gateway")
    with spawn_sim_engine(
        "--profile", "zero", "--model", MODEL, "--max-num-seqs", "1024", name="bench-engine"
    ) as engine:
        settings = {
            "SLOGATE_ENGINES": json.dumps(
                [{"url": engine.url, "kind": "sim", "model": MODEL, "name": "bench-engine"}]
            ),
            "SLOGATE_PORT": "0",
            "SLOGATE_LOG_LEVEL": "warning",
        }
        with spawn_listening(
            [sys.executable, "-m", "gateway.cli", "serve"], "gateway", env=settings
        ) as gateway:
            return asyncio.run(_measure(engine, gateway, n, stream_tokens))


def render_table(result: OverheadResult) -> str:
    rows = [
        ("figure", "measured", "target", "met"),
        *[(a, b, c, "yes" if ok else "NO") for a, b, c, ok in result.checks()],
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append(
        f"(direct p50/p99 {result.direct_p50_ms:.3f}/{result.direct_p99_ms:.3f} ms, "
        f"gateway p50/p99 {result.gateway_p50_ms:.3f}/{result.gateway_p99_ms:.3f} ms; "
        f"streams of {result.stream_tokens} tokens)"
    )
    return "\n".join(lines)


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default 2000)")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")


def bench_overhead_main(args: argparse.Namespace) -> int:
    result = run_overhead(args.requests, args.stream_tokens)
    print(render_table(result))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return 0
