"""What peer routers do by default, as plugins, so comparisons are made against them.

- ``sglang_cache_aware`` (picker): SGLang's router (sgl-router / SMG ``cache_aware``). When the
  load is imbalanced (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold x
  min``, in requests) the least loaded worker; otherwise the worker whose prefix tree matches the
  most of the prompt if that match rate exceeds ``cache_threshold``, else the worker with the
  most room for new prefixes. Defaults are SGLang's: 0.3, 64, 1.5. Its tree is approximate (fed
  by the router's own dispatches, evicted by LRU); here the match comes from the gateway's prefix
  index (``RequestView.prefix``), and "the smallest tree" is read as the emptiest KV cache
  (the engine's reported use; running tokens when unscraped), which is what the tree size stands
  for.
- ``dynamo_cost`` (scorer): NVIDIA Dynamo's KV router cost, ``overlap_weight x prefill tokens
  still to compute (prompt less the cached overlap) + the worker's active decode tokens``,
  lowest best (its default temperature 0: the argmin, random among ties). Dynamo counts blocks;
  tokens here (the same ratios). Min-max normalised so a ``max_score*`` picker takes the argmin.

llm-d's default weighted scorers need no new plugin: ``prefix_match`` (no guard), ``kv_free``
(``1 - kv_usage``, its kv-cache-utilization scorer) and ``queue_depth`` (its queue scorer, min-max
over waiting requests), weights 3 / 2 / 2 (``profiles/routing/llm-d.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.api import EngineSnapshot, RequestView
from policies.plugins.pickers import random_choice
from policies.registry import register

_MASK64 = (1 << 64) - 1


def _cached(request: RequestView, engine: EngineSnapshot) -> int:
    prefix = request.prefix
    return 0 if prefix is None else prefix.cached_tokens.get(engine.engine_id, 0)


def _room(engine: EngineSnapshot) -> float:
    """How full the engine's cache is (lower: more room)."""
    if engine.state is not None and not engine.stale:
        return engine.state.kv_usage
    return 1.0 + engine.running_tokens  # unscraped: after every scraped engine, by running tokens


@register("picker", "sglang_cache_aware")
class SglangCacheAware:
    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64.0,
        balance_rel_threshold: float = 1.5,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.seed = seed & _MASK64

    def initial_state(self) -> object:
        return self.seed

    def _among(self, engines: list[EngineSnapshot], state: object) -> tuple[EngineSnapshot, object]:
        rng = state if isinstance(state, int) else self.seed
        index, rng = random_choice(len(engines), rng)
        return engines[index], rng

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]:
        loads = [e.load for e in engines]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self._among([e for e in engines if e.load <= lo], state)
        prefix = request.prefix
        if prefix is not None and prefix.prompt_tokens > 0:
            rates = [_cached(request, e) / prefix.prompt_tokens for e in engines]
            best = max(rates)
            if best > self.cache_threshold:
                holders = [e for e, r in zip(engines, rates, strict=True) if r >= best - 1e-12]
                return self._among(holders, state)
        rooms = [_room(e) for e in engines]
        least = min(rooms)
        return self._among([e for e, r in zip(engines, rooms, strict=True) if r <= least + 1e-12], state)


@register("scorer", "dynamo_cost")
class DynamoCost:
    def __init__(self, overlap_weight: float = 1.0) -> None:
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight

    def costs(self, request: RequestView, engines: Sequence[EngineSnapshot]) -> list[float]:
        prompt = request.prefix.prompt_tokens if request.prefix is not None else request.prompt_tokens
        return [
            self.overlap_weight * max(0, prompt - _cached(request, e)) + e.running_tokens for e in engines
        ]

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        costs = self.costs(request, engines)
        lo, hi = min(costs), max(costs)
        if hi - lo < 1e-9:
            return [1.0] * len(costs)
        return [(hi - c) / (hi - lo) for c in costs]
