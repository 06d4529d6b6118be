"""What the benchmarks share: child engines and a gateway in front of them, CPU and memory of a
process from /proc, and streams read with the arrival time of every chunk.

The benchmarks run on machines shared with other work, so the gateway's cost is its process CPU
time (``/proc/<pid>/task/*/schedstat``: nanoseconds on CPU, every thread), which other processes
do not inflate, rather than wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import yaml

from gateway.experiments.replay import percentile as percentile
from gateway.procs import ChildProcess, spawn_listening, spawn_sim_engine
from gateway.sim.profiles import load_profile


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` in seconds (ns resolution, unlike /proc/pid/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # thread exited between listing and reading
    return total / 1e9


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def kernel_seconds(pid: int) -> float:
    """CPU time ``pid`` spent in the kernel (system calls: socket reads and writes, epoll), every
    thread's, those that have exited too: ``stime`` of ``/proc/<pid>/stat`` (clock ticks, 10 ms:
    read over seconds)."""
    # (the fields after the command name, which may itself hold spaces and parentheses; stime is
    # the 15th field, the 13th after the name)
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[12]) / _CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def engine_entry(engine: ChildProcess, model: str, kind: str = "sim") -> dict[str, str]:
    """One item of the gateway's ``engines`` setting for a child engine."""
    return {"url": engine.url, "kind": kind, "model": model, "name": engine.name}


def spawn_gateway(engines: Sequence[Mapping[str, str]], env: Mapping[str, str] | None = None) -> ChildProcess:
    """A single-worker gateway (``slogate serve``) on a free port in front of ``engines``."""
    settings = {
        "SLOGATE_ENGINES": json.dumps(list(engines)),
        "SLOGATE_PORT": "0",
        "SLOGATE_LOG_LEVEL": "warning",
        **(env or {}),
    }
    return spawn_listening([sys.executable, "-m", "gateway.cli", "serve"], "gateway", env=settings)


def spawn_zero_engine(model: str, name: str = "bench-engine") -> ChildProcess:
    """A simulated engine whose steps take no time: what a benchmark sees is the HTTP stack."""
    return spawn_sim_engine("--profile", "zero", "--model", model, "--max-num-seqs", "4096", name=name)


def paced_profile(directory: Path, token_gap_s: float) -> Path:
    """The zero-latency profile with every decode step taking ``token_gap_s``: each running stream
    gets a token that far apart, however many run (prefill still takes no time)."""
    profile = load_profile("zero").model_dump()
    profile["name"] = "paced"
    profile["latency"]["decode_a"] = token_gap_s
    path = directory / "paced.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def spawn_paced_engine(model: str, profile: Path, name: str = "paced-engine") -> ChildProcess:
    return spawn_sim_engine("--profile", str(profile), "--model", model, "--max-num-seqs", "4096", name=name)


def spawn_sink(model: str) -> ChildProcess:
    """An engine that answers any request at once without reading the prompt (sink_engine.py)."""
    return spawn_listening(
        [sys.executable, "-m", "gateway.bench.sink_engine", "--model", model], "sink-engine"
    )


async def idle_cpu_rate(pid: int, seconds: float = 1.0) -> float:
    """CPU seconds per second ``pid`` spends with no request (its monitor scraping engines), to be
    subtracted from a measurement that lasts a while."""
    return (await idle_rates(pid, seconds))[0]


async def idle_rates(pid: int, seconds: float = 1.0) -> tuple[float, float]:
    """:func:`idle_cpu_rate`, and the part of it spent in the kernel."""
    c0, k0, t0 = cpu_seconds(pid), kernel_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - t0
    return (cpu_seconds(pid) - c0) / elapsed, (kernel_seconds(pid) - k0) / elapsed


@dataclass
class StreamTrace:
    """One streamed response as the client saw it."""

    #: perf_counter() when each chunk holding at least one complete event arrived
    arrivals: list[float] = field(default_factory=list)
    events: int = 0

    def gaps(self) -> list[tuple[float, float]]:
        """(start, length) of each interval between consecutive chunks, from the first token on."""
        return [(a, b - a) for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def traced_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str]
) -> StreamTrace:
    """POST a streaming request and record when its events arrive."""
    trace = StreamTrace()
    async with session.post(url, data=body, headers=dict(headers)) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.read())[:200]!r}")
        async for chunk in response.content.iter_any():
            events = chunk.count(b"\n\n")
            if events:
                trace.arrivals.append(time.perf_counter())
                trace.events += events
    return trace


async def wait_until_served(
    session: aiohttp.ClientSession, base: str, model: str, timeout_s: float = 30.0
) -> None:
    """Until the gateway answers a request for ``model`` with 200: its monitor admits an engine
    only after a first health check."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    deadline = time.monotonic() + timeout_s
    status = 0
    while time.monotonic() < deadline:
        async with session.post(
            base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            await response.read()
            status = response.status
        if status == 200:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway did not serve {model} within {timeout_s:.0f} s (last status {status})")


def checks_table(checks: Sequence[tuple[str, str, str, bool]]) -> list[str]:
    """(figure, measured, target, met) rows as aligned text lines, header and rule first."""
    rows = [
        ("figure", "measured", "target", "met"),
        *[(a, b, c, "yes" if ok else "NO") for a, b, c, ok in checks],
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return lines


_Run = TypeVar("_Run")


def median_run(runs: Sequence[_Run], figure: Callable[[_Run], float]) -> _Run:
    """The run whose ``figure`` is the median (the higher middle of an even count), kept whole:
    a benchmark repeated on a shared machine reports one run's figures, not a mix of runs."""
    return sorted(runs, key=figure)[len(runs) // 2]
