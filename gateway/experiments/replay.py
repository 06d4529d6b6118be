"""Replay a workload against a live gateway and measure every request as a client sees it.

Each request streams (so TTFT and TPOT are observed at the client), carries its task and SLO
targets as headers, and sets its exact output length with ``max_tokens`` + ``ignore_eos`` (and the
simulated engine's ``X-Sim-Output-Len``). Engines run ``time_scale`` times faster than the
profile they simulate, so arrival times are divided and measured latencies multiplied by it:
everything reported is in simulated (profile) seconds.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.experiments.prompts import spec_prompt_text
from gateway.experiments.workload import RequestSpec, prompt_text
from gateway.sse import sse_data


@dataclass(slots=True)
class Outcome:
    spec: RequestSpec
    status: int
    ttft_s: float  # simulated seconds; inf when no token arrived
    tpot_s: float
    e2e_s: float
    tokens: int
    start_s: float  # when it was sent, simulated seconds since the run began
    engine: str = ""
    #: the targets the gateway assigned (x-slo-ttft-ms / x-slo-tpot-ms), simulated seconds
    assigned_ttft_s: float = 0.0
    assigned_tpot_s: float = 0.0

    @property
    def assigned_ttft_met(self) -> bool:
        return self.status == 200 and self.ttft_s <= self.assigned_ttft_s

    @property
    def ttft_met(self) -> bool:
        return self.status == 200 and self.ttft_s <= self.spec.ttft_s

    @property
    def tpot_met(self) -> bool:
        return self.status == 200 and self.tpot_s <= self.spec.tpot_s

    @property
    def met(self) -> bool:
        return self.ttft_met and self.tpot_met


async def _one(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    spec: RequestSpec,
    prompt: str,
    scale: float,
    t0: float,
    explicit_slo: bool,
) -> Outcome:
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": spec.bound,
            # the answer's own length, in the body too: a gateway that does not relay the
            # x-sim-* headers still passes it (with a task's bound as max_tokens and ignore_eos,
            # every answer ran to that bound)
            "sim_output_len": spec.output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    headers = {
        "Content-Type": "application/json",
        "X-Sim-Output-Len": str(spec.output_tokens),
        "x-priority": str(spec.priority),
    }
    if spec.session is not None:
        # a conversation's turns say they are one (the offline simulator keys them so: the
        # affinity scorer's session)
        headers["x-session-id"] = spec.session
    if explicit_slo:
        headers["x-slo-task"] = spec.task
        # Targets in the engines' (scaled) time, so the gateway plans against what it observes.
        headers["x-slo-ttft-ms"] = f"{spec.ttft_s * 1000 / scale:.3f}"
        headers["x-slo-tpot-ms"] = f"{spec.tpot_s * 1000 / scale:.3f}"
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    status = 0
    engine = ""
    assigned = (0.0, 0.0)
    try:
        async with session.post(base + "/v1/chat/completions", data=body, headers=headers) as resp:
            status = resp.status
            engine = resp.headers.get("x-slogate-engine", "")
            assigned = (
                float(resp.headers.get("x-slo-ttft-ms", 0)) / 1000 * scale,
                float(resp.headers.get("x-slo-tpot-ms", 0)) / 1000 * scale,
            )
            if status == 200:
                async for line in resp.content:
                    if not sse_data(line).startswith(b"{") or b'"content"' not in line:
                        continue
                    now = time.perf_counter()
                    if not first:
                        first = now
                    last = now
                    tokens += 1
            else:
                await resp.read()
    except aiohttp.ClientError:
        status = 599
    done = time.perf_counter()
    ttft = (first - sent) * scale if first else float("inf")
    tpot = (last - first) / (tokens - 1) * scale if tokens > 1 else 0.0
    return Outcome(
        spec, status, ttft, tpot, (done - sent) * scale, tokens, (sent - t0) * scale, engine, *assigned
    )


async def replay(
    base: str,
    model: str,
    workload: Sequence[RequestSpec],
    time_scale: float,
    seed: int = 0,
    progress: bool = True,
    label: str = "",
    explicit_slo: bool = True,
) -> list[Outcome]:
    """Send each request at its (scaled) arrival time; wait for all; return outcomes in order sent."""
    rng = random.Random(seed)
    # Specs with segments carry their own token ids (shared prefixes must survive into the live
    # run); the rest keep the seeded random words they always had, so old runs replay unchanged.
    prompts = [spec_prompt_text(s) if s.segments else prompt_text(s.prompt_tokens, rng) for s in workload]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Outcome]] = []
        for i, (spec, prompt) in enumerate(zip(workload, prompts, strict=True)):
            delay = t0 + spec.at / time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(_one(session, base, model, spec, prompt, time_scale, t0, explicit_slo))
            )
            if progress and (i + 1) % max(1, len(workload) // 10) == 0:
                print(f"  [{label}] sent {i + 1}/{len(workload)}", file=sys.stderr, flush=True)
        return list(await asyncio.gather(*tasks))


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    attainment: float  # fraction meeting both TTFT and TPOT
    ttft_attainment: float
    tpot_attainment: float
    e2e_mean_s: float
    e2e_p99_s: float
    errors: int
    makespan_s: float
    e2e_p50_s: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (the smallest value with at least a ``q``
    share of the values at or below it); ``nan`` when empty. (``int(q * n)`` made p99 the
    largest value for any n up to 100, and one rank high beyond.)"""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(outcomes: Sequence[Outcome]) -> Summary:
    n = len(outcomes)
    if n == 0:  # (no request: no share met and no latency, not 0 % and 0 s)
        return Summary(0, math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0.0)
    ok = [o for o in outcomes if o.status == 200]
    # (over the requests served: none served is no latency, not a latency of 0)
    e2e = [o.e2e_s for o in ok] or [math.nan]
    return Summary(
        requests=n,
        attainment=sum(o.met for o in outcomes) / n,
        ttft_attainment=sum(o.ttft_met for o in outcomes) / n,
        tpot_attainment=sum(o.tpot_met for o in outcomes) / n,
        e2e_mean_s=sum(e2e) / len(e2e),
        e2e_p99_s=percentile(e2e, 0.99),
        errors=n - len(ok),
        makespan_s=max(o.start_s + o.e2e_s for o in outcomes),
        e2e_p50_s=percentile(e2e, 0.5),
    )
