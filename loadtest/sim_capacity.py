"""How much one simulated-engine process can carry: CPU per streamed token, and concurrent streams.

Two measurements against a real ``python -m gateway.sim.cli`` child process:

1. **CPU per streamed token.** The engine runs the ``zero`` profile (no modelled time) and
   ``--zero-streams`` clients each stream ``--tokens`` tokens as fast as it can; the engine's
   user+system CPU (``/proc/<pid>/stat``) divided by the tokens streamed is the cost of one
   token: scheduling, the step, SSE framing and the socket write.
2. **Concurrent streams under one core.** The engine runs ``--profile`` (default ``qwen-7b``) at
   time scale 1 with the batch limit lifted (``--max-num-seqs``), and the concurrency is ramped
   over ``--levels``. At each level all streams start together; the report shows the engine's
   CPU in cores, the engine's own mean inter-token latency (its ``vllm:inter_token_latency_seconds``
   histogram, i.e. when it wrote each token), the model's mean inter-token time for the same
   workload (the engine model run offline on a virtual clock: same token budget, same prefill
   steps, eq.(1)/(2) step times), the client-side steady-state gap, and whether both conditions
   hold: CPU < 1 core and engine ITL within ``--itl-tolerance`` of the model. The answer is the
   highest level where both hold. Short prompts keep the run decode-bound (one prefill step).

Run::

    python -m loadtest.sim_capacity                      # full ramp, about a minute
    python -m loadtest.sim_capacity --levels 8,16 --tokens 20 --zero-streams 8   # smoke

The client runs in this process; on a small machine it competes with the engine for CPU, which
makes the streams figure conservative.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.sim.engine import EngineModel, SimRequest
from gateway.sim.profiles import EngineProfile, load_profile
from tests.support.sim_process import launch_sim_engine

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


@dataclass
class LevelResult:
    streams: int
    tokens: int
    wall_s: float
    cpu_s: float
    itl_ms: float  # engine side: vllm:inter_token_latency_seconds over the level
    client_itl_ms: float  # client side, steady state only; inflated when the client is CPU-bound
    model_itl_ms: float
    errors: int

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_us_per_token(self) -> float:
        return self.cpu_s / self.tokens * 1e6 if self.tokens else float("nan")


async def _one_stream(
    session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int
) -> list[float]:
    """Stream one request; returns the arrival time of each token (empty list on an HTTP error)."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return []
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                arrivals.append(time.perf_counter())
    return arrivals


def steady_gaps(streams: list[list[float]]) -> list[float]:
    """Inter-token gaps while every stream is decoding (after the last first token, before the
    first stream ends): the batch is exactly the level, so eq.(2) applies without prefill chunks."""
    started = max((a[0] for a in streams if a), default=0.0)
    ended = min((a[-1] for a in streams if a), default=0.0)
    return [
        b - a for arrivals in streams for a, b in itertools.pairwise(arrivals) if a >= started and b <= ended
    ]


async def run_level(
    url: str, pid: int, streams: int, tokens: int, prompt_tokens: int
) -> tuple[int, float, float, list[float], int]:
    """Start ``streams`` streams at once; returns (tokens, wall s, engine cpu s, gaps, errors)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        prompts = level_prompts(streams, prompt_tokens)
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        results = await asyncio.gather(
            *(_one_stream(session, url + "/v1/completions", p, tokens) for p in prompts),
            return_exceptions=True,
        )
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    ok = [r for r in results if isinstance(r, list) and r]
    return sum(len(r) for r in ok), wall, cpu, steady_gaps(ok), streams - len(ok)


def offline_itl(profile: EngineProfile, prompts: list[list[int]], tokens: int) -> float:
    """Mean inter-token time of the same workload run through the engine model on a virtual clock.

    This is what the live engine should reproduce: the same batching (token budget, prefill steps
    mixed with decodes) and the same eq.(1)/(2) step times, without any wall-clock overhead."""
    model = EngineModel(profile)
    for i, prompt in enumerate(prompts):
        model.add(SimRequest(f"r{i}", list(prompt), tokens, 0.0, ignore_eos=True))
    now, gap_sum, gaps = 0.0, 0.0, 0
    last: dict[str, float] = {}
    while model.has_work:
        batch = model.plan(now)
        if batch is None:
            break
        now += batch.duration
        for request, _ in model.finish(batch, now).tokens:
            previous = last.get(request.request_id)
            if previous is not None:
                gap_sum, gaps = gap_sum + now - previous, gaps + 1
            last[request.request_id] = now
    return gap_sum / gaps if gaps else float("nan")


def level_prompts(streams: int, prompt_tokens: int) -> list[list[int]]:
    return [[300 + (i * 7 + j) % 30000 for j in range(prompt_tokens)] for i in range(streams)]


async def engine_itl(url: str) -> tuple[float, float]:
    """(sum s, count) of the engine's own inter-token latency histogram."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_sum{"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:inter_token_latency_seconds_count{"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


