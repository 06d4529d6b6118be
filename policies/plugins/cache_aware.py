"""Cache- and load-aware scorers: prefix match, KV utilisation, queue depth, running token load,
and the imbalance guard that lets load win over cache affinity.

Every scorer here returns scores in [0, 1], higher better, one per candidate in order, and reads
nothing but the request view and the snapshots it is given. The load-like ones are min-max
normalised across the candidates (the least loaded scores 1, the most loaded 0, all 1 when they
are equal), like ``least_load``: what matters for a placement is how engines compare now, not
the absolute figure, and weights in a profile then mean the same at any load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.api import EngineSnapshot, RequestView
from policies.registry import register


def _normalised_low_is_better(values: Sequence[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


def _per_weight(value: float, engine: EngineSnapshot) -> float:
    weight = engine.weight
    return value if weight == 1.0 else value / (weight if weight > 0 else 1.0)


@dataclass(frozen=True, slots=True)
class ImbalanceGuard:
    """Which engines are too loaded to be favoured for what they hold (cache or session).

    An engine is over the bound when its load exceeds the least loaded candidate's by more than
    ``max_spread`` requests *and* is more than ``max_ratio`` times it (SGLang's cache-aware router
    uses the same two thresholds, for the whole fleet). Applied per engine, not to the fleet: a
    session or a shared prefix keeps its engine while *that* engine is within the bound, and an
    engine that everyone's system prompt made hot stops attracting more the moment it passes it,
    so a prompt shared by most requests spreads over engines instead of piling onto the first.
    Loads are per unit of engine weight.
    """

    max_spread: float = 8.0
    max_ratio: float = 1.5

    def __post_init__(self) -> None:
        # (NaN passed both tests, and then no engine was ever over the bound: the guard was off)
        if not 0 <= self.max_spread < math.inf:
            raise ValueError(f"max_spread must be a finite number >= 0, got {self.max_spread}")
        if not 1 <= self.max_ratio < math.inf:
            raise ValueError(f"max_ratio must be a finite number >= 1, got {self.max_ratio}")

    def over(self, engines: Sequence[EngineSnapshot]) -> list[bool]:
        loads = [_per_weight(e.load, e) for e in engines]
        least = min(loads)
        return [x - least > self.max_spread and x > self.max_ratio * least for x in loads]


def _guard(max_spread: float | None, max_ratio: float) -> ImbalanceGuard | None:
    return None if max_spread is None else ImbalanceGuard(max_spread, max_ratio)


@register("scorer", "prefix_match")
class PrefixMatchScorer:
    """Fraction of the prompt an engine already holds in its prefix cache: the share of the
    prefill it would skip (``RequestView.prefix``; every engine 0 without it).

    With the imbalance guard (``max_spread`` requests, ``max_ratio``; ``max_spread: null`` turns
    it off), an engine over the bound scores 0 whatever it holds, so the load scorers decide.
    """

    def __init__(self, max_spread: float | None = 8.0, max_ratio: float = 1.5) -> None:
        self.guard = _guard(max_spread, max_ratio)

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        prefix = request.prefix
        if prefix is None or prefix.prompt_tokens <= 0:
            return [0.0] * len(engines)
        total = prefix.prompt_tokens
        cached = prefix.cached_tokens
        scores = [min(1.0, cached.get(e.engine_id, 0) / total) for e in engines]
        if self.guard is not None and any(scores):
            scores = [0.0 if over else s for s, over in zip(scores, self.guard.over(engines), strict=True)]
        return scores


@register("scorer", "kv_utilisation")
class KvUtilisation:
    """Prefers engines with less of their KV cache in use, relative to the other candidates:
    ``(max - u) / (max - min)`` of the reported ``kv_usage``. Unlike ``kv_free`` (``1 - u``),
    two engines at 40 % and 45 % score 1 and 0, so a small weight still separates them.
    Engines without a fresh reading score 0.5 and do not set the range."""

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        usage = [None if e.state is None or e.stale else e.state.kv_usage for e in engines]
        known = [u for u in usage if u is not None]
        if not known:
            return [0.5] * len(engines)
        lo, hi = min(known), max(known)
        if hi - lo < 1e-9:
            return [0.5 if u is None else 1.0 for u in usage]
        return [0.5 if u is None else (hi - u) / (hi - lo) for u in usage]


def queued(engine: EngineSnapshot) -> float:
    """Requests waiting on the engine, as well as the gateway can tell: the engine's own waiting
    count plus what this gateway sent since that scrape (not started yet, as far as anyone
    knows); without a fresh scrape, everything this gateway has in flight there."""
    state = engine.state
    if state is None or engine.stale:
        return float(engine.in_flight)
    return float(state.num_waiting + max(0, engine.in_flight - engine.in_flight_at_scrape))


@register("scorer", "queue_depth")
class QueueDepth:
    """Prefers engines with fewer requests waiting (not running): :func:`queued`, per unit of
    engine weight, min-max normalised. Waiting requests are what a new one queues behind for its
    first token; running ones only slow its steps."""

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        return _normalised_low_is_better([_per_weight(queued(e), e) for e in engines])


@register("scorer", "token_load")
class TokenLoad:
    """Prefers engines with fewer tokens in their running batch from this gateway
    (``EngineSnapshot.running_tokens``: prompts plus what was generated so far), per unit of
    engine weight, min-max normalised: a request count treats a 30,000-token prompt and a
    30-token one alike, a token count does not (Gimbal's RunningLoad)."""

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        return _normalised_low_is_better([_per_weight(float(e.running_tokens), e) for e in engines])
