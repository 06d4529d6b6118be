"""What the built-in status page shows: ``GET /dashboard`` (one self-contained HTML page) and the JSON
it polls, ``GET /dashboard/state``.

For people running ``slogate up`` without Prometheus: the fleet (health, load, KV), queue depth per
model and SLO class, attainment per class (since start and over the last minute) and the recent
dispatch decisions. Everything is read when the page asks: the data path pays only the decision
log's append (:mod:`gateway.dashboard.decisions`).

The page fetches nothing from elsewhere: its script and style are inline, and its
Content-Security-Policy admits exactly those (by hash) and requests to this origin.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import time
from collections import deque
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from gateway import metrics
from gateway.api.errors import GatewayError, bad_request, described
from gateway.serving.collocated import dispatcher_name

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["PAGE", "PAGE_HEADERS", "STATE_HEADERS", "Attainment", "dashboard_state", "parse_state_query"]

#: SLO outcomes that count as the gateway's result for a request; ``cancelled`` (the client left)
#: is shown but is neither a hit nor a miss
_JUDGED = ("met", "missed_ttft", "missed_tpot", "missed_latency", "rejected", "error")
#: how far back "live" attainment looks
WINDOW_S = 60.0
#: the most decisions one answer carries, whatever the log keeps (100,000 at most): the page shows
#: a few dozen, and 100,000 made and encoded at once held the event loop for a good part of a second
MAX_DECISIONS = 1000


def _load_page() -> tuple[bytes, str]:
    page = resources.files("gateway.dashboard").joinpath("page.html").read_text(encoding="utf-8")

    def digest(kind: str) -> str:
        blocks = re.findall(rf"<{kind}>(.*?)</{kind}>", page, flags=re.S)
        return " ".join(
            "'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'" for b in blocks
        )

    policy = (
        f"default-src 'none'; script-src {digest('script')}; style-src {digest('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return page.encode(), policy


PAGE, _POLICY = _load_page()
PAGE_HEADERS = {
    "content-security-policy": _POLICY,
    "x-content-type-options": "nosniff",
    # (frame-ancestors is in the policy; browsers that predate it read this instead)
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
#: what the page's data route answers with, errors included
STATE_HEADERS = {"x-content-type-options": "nosniff", "cache-control": "no-store"}


def parse_state_query(query: Mapping[str, str], limit: int) -> int:
    """How many recent decisions ``/dashboard/state`` returns (``?decisions=N``, default 50, at
    most what the log keeps); a bad or unknown parameter is a 400."""
    unknown = sorted(set(query) - {"decisions"})
    if unknown:
        raise bad_request(
            f"unknown query parameter {described(unknown[0])}; accepted: decisions", unknown[0][:64]
        )
    raw = query.get("decisions")
    if raw is None:
        return min(50, limit)
    if not raw.isascii() or not raw.isdigit():
        raise bad_request("decisions must be a whole number", "decisions")
    # (as many digits as anyone sends: a whole number past what is kept is capped like any other,
    # and the answer never holds more than MAX_DECISIONS, made and encoded on the event loop)
    digits = raw.lstrip("0") or "0"
    asked = int(digits) if len(digits) <= 7 else MAX_DECISIONS
    return min(asked, limit, MAX_DECISIONS)


class Attainment:
    """SLO outcomes per class since start, and over the last :data:`WINDOW_S` seconds as seen by
    the page's polls (the counters are read when asked; nothing is recorded per request)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._history: deque[tuple[float, dict[tuple[str, ...], float]]] = deque()

    def read(self, now: float) -> tuple[dict[tuple[str, ...], float], dict[tuple[str, ...], float], float]:
        """(totals, counts within the window, the window's actual length in seconds)."""
        totals = _samples(metrics.SLO_REQUESTS, "slo_class", "outcome")
        history = self._history
        if not history or now - history[-1][0] >= 1.0:
            history.append((now, totals))
        # keep one snapshot at or before the window's start as the baseline
        while len(history) > 1 and history[1][0] <= now - self.window_s:
            history.popleft()
        since, base = history[0]
        window = {k: v - base.get(k, 0.0) for k, v in totals.items() if v - base.get(k, 0.0) > 0}
        return totals, window, now - since