@contextlib.contextmanager
def _engine(profile: str, extra: list[str]) -> Iterator[tuple[str, int]]:
    """A sim engine child process; yields (url, pid)."""
    handle = launch_sim_engine("--profile", profile, "--model", "capacity", *extra, startup_timeout=30)
    try:
        yield handle.url, handle.pid
    finally:
        handle.stop()


def _raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def main_async(args: argparse.Namespace) -> int:
    _raise_fd_limit()
    print(
        f"[1/2] CPU per streamed token: zero profile, {args.zero_streams} streams x {args.tokens} tokens",
        flush=True,
    )
    with _engine("zero", []) as (url, pid):
        await run_level(url, pid, 2, 4, args.prompt_tokens)  # warm-up
        tokens, wall, cpu, _, errors = await run_level(
            url, pid, args.zero_streams, args.tokens, args.prompt_tokens
        )
    zero_us = cpu / tokens * 1e6 if tokens else float("nan")
    print(
        f"      {tokens} tokens in {wall:.2f} s ({tokens / wall:,.0f} tok/s), engine CPU {cpu:.2f} s "
        f"-> {zero_us:.1f} us/token, errors {errors}",
        flush=True,
    )

    levels = [int(x) for x in args.levels.split(",") if x]
    print(
        f"[2/2] concurrent streams at time scale 1: profile {args.profile}, levels {levels}, "
        f"{args.tokens} tokens each",
        flush=True,
    )
    results: list[LevelResult] = []
    profile = load_profile(args.profile).model_copy(update={"max_num_seqs": max(levels)})
    with _engine(args.profile, ["--time-scale", "1", "--max-num-seqs", str(max(levels))]) as (url, pid):
        await run_level(url, pid, 2, 4, args.prompt_tokens)
        for level in levels:
            itl_sum0, itl_n0 = await engine_itl(url)
            tokens, wall, cpu, gaps, errors = await run_level(
                url, pid, level, args.tokens, args.prompt_tokens
            )
            itl_sum1, itl_n1 = await engine_itl(url)
            itl = (itl_sum1 - itl_sum0) / max(1.0, itl_n1 - itl_n0)
            model_itl = offline_itl(profile, level_prompts(level, args.prompt_tokens), args.tokens)
            client_itl = sum(gaps) / len(gaps) if gaps else float("nan")
            result = LevelResult(
                level, tokens, wall, cpu, itl * 1e3, client_itl * 1e3, model_itl * 1e3, errors
            )
            results.append(result)
            print(
                f"      {level:>6} streams: {result.cores:.2f} cores, "
                f"{result.cpu_us_per_token:6.1f} us/token, "
                f"ITL {result.itl_ms:6.2f} ms (model {result.model_itl_ms:6.2f} ms, "
                f"client {result.client_itl_ms:6.2f} ms), errors {errors}",
                flush=True,
            )

    def ok(r: LevelResult) -> bool:
        return r.errors == 0 and r.cores < 1.0 and abs(r.itl_ms / r.model_itl_ms - 1) <= args.itl_tolerance

    print()
    print(
        f"{'streams':>8} {'cores':>6} {'us/token':>9} {'ITL ms':>8} {'model ms':>9} {'ITL err':>8} "
        f"{'client ms':>9} {'ok':>3}"
    )
    for r in results:
        err = r.itl_ms / r.model_itl_ms - 1
        print(
            f"{r.streams:>8} {r.cores:>6.2f} {r.cpu_us_per_token:>9.1f} {r.itl_ms:>8.2f} "
            f"{r.model_itl_ms:>9.2f} "
            f"{err:>+8.1%} {r.client_itl_ms:>9.2f} {'yes' if ok(r) else 'no':>3}"
        )
    best = max((r.streams for r in results if ok(r)), default=0)
    print()
    print(f"CPU per streamed token (zero profile, {args.zero_streams} streams): {zero_us:.1f} us")
    print(
        f"concurrent streams under one core with ITL within {args.itl_tolerance:.0%} of the model: {best}"
        + (" (the highest level tried; raise --levels)" if results and best == results[-1].streams else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--profile", default="qwen-7b")
    p.add_argument("--levels", default="64,128,256,512,1024,2048,3072,4096")
    p.add_argument("--tokens", type=int, default=60, help="tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=4, help="short, so the run is decode-bound")
    p.add_argument("--zero-streams", type=int, default=64)
    p.add_argument("--itl-tolerance", type=float, default=0.10)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
