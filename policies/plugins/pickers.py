"""Pickers: choose one engine from scored candidates."""

from __future__ import annotations

from collections.abc import Sequence

from policies.api import EngineSnapshot, RequestView
from policies.registry import register


@register("picker", "round_robin")
class RoundRobin:
    """Cycles through candidates in engine-id order, ignoring scores.

    State is a counter of picks so far; with a changing candidate set it still spreads evenly,
    because the index is taken modulo the current number of candidates.
    """

    def initial_state(self) -> object:
        return 0

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]:
        counter = state if isinstance(state, int) else 0
        ordered = sorted(engines, key=lambda e: e.engine_id)
        return ordered[counter % len(ordered)], counter + 1


@register("picker", "max_score")
class MaxScore:
    """Highest total score wins; ties rotate so equal engines share the load.

    State is a counter used only to break ties, so identical engines are not hot-spotted by
    always taking the first one. Ties rotate in the order the engines are given.
    """

    def initial_state(self) -> object:
        return 0

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]:
        counter = state if isinstance(state, int) else 0
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s >= best - 1e-9]
        index, state = self.rotate(len(tied), counter)
        return tied[index], state

    @staticmethod
    def rotate(tied: int, state: object) -> tuple[int, object]:
        """Which of ``tied`` equally good engines (in the order given) goes next, and the new
        state. Ties rotate in the order the engines come (the fleet's, stable): sorting them by id
        on every placement cost more than the rest of the pick at 256 engines."""
        counter = state if isinstance(state, int) else 0
        if tied == 1:
            return 0, counter
        return counter % tied, counter + 1
