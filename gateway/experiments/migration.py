"""``slogate experiment migration``: decode migration measured through a live gateway.

Two scenarios, each against simulated engines and a gateway run as child processes, with a
closed-loop streamed chat workload (``--concurrency``, or ``--load`` of the engines' sequence
slots: ``--max-num-seqs`` per engine) of distinct prompts whose reference output (the
deterministic, continuation-exact output of the simulated engine) is fetched first:

* **engine killed**: ``--engines`` engines; half-way through the run one engine is killed
  (SIGKILL: its streams are cut at the TCP level). Every stream is checked against its reference:
  completed, exact, tokens lost / repeated / different, usage. For the streams that were on the
  killed engine, the *resume gap* (the client's wait between the last token before the kill and
  the next one) and the *E2E excess* (its end-to-end time over the median of the same request's
  unmigrated runs) are reported as p50 / p99.
* **slow engine**: one engine runs 3x slower (``POST /sim/fault slow``) from the start; the same
  workload with a TPOT target (``--tpot-ms``) runs twice, migration off and on (limit 1, slack on):
  TPOT attainment (client-observed mean time per output token after the first), TPOT p50 / p99,
  exactness and the slack migrations the gateway counted.

Progress goes to stderr, the tables to stdout (``--json`` writes the figures too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.experiments.replay import percentile
from gateway.procs import ChildProcess, spawn_listening, spawn_sim_engine
from gateway.report_json import report_json
from gateway.sse import sse_data

MODEL = "sim-model"
PATH = "/v1/chat/completions"


def _progress(message: str) -> None:
    print(f"[migration] {message}", file=sys.stderr, flush=True)


@dataclass
class Job:
    prompt: str
    max_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            # token ids in both runs, so every stream is checked token by token
            "return_token_ids": True,
        }


@dataclass
class Streamed:
    job: int
    engine: str = ""
    started: float = 0.0
    ended: float = 0.0
    times: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    idents: set[tuple[Any, Any]] = field(default_factory=set)
    finishes: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    @property
    def tpot(self) -> float | None:
        if len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


class Stack:
    """Simulated engines and one gateway as child processes."""

    def __init__(
        self, engines: int, engine_args: Sequence[str], settings: dict[str, Any], prefill: int = 0
    ) -> None:
        """``engines`` collocated ones, or with ``prefill`` > 0 that many prefill engines and
        ``engines`` decode engines behind a P/D gateway (every request disaggregated)."""
        self.engines: list[ChildProcess] = []
        self.prefill: list[ChildProcess] = []
        self.gateway: ChildProcess | None = None
        self._profile: Path | None = None
        try:
            role = ("--role", "decode") if prefill else ()
            for i in range(engines):
                self.engines.append(
                    spawn_sim_engine(*engine_args, *role, "--engine-id", f"sim-{i}", name=f"sim-{i}")
                )
            for i in range(prefill):
                self.prefill.append(
                    spawn_sim_engine(
                        *engine_args, "--role", "prefill", "--engine-id", f"p-{i}", name=f"p-{i}"
                    )
                )
            entries = [
                {
                    "url": e.url,
                    "kind": "sim",
                    "model": MODEL,
                    "name": e.name,
                    **({"role": "decode"} if prefill else {}),
                }
                for e in self.engines
            ]
            entries += [
                {"url": e.url, "kind": "sim", "model": MODEL, "name": e.name, "role": "prefill"}
                for e in self.prefill
            ]
            if prefill:
                handle, name = tempfile.mkstemp(prefix="slogate-pd-", suffix=".yaml")
                os.close(handle)
                self._profile = Path(name)
                self._profile.write_text(
                    "name: pd-migration\nfilters: []\nscorers:\n  - name: least_load\n    weight: 1.0\n"
                    "picker:\n  name: max_score\ndisaggregation: {mode: always}\n"
                )
                settings = {**settings, "routing_profile": str(self._profile)}
            env = {
                "SLOGATE_ENGINES": json.dumps(entries),
                "SLOGATE_PORT": "0",
                "SLOGATE_LOG_LEVEL": "warning",
                "SLOGATE_MONITOR_INTERVAL_S": "0.2",
                **{f"SLOGATE_{k.upper()}": str(v) for k, v in settings.items()},
            }
            self.gateway = spawn_listening([sys.executable, "-m", "gateway.cli", "serve"], "gateway", env=env)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for engine in (*self.engines, *self.prefill):
            engine.stop()
        if self._profile is not None:
            self._profile.unlink(missing_ok=True)


async def _stream(
    session: aiohttp.ClientSession, url: str, job: Job, index: int, headers: dict[str, str]
) -> Streamed:
    out = Streamed(index, started=time.monotonic())
    try:
        async with session.post(url + PATH, json=job.body(), headers=headers) as resp:
            out.engine = resp.headers.get("x-slogate-engine", "")
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = sse_data(line).strip()
                if payload == b"[DONE]":
                    out.done = True
                    break
                data = orjson.loads(payload)
                if "error" in data:
                    out.error = str(data["error"].get("message"))[:300]
                    continue
                out.idents.add((data.get("id"), data.get("created")))
                if data.get("usage"):
                    out.usage = data["usage"]
                now = time.monotonic()
                for choice in data.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    out.ids += ids
                    out.times += [now] * len(ids)
                    if choice.get("finish_reason"):
                        out.finishes.append(choice["finish_reason"])
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = repr(exc)
    out.ended = time.monotonic()
    return out


async def _references(url: str, jobs: Sequence[Job]) -> list[list[int]]:
    async with aiohttp.ClientSession() as session:
        streams = await asyncio.gather(*(_stream_direct(session, url, job) for job in jobs))
    return streams


async def _stream_direct(session: aiohttp.ClientSession, url: str, job: Job) -> list[int]:
    async with session.post(url + PATH, json=job.body()) as resp:
        ids: list[int] = []
        async for line in resp.content:
            if sse_data(line).startswith(b"{"):
                for choice in orjson.loads(sse_data(line)).get("choices") or ():
                    ids += choice.get("token_ids") or []
        return ids


async def _closed_loop(
    url: str,
    jobs: Sequence[Job],
    concurrency: int,
    duration_s: float,
    label: str,
    headers: dict[str, str],
    at_half: Callable[[], None] | None = None,
) -> tuple[list[Streamed], float]:
    """``concurrency`` clients issuing streams back to back for ``duration_s``; ``at_half`` runs
    half-way. Returns every stream and the time ``at_half`` ran."""
    results: list[Streamed] = []
    counter = 0
    start = time.monotonic()
    stop_at = start + duration_s
    half_at = 0.0
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            nonlocal counter
            while time.monotonic() < stop_at:
                index = counter % len(jobs)
                counter += 1
                results.append(await _stream(session, url, jobs[index], index, headers))

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        next_report = start + 1.0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            now = time.monotonic()
            if at_half is not None and not half_at and now >= start + duration_s / 2:
                at_half()
                half_at = now
            if now >= next_report:
                next_report += 1.0
                running = sum(not t.done() for t in tasks)
                _progress(
                    f"{label}: {min(now - start, duration_s):5.1f}/{duration_s:.0f} s, "
                    f"{len(results)} streams done, {running} clients running"
                )
        await asyncio.gather(*tasks)
    return results, half_at


def _check(
    streams: Sequence[Streamed], refs: Sequence[list[int]], prompt_tokens: Sequence[int]
) -> dict[str, Any]:
    """Completed, exact, and tokens lost / repeated / different against the references."""
    completed = exact = lost = repeated = different = usage_ok = single_id = 0
    for s in streams:
        ref = refs[s.job]
        if s.done and s.error is None:
            completed += 1
        if s.ids == ref and s.done and s.error is None:
            exact += 1
        lost += max(0, len(ref) - len(s.ids)) if s.error is None else 0
        repeated += max(0, len(s.ids) - len(ref))
        different += sum(a != b for a, b in zip(s.ids, ref, strict=False))
        u = s.usage
        if (
            u is not None
            and u.get("completion_tokens") == len(ref)
            and u.get("prompt_tokens") == prompt_tokens[s.job]
            and u.get("total_tokens") == len(ref) + prompt_tokens[s.job]
            and s.finishes == ["length"]
        ):
            usage_ok += 1
        single_id += len(s.idents) == 1
    return {
        "streams": len(streams),
        "completed": completed,
        "exact": exact,
        "lost_tokens": lost,
        "repeated_tokens": repeated,
        "different_tokens": different,
        "usage_ok": usage_ok,
        "one_id_and_created": single_id,
    }


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("slogate_migrations"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _prompt_tokens(url: str, jobs: Sequence[Job]) -> list[int]:
    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:
            out = []
            for job in jobs:
                body = {**job.body(), "stream": False, "max_tokens": 1}
                body.pop("stream_options")
                async with session.post(url + PATH, json=body) as resp:
                    out.append(int((await resp.json())["usage"]["prompt_tokens"]))
            return out

    return asyncio.run(run())


def _killed(args: argparse.Namespace, jobs: Sequence[Job], engine_args: Sequence[str]) -> dict[str, Any]:
    settings = {"migration_limit": args.limit}
    stack = Stack(args.engines, engine_args, settings, prefill=args.pd_prefill)
    try:
        victim = stack.engines[-1]
        refs = asyncio.run(_references(stack.engines[0].url, jobs))
        prompts = _prompt_tokens(stack.engines[0].url, jobs)
        fleet = f"{args.pd_prefill} prefill + {args.engines} decode" if args.pd_prefill else f"{args.engines}"
        _progress(
            f"engine killed: {fleet} engines, {args.concurrency} streams at a time, {args.duration:.0f} s"
        )

        def kill() -> None:
            os.kill(victim.pid, signal.SIGKILL)
            _progress(f"engine killed: {victim.name} killed")

        streams, killed_at = asyncio.run(
            _closed_loop(stack.url, jobs, args.concurrency, args.duration, "engine killed", {}, kill)
        )
        counters = asyncio.run(_metrics(stack.url))
    finally:
        stack.close()
    result = _check(streams, refs, prompts)
    migrated = [s for s in streams if s.engine == victim.name and s.started < killed_at < s.ended]
    gaps: list[float] = []
    excess: list[float] = []
    unmigrated: dict[int, list[float]] = {}
    for s in streams:
        if s not in migrated and s.done and s.error is None:
            unmigrated.setdefault(s.job, []).append(s.ended - s.started)
    for s in migrated:
        before = [t for t in s.times if t <= killed_at]
        after = [t for t in s.times if t > killed_at]
        if before and after:
            gaps.append(after[0] - before[-1])
        base = unmigrated.get(s.job)
        if base and s.done:
            excess.append((s.ended - s.started) - statistics.median(base))
    result.update(
        migrated_streams=len(migrated),
        migrated_exact=sum(s.ids == refs[s.job] and s.done and s.error is None for s in migrated),
        resume_gap_ms_p50=percentile(gaps, 0.5) * 1e3,
        resume_gap_ms_p99=percentile(gaps, 0.99) * 1e3,
        e2e_excess_ms_p50=percentile(excess, 0.5) * 1e3,
        e2e_excess_ms_p99=percentile(excess, 0.99) * 1e3,
        migrations=counters,
    )
    return result


def _slow(
    args: argparse.Namespace, jobs: Sequence[Job], engine_args: Sequence[str], migrate: bool
) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "migration_limit": 1 if migrate else 0,
        "migration_slack_bound_s": args.slack_bound,
    }
    stack = Stack(args.engines, engine_args, settings, prefill=args.pd_prefill)
    label = f"slow engine, migration {'on' if migrate else 'off'}"
    try:
        slow = stack.engines[-1]
        refs = asyncio.run(_references(stack.engines[0].url, jobs))
        prompts = _prompt_tokens(stack.engines[0].url, jobs)

        async def slow_down() -> None:
            async with aiohttp.ClientSession() as session:
                fault = {"mode": "slow", "factor": args.slow_factor}
                async with session.post(slow.url + "/sim/fault", json=fault) as resp:
                    resp.raise_for_status()

        asyncio.run(slow_down())
        _progress(f"{label}: {slow.name} slowed {args.slow_factor:g}x, TPOT target {args.tpot_ms:g} ms")
        headers = {"x-slo-tpot-ms": str(args.tpot_ms)}
        streams, _ = asyncio.run(
            _closed_loop(stack.url, jobs, args.concurrency, args.duration, label, headers)
        )
        counters = asyncio.run(_metrics(stack.url))
    finally:
        stack.close()
    result = _check(streams, refs, prompts)
    # (a stream that failed ends with an error event and [DONE]: done, but nothing it met)
    tpots = [t for s in streams if s.done and s.error is None and (t := s.tpot) is not None]
    target = args.tpot_ms / 1e3
    result.update(
        migration=migrate,
        # (over every stream: one that failed met no target, and leaving it out raised the share)
        tpot_attainment=sum(t <= target for t in tpots) / len(streams) if streams else float("nan"),
        tpot_ms_p50=percentile(tpots, 0.5) * 1e3,
        tpot_ms_p99=percentile(tpots, 0.99) * 1e3,
        on_slow_engine=sum(s.engine == slow.name for s in streams),
        migrations=counters,
    )
    return result


def render(killed: dict[str, Any] | None, slow: Sequence[dict[str, Any]]) -> str:
    lines: list[str] = []
    if killed is not None:
        lines += [
            "Engine killed mid-run (SIGKILL), every stream checked against its reference output",
            "",
            "| streams | completed | exact | lost | repeated | different | usage ok | one id/created "
            "| migrated | migrated exact | resume gap p50 / p99 ms | E2E excess p50 / p99 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {killed['streams']} | {killed['completed']} | {killed['exact']} | {killed['lost_tokens']} "
            f"| {killed['repeated_tokens']} | {killed['different_tokens']} | {killed['usage_ok']} "
            f"| {killed['one_id_and_created']} | {killed['migrated_streams']} | {killed['migrated_exact']} "
            f"| {killed['resume_gap_ms_p50']:.0f} / {killed['resume_gap_ms_p99']:.0f} "
            f"| {killed['e2e_excess_ms_p50']:.0f} / {killed['e2e_excess_ms_p99']:.0f} |",
            "",
        ]
    if slow:
        lines += [
            "One engine slowed, TPOT target per stream, slack migration off vs on",
            "",
            "| migration | streams | exact | TPOT attainment | TPOT p50 ms | TPOT p99 ms "
            "| slack migrations |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in slow:
            moves = r["migrations"].get('slogate_migrations_total{reason="slack"}', 0.0)
            lines.append(
                f"| {'on' if r['migration'] else 'off'} | {r['streams']} | {r['exact']} "
                f"| {r['tpot_attainment']:.1%} | {r['tpot_ms_p50']:.1f} | {r['tpot_ms_p99']:.1f} "
                f"| {moves:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def add_migration_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=("all", "killed", "slow"), default="all")
    parser.add_argument(
        "--engines", type=int, default=4, help="collocated engines (decode engines with --pd)"
    )
    parser.add_argument(
        "--pd",
        dest="pd_prefill",
        type=int,
        default=0,
        metavar="P",
        help="P prefill engines in front of the --engines decode engines (P/D, every request disaggregated)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequence slots per engine")
    parser.add_argument("--load", type=float, default=0.5, help="share of all slots kept busy")
    parser.add_argument("--concurrency", type=int, default=0, help="streams at a time (default: from --load)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each run")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--profile", default="qwen-7b")
    parser.add_argument("--prompts", type=int, default=24, help="distinct requests (reference outputs)")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=2, help="migration_limit of the killed-engine run")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--tpot-ms", type=float, default=25.0)
    parser.add_argument("--slack-bound", type=float, default=0.5, help="migration_slack_bound_s")
    parser.add_argument("--repeat", type=int, default=1, help="slow-engine runs of each, interleaved")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")


def migration_main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    jobs = [
        Job(
            f"migration workload request {i}: {rng.random():.6f}",
            rng.randint(args.min_tokens, args.max_tokens),
        )
        for i in range(args.prompts)
    ]
    if not args.concurrency:
        args.concurrency = max(1, round(args.load * args.max_num_seqs * args.engines))
    engine_args = (
        "--profile",
        args.profile,
        "--model",
        MODEL,
        "--time-scale",
        str(args.time_scale),
        "--max-num-seqs",
        str(args.max_num_seqs),
    )
    killed = _killed(args, jobs, engine_args) if args.scenario in ("all", "killed") else None
    # off and on interleaved, so a change in the machine's load hits both alike
    slow = (
        [_slow(args, jobs, engine_args, migrate) for _ in range(args.repeat) for migrate in (False, True)]
        if args.scenario in ("all", "slow")
        else []
    )
    print(render(killed, slow))
    if args.json is not None:
        args.json.write_text(
            report_json({"killed": killed, "slow": slow, "args": vars(args)}, default=str, indent=1)
        )
    return 0


__all__ = ["add_migration_arguments", "migration_main", "render"]
