"""The filter -> weighted scorer -> picker pipeline (the baseline dispatcher).

Each scorer returns scores in [0, 1]; they are clamped and summed with the profile's weights. The
picker then chooses among the surviving engines. The pipeline is a value: build it once at start-up
from a routing profile, then call :meth:`RoutingPipeline.choose` per request with a snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from policies import plugins as _plugins  # noqa: F401  (registers the built-in plugins)
from policies.api import (
    EngineSnapshot,
    Filter,
    Picker,
    PolicyConfigError,
    RequestView,
    Scorer,
)
from policies.registry import build


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class RoutingPipeline:
    """A compiled routing profile. Stateless apart from the picker state the caller threads."""

    filters: tuple[tuple[str, Filter], ...]
    scorers: tuple[WeightedScorer, ...]
    picker_name: str
    picker: Picker

    def rank_key(self) -> Callable[[EngineSnapshot], float] | None:
        """When this pipeline picks by one key alone, that key (lower is better); else None.

        True for no filters, a single weighted scorer that declares a ``rank_key`` (its score is
        1 exactly for the engines of the smallest key) and the ``max_score`` picker: the winner is
        then among the smallest-key engines, ties rotated by the picker. A caller that keeps
        engines ordered by the key can hand the picker just those (the fleet's ranked index).
        """
        if self.filters or len(self.scorers) != 1 or self.scorers[0].weight <= 0.0:
            return None
        if self.picker_name != "max_score":
            return None
        key = getattr(self.scorers[0].scorer, "rank_key", None)
        return key if callable(key) else None

    def choose(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        state: object,
        now: float,
    ) -> tuple[EngineSnapshot | None, object]:
        """Run filters, scorers and the picker over ``engines`` (already the candidates).

        Returns ``(None, state)`` when no engine survives the filters.
        """
        for _, plugin in self.filters:
            engines = plugin.filter(request, engines, now)
            if not engines:
                return None, state
        first: Sequence[float] | None = None
        if len(self.scorers) == 1 and self.scorers[0].weight == 1.0:
            # one scorer: its scores are the totals once known to be in [0, 1] (two C-level
            # passes instead of a Python one per engine: this runs on every placement)
            scores = self.scorers[0].scorer.score(request, engines, now)
            if len(scores) != len(engines):
                name = self.scorers[0].name
                raise ValueError(f"scorer {name!r} returned {len(scores)} scores for {len(engines)} engines")
            if scores and min(scores) >= 0.0 and max(scores) <= 1.0:
                return self.picker.pick(request, engines, scores, state)
            first = scores
        totals: list[float] = [0.0] * len(engines)
        for ws in self.scorers:
            w = ws.weight
            scores = first if first is not None else ws.scorer.score(request, engines, now)
            totals = [
                t + w * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
                for t, s in zip(totals, scores, strict=True)
            ]
        return self.picker.pick(request, engines, totals, state)

    def explain(
        self, request: RequestView, engines: Sequence[EngineSnapshot], engine_id: str, now: float
    ) -> list[tuple[str, float]]:
        """Each scorer's score (clamped to [0, 1], unweighted) of ``engine_id`` among ``engines``
        after the filters, and their weighted total (``total``); empty when the engine is not
        among them. The same scorer calls :meth:`choose` makes, for a decision's explanation."""
        for _, plugin in self.filters:
            engines = plugin.filter(request, engines, now)
        at = next((i for i, e in enumerate(engines) if e.engine_id == engine_id), None)
        if at is None:
            return []
        out: list[tuple[str, float]] = []
        total = 0.0
        for ws in self.scorers:
            raw = ws.scorer.score(request, engines, now)[at]
            value = 0.0 if raw < 0.0 else 1.0 if raw > 1.0 else float(raw)
            out.append((ws.name, value))
            total += ws.weight * value
        if self.scorers:
            out.append(("total", total))
        return out


#: what an entry of a routing profile may say: a misspelt key (``parms``, ``wieght``, a seed
#: beside ``params``) was ignored, and the plugin ran on its defaults without a word
_PLUGIN_KEYS = frozenset({"name", "params"})
_ENTRY_KEYS = frozenset({"name", "params", "weight"})


def _known_keys(where: str, entry: Mapping[str, Any], allowed: frozenset[str]) -> None:
    extra = sorted(map(str, set(entry) - allowed))
    if extra:
        raise PolicyConfigError(
            f"routing profile {where} has unknown keys {extra}; allowed: {sorted(allowed)}"
        )


def compile_profile(profile: Mapping[str, Any]) -> RoutingPipeline:
    """Build a pipeline from a routing profile mapping (already parsed YAML).

    Shape::

        filters: [{name: ..., params: {...}}]
        scorers: [{name: ..., weight: 1.0, params: {...}}]
        picker: {name: max_score, params: {...}}
    """
    allowed = {
        "name",
        "description",
        "dispatcher",
        "queue_order",
        "engine_scheduling",
        "shedding",
        "disaggregation",
        "decode_placement",
        "kv_transfer",
        "filters",
        "scorers",
        "picker",
    }
    extra = sorted(set(profile) - allowed)
    if extra:
        raise PolicyConfigError(f"routing profile has unknown keys {extra}; allowed: {sorted(allowed)}")

    def entries(key: str) -> list[Mapping[str, Any]]:
        value = profile.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) and "name" in v for v in value):
            raise PolicyConfigError(f"routing profile {key!r} must be a list of {{name: ..., params: ...}}")
        for entry in value:
            _known_keys(
                f"{key} entry {entry['name']!r}", entry, _ENTRY_KEYS if key == "scorers" else _PLUGIN_KEYS
            )
        return value

    filters = tuple(
        (str(f["name"]), cast(Filter, build("filter", str(f["name"]), f.get("params"))))
        for f in entries("filters")
    )
    scorers = []
    for s in entries("scorers"):
        weight = s.get("weight", 1.0)
        # (inf x a score of 0 is NaN, and a NaN total broke every pick: .nan and .inf are YAML)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
            raise PolicyConfigError(
                f"scorer {s['name']!r}: weight must be a finite number >= 0, got {weight!r}"
            )
        scorer = cast(Scorer, build("scorer", str(s["name"]), s.get("params")))
        scorers.append(WeightedScorer(str(s["name"]), scorer, float(weight)))
    picker_entry = profile.get("picker") or {"name": "max_score"}
    if not isinstance(picker_entry, Mapping) or "name" not in picker_entry:
        raise PolicyConfigError("routing profile 'picker' must be {name: ..., params: ...}")
    _known_keys("picker", picker_entry, _PLUGIN_KEYS)
    picker = cast(Picker, build("picker", str(picker_entry["name"]), picker_entry.get("params")))
    return RoutingPipeline(filters, tuple(scorers), str(picker_entry["name"]), picker)