def _samples(metric: Any, *labels: str, suffix: str = "_total") -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    metrics.flush_deferred()  # (the request path's updates wait for a collection: this is one)
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                key = tuple(sample.labels[label] for label in labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _ratio(counts: Mapping[str, float]) -> float | None:
    judged = sum(counts.get(o, 0.0) for o in _JUDGED)
    return None if judged == 0 else counts.get("met", 0.0) / judged


def _mean_ms(sums: Mapping[tuple[str, ...], float], counts: Mapping[tuple[str, ...], float], cls: str) -> Any:
    total = sum(v for k, v in sums.items() if k[0] == cls)
    n = sum(v for k, v in counts.items() if k[0] == cls)
    return None if n == 0 else round(total / n * 1000.0, 3)


def _classes(gateway: Gateway, attainment: Attainment) -> tuple[list[dict[str, Any]], float]:
    totals, window, window_s = attainment.read(time.monotonic())
    profile = gateway.slo.profile
    targets: dict[str, tuple[float | None, float | None]] = {
        name: (c.ttft_s, c.tpot_s) for name, c in profile.classes.items()
    }
    if profile.priority is not None:
        for level in profile.priority.levels:
            targets[level.name] = (None, None)  # mapped per request, within the level's bounds
    seen = {cls for cls, _ in totals}
    ttft_sum = _samples(metrics.TTFT, "slo_class", suffix="_sum")
    ttft_n = _samples(metrics.TTFT, "slo_class", suffix="_count")
    tpot_sum = _samples(metrics.TPOT, "slo_class", suffix="_sum")
    tpot_n = _samples(metrics.TPOT, "slo_class", suffix="_count")
    out = []
    for cls in sorted(set(targets) | seen):
        outcomes = {o: totals.get((cls, o), 0.0) for o in (*_JUDGED, "cancelled")}
        recent = {o: window.get((cls, o), 0.0) for o in (*_JUDGED, "cancelled")}
        ttft_s, tpot_s = targets.get(cls, (None, None))
        out.append(
            {
                "slo_class": cls,
                "ttft_target_ms": None if ttft_s is None else round(ttft_s * 1000.0, 3),
                "tpot_target_ms": None if tpot_s is None else round(tpot_s * 1000.0, 3),
                "requests": int(sum(outcomes.values())),
                "outcomes": {k: int(v) for k, v in outcomes.items()},
                "attainment": _ratio(outcomes),
                "window_requests": int(sum(recent.values())),
                "window_attainment": _ratio(recent),
                "ttft_mean_ms": _mean_ms(ttft_sum, ttft_n, cls),
                "tpot_mean_ms": _mean_ms(tpot_sum, tpot_n, cls),
            }
        )
    return out, window_s


def _engines(gateway: Gateway) -> list[dict[str, Any]]:
    fleet = gateway.fleet
    if fleet is None:
        return []
    now = time.monotonic()
    stale = {e.engine_id: e.stale for e in fleet.snapshot().engines}
    out = []
    for record in fleet.records.values():
        state = record.state
        out.append(
            {
                "id": record.engine_id,
                "model": record.model,
                "kind": record.adapter.kind,
                "role": record.adapter.role.value,
                "healthy": record.healthy,
                # out of rotation while healthy: being drained (a role flip) or stalled
                "draining": record.draining,
                "stalled": record.stalled,
                "ejected": record.tripped,
                "role_unsure": record.role_unsure,
                "in_rotation": fleet.in_front(record) or fleet.in_decode_pool(record),
                "in_flight": record.in_flight,
                "running": None if state is None else state.num_running,
                "waiting": None if state is None else state.num_waiting,
                "kv_usage": None if state is None else state.kv_usage,
                "free_kv_tokens": record.free_kv_tokens(),
                "sleeping": None if state is None else state.sleeping,
                "state_age_s": None if state is None else round(now - record.state_at, 3),
                "state_stale": stale.get(record.engine_id, True),
                "last_error": record.last_error or None,
            }
        )
    return out


def _queues(gateway: Gateway) -> list[dict[str, Any]]:
    if gateway.dispatch is None:
        return []
    per_class = gateway.dispatch.core.queued_per_class
    return [
        {"model": model, "slo_class": cls, "depth": depth}
        for (model, cls), depth in sorted(per_class.items())
    ]


def dashboard_state(
    gateway: Gateway, attainment: Attainment, decisions: int, full: bool = True
) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data. Not ``full`` (a caller without an admin key
    of a gateway with keys, ``dashboard_public``): what ``/metrics`` would show it, not the
    clients' request ids or the engines' errors (which name internal addresses)."""
    if gateway.fleet is None:
        raise GatewayError(503, "gateway is starting", code="not_ready", retry_after_s=1.0)
    classes, window_s = _classes(gateway, attainment)
    requests = _samples(metrics.REQUESTS, "status")
    sheds = _samples(metrics.SHEDS, "reason")
    engines = _engines(gateway)
    queues = _queues(gateway)
    log = gateway.decisions
    recent = [] if log is None else log.recent(decisions)
    if not full:
        for engine in engines:
            engine["last_error"] = None if engine["last_error"] is None else "(needs a key)"
        for decision in recent:
            decision["client_request_id"] = None
    return {
        "time": time.time(),
        "uptime_s": round(time.time() - gateway.started_at, 3),
        "dispatcher": dispatcher_name(gateway.settings),
        "slo_profile": gateway.slo.profile.name,
        "totals": {
            "requests": int(sum(requests.values())),
            "by_status": {k[0]: int(v) for k, v in sorted(requests.items())},
            "in_flight": sum(e["in_flight"] for e in engines),
            "queued": sum(q["depth"] for q in queues),
            "sheds": int(sum(sheds.values())),
            "decisions": 0 if log is None else log.total,
        },
        "sheds": {k[0]: int(v) for k, v in sorted(sheds.items())},
        "engines": engines,
        "queues": queues,
        "classes": classes,
        "window_s": round(window_s, 3) if math.isfinite(window_s) else None,
        "decisions": recent,
    }
