"""Load-based filters and scorers."""

from __future__ import annotations

from collections.abc import Sequence

from policies.api import EngineSnapshot, RequestView
from policies.registry import register


@register("scorer", "least_load")
class LeastLoad:
    """Prefers engines with fewer queued + running requests (gateway shadow + engine metrics).

    Score is ``(max - load) / (max - min)`` across candidates, 1.0 when all are equal, so the
    emptiest engine scores 1 and the fullest 0 whatever the absolute numbers are. Engine weights
    divide the load, so an engine of weight 2 looks half as loaded.
    """

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        loads = list(map(self.rank_key, engines))
        lo, hi = min(loads), max(loads)
        if hi - lo < 1e-9:
            return [1.0] * len(loads)
        return [(hi - x) / (hi - lo) for x in loads]

    @staticmethod
    def rank_key(engine: EngineSnapshot) -> float:
        """The one quantity the score falls with: the engines scoring 1 are exactly those of the
        smallest key, so a caller holding engines ordered by it can skip scoring them all."""
        weight = engine.weight
        return engine.load if weight == 1.0 else engine.load / (weight if weight > 0 else 1.0)


@register("scorer", "kv_free")
class KvFree:
    """Prefers engines with more free KV cache: ``1 - kv_usage`` (0.5 when unknown)."""

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        return [0.5 if e.state is None or e.stale else 1.0 - e.state.kv_usage for e in engines]


@register("filter", "not_saturated")
class NotSaturated:
    """Drops engines whose estimated load is at or above ``max_load``, unless all are.

    Keeping the saturated engines when nothing else is left leaves the decision to queue or shed
    to the dispatcher instead of failing the request here.
    """

    def __init__(self, max_load: int = 256) -> None:
        if max_load < 1:
            raise ValueError(f"max_load must be >= 1, got {max_load}")
        self.max_load = max_load

    def filter(
        self, request: RequestView, engines: Sequence[EngineSnapshot], now: float
    ) -> Sequence[EngineSnapshot]:
        kept = [e for e in engines if e.load < self.max_load]
        return kept or engines
