"""LoRA affinity: a request naming a LoRA adapter goes to engines that have it loaded.

An engine serves an adapter only if it has loaded it: vLLM answers 404 for an adapter it has not
loaded (it loads one at runtime only when told, ``POST /v1/load_lora_adapter``, or through a LoRA
resolver plugin), and an engine that does load on demand pays for the load on the request's first
token. The engines' loaded adapters come from their ``/v1/models`` (``EngineSnapshot.adapters``),
the request's adapter from its ``model`` (``RequestView.lora``).

One plugin, two kinds:

* the **filter** ``lora_affinity`` keeps the engines that have the request's adapter loaded when
  any candidate has it (all of them when none has: an adapter just loaded that the monitor has
  not read yet, or a fleet that loads adapters on demand); with ``load_on_demand: true`` it keeps
  every engine. Requests to a base model pass through untouched. The gateway's router applies
  this filter to every adapter request under every profile, before anything else (the profile's
  own ``lora_affinity`` filter and its parameters when it lists one, else the default), so no
  profile sends an adapter request to an engine that would answer 404;
* the **scorer** ``lora_affinity`` scores 1 where the adapter is loaded and 0 elsewhere, under
  the imbalance guard (``max_spread`` requests and ``max_ratio``, as ``prefix_match``): with
  ``load_on_demand`` it prefers the engines that need no load, unless they are overloaded. Every
  engine scores 0 for a base-model request.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.api import EngineSnapshot, RequestView
from policies.plugins.cache_aware import ImbalanceGuard
from policies.registry import register

#: the plugin's name, as a filter and as a scorer
NAME = "lora_affinity"


def with_adapter(engines: Sequence[EngineSnapshot], lora: str | None) -> Sequence[EngineSnapshot]:
    """The engines that have ``lora`` loaded, when any has; ``engines`` itself otherwise (and for
    ``None``, a base-model request)."""
    if lora is None:
        return engines
    holding = [e for e in engines if lora in e.adapters]
    return holding if holding else engines


class LoraAffinity:
    """See the module doc. ``load_on_demand``: the engines load an adapter they lack when a
    request names it, so none is filtered out (the scorer then prefers those that have it)."""

    def __init__(
        self, load_on_demand: bool = False, max_spread: float | None = 8.0, max_ratio: float = 1.5
    ) -> None:
        if not isinstance(load_on_demand, bool):
            raise ValueError(f"load_on_demand must be true or false, got {load_on_demand!r}")
        self.load_on_demand = load_on_demand
        self.guard = None if max_spread is None else ImbalanceGuard(max_spread, max_ratio)

    @property
    def required(self) -> bool:
        """Whether an adapter request must go to an engine that has the adapter (when any has)."""
        return not self.load_on_demand

    def filter(
        self, request: RequestView, engines: Sequence[EngineSnapshot], now: float
    ) -> Sequence[EngineSnapshot]:
        if self.load_on_demand:
            return engines
        return with_adapter(engines, request.lora)

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> list[float]:
        lora = request.lora
        if lora is None:
            return [0.0] * len(engines)
        scores = [1.0 if lora in e.adapters else 0.0 for e in engines]
        if self.guard is None or not any(scores):
            return scores
        return [0.0 if over else s for s, over in zip(scores, self.guard.over(engines), strict=True)]


register("filter", NAME)(LoraAffinity)
register("scorer", NAME)(LoraAffinity)
