"""Locust load test for slogate: a multi-SLO task mix, streamed, with TTFT / TPOT and SLO attainment
per class.

Each simulated user picks a task (SLO class) by weight, sends a streamed chat completion that names
it (``x-slo-task``, or ``x-priority`` for a priority level), and times the SSE stream itself: TTFT
is the first streamed event after the request was sent (engines send it with the first token), TPOT
``(last token - first event) / (tokens - 1)``, tokens from the stream's usage chunk when the server
sends one, else its content events. A stream that ends without ``[DONE]`` or with an error event
is an error; one of zero tokens is served (TTFT only). A request meets its
SLO when both are within the targets the gateway assigned it (``x-slo-ttft-ms`` /
``x-slo-tpot-ms`` response headers), or the profile's targets for servers that do not say.

Locust's own table then has, per class, ``TTFT`` and ``TPOT`` rows (percentiles in ms) beside the
``POST`` rows; at test stop a per-class table with attainment is printed (and written as JSON with
``--slo-report``). Distributed runs (``--master`` / ``--worker``) aggregate on the master.

    pip install -e '.[loadtest]'
    slogate up &                                   # or any slogate deployment
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 20 -r 5 -t 1m
    locust -f loadtest/locustfile.py --host ... --slo-profile hyperflexis-2task --slo-mix sharegpt=3,wikisql=1

Options (beside Locust's): ``--slo-profile`` (name in profiles/slo or a YAML path; default
hyperflexis-4task), ``--slo-mix`` (``class=weight,...``; default: the profile's task classes
equally, or its priority levels when it has no task classes), ``--workload`` (name in
loadtest/workloads or a path: prompt/output length distributions per task; default: the workload
named like the profile, else 64/32 tokens), ``--model`` (default: the first model of GET /v1/models),
``--api-key``, ``--slo-report PATH``.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

# next to this file: Locust puts the locustfile's directory on sys.path while it loads it
from latency_histogram import LatencyHistogram
from locust import HttpUser, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from gateway.experiments.lengths import Fixed, LengthDist
from gateway.experiments.workload import prompt_text
from policies.slo import SloProfile, parse_slo_profile
from profiles import PROFILES_DIR

#: prompt and output tokens of a task no workload describes
DEFAULT_LENGTHS: tuple[LengthDist, LengthDist] = (Fixed(64), Fixed(32))


# --- the task mix --------------------------------------------------------------------------


@dataclass(frozen=True)
class SloTask:
    """One entry of the mix: how the request names its class and what it asks for."""

    name: str
    weight: float
    headers: dict[str, str]
    ttft_s: float  # the profile's target (a priority level: the top of its range)
    tpot_s: float
    prompt_tokens: LengthDist
    output_tokens: LengthDist


def load_profile(name_or_path: str) -> SloProfile:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILES_DIR / "slo" / f"{name_or_path}.yaml"
    return parse_slo_profile(path.read_text(), str(path))


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        mix[name.strip()] = float(weight) if weight else 1.0
        if not math.isfinite(mix[name.strip()]) or mix[name.strip()] <= 0:
            raise ValueError(f"--slo-mix: weight of {name!r} must be a positive number")
    return mix


def workload_lengths(
    name_or_path: str | None, profile: SloProfile
) -> dict[str, tuple[LengthDist, LengthDist]]:
    """Prompt and output length distributions per task, from a workload (loadtest/workloads);
    without ``--workload``, the workload named like the profile when there is one."""
    from gateway.experiments.workloads import read_workload

    try:
        workload = read_workload(name_or_path or profile.name)
    except (FileNotFoundError, ValueError):
        if name_or_path:
            raise
        return {}
    return {t.name: (t.input, t.output) for t in workload.tasks}


def build_mix(
    profile: SloProfile, mix: dict[str, float], lengths: dict[str, tuple[LengthDist, LengthDist]]
) -> list[SloTask]:
    levels = (
        {level.name: (i, level) for i, level in enumerate(profile.priority.levels)}
        if profile.priority
        else {}
    )
    if not mix:
        named = [c for c in profile.classes if c != profile.default_class]
        mix = dict.fromkeys(named or list(levels) or [profile.default_class], 1.0)
    tasks: list[SloTask] = []
    for name, weight in mix.items():
        prompt, output = lengths.get(name, DEFAULT_LENGTHS)
        if name in profile.classes:
            cls = profile.classes[name]
            tasks.append(SloTask(name, weight, {"x-slo-task": name}, cls.ttft_s, cls.tpot_s, prompt, output))
        elif name in levels:
            index, level = levels[name]
            headers = {"x-priority": str(index)}
            tasks.append(SloTask(name, weight, headers, level.ttft_s[1], level.tpot_s[1], prompt, output))
        else:
            known = sorted([*profile.classes, *levels])
            raise ValueError(f"--slo-mix: {name!r} is no class or priority level of {profile.name} ({known})")
    return tasks


# --- per-class results ---------------------------------------------------------------------


@dataclass
class ClassStats:
    """What one class's requests did; mergeable across workers. TTFT and TPOT are histograms, so
    memory stays bounded however long the run (percentiles within 1 %)."""

    requests: int = 0
    met: int = 0
    missed_ttft: int = 0
    missed_tpot: int = 0
    errors: int = 0
    ttft_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    tpot_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    targets: tuple[float, float] | None = None  # last seen (ttft_ms, tpot_ms)

    def merge(self, other: dict[str, Any]) -> None:
        for key in ("requests", "met", "missed_ttft", "missed_tpot", "errors"):
            setattr(self, key, getattr(self, key) + int(other[key]))
        self.ttft_ms.merge(LatencyHistogram.from_dict(other["ttft_ms"]))
        self.tpot_ms.merge(LatencyHistogram.from_dict(other["tpot_ms"]))
        if other.get("targets"):
            self.targets = (float(other["targets"][0]), float(other["targets"][1]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "met": self.met,
            "missed_ttft": self.missed_ttft,
            "missed_tpot": self.missed_tpot,
            "errors": self.errors,
            "ttft_ms": self.ttft_ms.to_dict(),
            "tpot_ms": self.tpot_ms.to_dict(),
            "targets": list(self.targets) if self.targets else None,
        }


class Results:
    """Per-class stats, thread-safe; ``drain`` hands a worker's share to the master."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.classes: dict[str, ClassStats] = {}

    def add(
        self,
        name: str,
        outcome: str,
        ttft_ms: float | None,
        tpot_ms: float | None,
        targets: tuple[float, float] | None,
    ) -> None:
        with self._lock:
            stats = self.classes.setdefault(name, ClassStats())
            stats.requests += 1
            if outcome == "met":
                stats.met += 1
            elif outcome == "error":
                stats.errors += 1
            else:
                setattr(stats, outcome, getattr(stats, outcome) + 1)
            if ttft_ms is not None:
                stats.ttft_ms.add(ttft_ms)
            if tpot_ms is not None:
                stats.tpot_ms.add(tpot_ms)
            if targets is not None:
                stats.targets = targets

    def drain(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            out = {name: s.to_dict() for name, s in self.classes.items()}
            self.classes = {}
        return out

    def merge(self, data: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            for name, other in data.items():
                self.classes.setdefault(name, ClassStats()).merge(other)

    def reset(self) -> None:
        with self._lock:
            self.classes = {}


RESULTS = Results()
MIX: list[SloTask] = []
MODEL: dict[str, str] = {}


def summary(results: Results, mix: list[SloTask]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in mix:
        s = results.classes.get(t.name, ClassStats())
        targets = s.targets or (t.ttft_s * 1000, t.tpot_s * 1000)
        out[t.name] = {
            "requests": s.requests,
            "met": s.met,
            "missed_ttft": s.missed_ttft,
            "missed_tpot": s.missed_tpot,
            "errors": s.errors,
            "attainment": s.met / s.requests if s.requests else None,
            "ttft_target_ms": targets[0],
            "tpot_target_ms": targets[1],
            "ttft_p50_ms": s.ttft_ms.percentile(50),
            "ttft_p90_ms": s.ttft_ms.percentile(90),
            "ttft_p99_ms": s.ttft_ms.percentile(99),
            "tpot_p50_ms": s.tpot_ms.percentile(50),
            "tpot_p99_ms": s.tpot_ms.percentile(99),
        }
    return out


def format_summary(rows: dict[str, dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    head = (
        f"{'class':<20} {'reqs':>6} {'met':>6} {'attain':>7} {'TTFT tgt':>9} {'p50':>7} {'p90':>7} {'p99':>7}"
        f" {'TPOT tgt':>9} {'p50':>6} {'p99':>6} {'miss ttft':>9} {'miss tpot':>9} {'errors':>6}"
    )
    lines = ["SLO attainment per class (TTFT / TPOT in ms, measured from the SSE stream)", head]
    total = met = 0
    for name, r in rows.items():
        total += r["requests"]
        met += r["met"]
        attain = "-" if r["attainment"] is None else f"{100 * r['attainment']:.1f}%"
        lines.append(
            f"{name:<20} {r['requests']:>6} {r['met']:>6} {attain:>7} {ms(r['ttft_target_ms']):>9}"
            f" {ms(r['ttft_p50_ms']):>7} {ms(r['ttft_p90_ms']):>7} {ms(r['ttft_p99_ms']):>7}"
            f" {ms(r['tpot_target_ms']):>9} {ms(r['tpot_p50_ms']):>6} {ms(r['tpot_p99_ms']):>6}"
            f" {r['missed_ttft']:>9} {r['missed_tpot']:>9} {r['errors']:>6}"
        )
    overall = "-" if not total else f"{100 * met / total:.1f}%"
    lines.append(f"{'all classes':<20} {total:>6} {met:>6} {overall:>7}")
    return "\n".join(lines)


# --- Locust hooks --------------------------------------------------------------------------


def _options(parser: Any) -> None:
    parser.add_argument(
        "--slo-profile", default="hyperflexis-4task", help="name in profiles/slo or a YAML path"
    )
    parser.add_argument("--slo-mix", default="", help="class=weight,... (default: the profile's tasks)")
    parser.add_argument("--workload", default="", help="loadtest/workloads name or path: lengths per task")
    parser.add_argument("--model", default="", help="model to ask for (default: the first of /v1/models)")
    parser.add_argument("--api-key", default="", help="client API key (Bearer)")
    parser.add_argument("--slo-report", default="", help="write the per-class summary here as JSON")


def _init(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    profile = load_profile(options.slo_profile if options else "hyperflexis-4task")
    lengths = workload_lengths((options.workload or None) if options else None, profile)
    MIX[:] = build_mix(profile, parse_mix(options.slo_mix if options else ""), lengths)


def _test_start(environment: Environment, **_: Any) -> None:
    RESULTS.reset()


def _report(client_id: str, data: dict[str, Any]) -> None:
    data["slo_classes"] = RESULTS.drain()


def _worker_report(client_id: str, data: dict[str, Any]) -> None:
    RESULTS.merge(data.get("slo_classes", {}))


def _test_stop(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    if isinstance(environment.runner, MasterRunner):
        time.sleep(0.5)  # the workers' last reports
    rows = summary(RESULTS, MIX)
    print(format_summary(rows), flush=True)
    options = environment.parsed_options
    if options is not None and options.slo_report:
        Path(options.slo_report).write_text(json.dumps(rows, indent=2))


def _listen(hook: Any, listener: Callable[..., None]) -> None:
    """``hook.add_listener(listener)``; Locust's event hooks carry no type hints."""
    hook.add_listener(listener)


_listen(events.init_command_line_parser, _options)
_listen(events.init, _init)
_listen(events.test_start, _test_start)
_listen(events.report_to_master, _report)
_listen(events.worker_report, _worker_report)
_listen(events.test_stop, _test_stop)


# --- the user ------------------------------------------------------------------------------


def sse_events(response: requests.Response) -> Iterator[bytes]:
    """The ``data:`` payloads of an SSE stream, as they arrive (no read-ahead buffering)."""
    buffer = b""
    for chunk in response.iter_content(chunk_size=None):
        buffer += chunk
        while True:
            cut = min((i for i in (buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            sep = 4 if buffer[cut : cut + 4] == b"\r\n\r\n" else 2
            event, buffer = buffer[:cut], buffer[cut + sep :]
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    yield line[5:].strip()


class SloUser(HttpUser):
    """Streams chat completions from the SLO task mix; weights pick the class of each request."""

    def on_start(self) -> None:
        self.rng = random.Random()
        key = self.environment.parsed_options.api_key if self.environment.parsed_options else ""
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        if "name" not in MODEL:
            wanted = self.environment.parsed_options.model if self.environment.parsed_options else ""
            if wanted:
                MODEL["name"] = wanted
            else:
                answer = self.client.get("/v1/models", headers=self.auth, name="/v1/models")
                MODEL["name"] = answer.json()["data"][0]["id"]

    @task
    def chat(self) -> None:
        t = self.rng.choices(MIX, weights=[m.weight for m in MIX])[0]
        body = {
            "model": MODEL["name"],
            "messages": [
                {"role": "user", "content": prompt_text(t.prompt_tokens.sample(self.rng), self.rng).strip()}
            ],
            "max_tokens": t.output_tokens.sample(self.rng),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {**self.auth, **t.headers}
        fire = self.environment.events.request.fire
        sent = time.perf_counter()
        first: float | None = None
        last: float | None = None
        content_events = 0
        usage_tokens: int | None = None
        targets: tuple[float, float] | None = None
        error: Exception | None = None
        done = False
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name=f"chat {t.name}",
        ) as response:
            try:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                ttft_h, tpot_h = response.headers.get("x-slo-ttft-ms"), response.headers.get("x-slo-tpot-ms")
                if ttft_h and tpot_h:
                    targets = (float(ttft_h), float(tpot_h))
                for data in sse_events(response):
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    for choice in chunk.get("choices") or ():
                        now = time.perf_counter()
                        first = (
                            now if first is None else first
                        )  # an engine's first event carries its first token
                        if (choice.get("delta") or {}).get("content"):
                            last = now
                            content_events += 1
                if first is None or not done:
                    raise RuntimeError(
                        "the stream ended early" if first is not None else "the stream carried no event"
                    )
                response.success()
            except (RuntimeError, ValueError, requests.RequestException) as exc:
                error = exc
                response.failure(exc)
        if error is not None or first is None:
            RESULTS.add(t.name, "error", None, None, targets)
            return
        ttft_ms = (first - sent) * 1000
        tokens = usage_tokens if usage_tokens is not None else content_events
        tpot_ms = (last - first) * 1000 / (tokens - 1) if tokens > 1 and last is not None else None
        fire(
            request_type="TTFT",
            name=t.name,
            response_time=ttft_ms,
            response_length=0,
            exception=None,
            context={},
        )
        if tpot_ms is not None:
            fire(
                request_type="TPOT",
                name=t.name,
                response_time=tpot_ms,
                response_length=tokens,
                exception=None,
                context={},
            )
        ttft_target, tpot_target = targets or (t.ttft_s * 1000, t.tpot_s * 1000)
        if ttft_ms > ttft_target:
            outcome = "missed_ttft"
        elif tpot_ms is not None and tpot_ms > tpot_target:
            outcome = "missed_tpot"
        else:
            outcome = "met"
        RESULTS.add(t.name, outcome, ttft_ms, tpot_ms, (ttft_target, tpot_target))
