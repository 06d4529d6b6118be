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


_MASK64 = (1 << 64) - 1


def split_mix(state: int) -> tuple[int, int]:
    """One draw of SplitMix64: a uniform 64-bit value and the next state. The whole generator is
    one int a picker returns as its state, so a decision can be replayed from it exactly (no
    ``random`` module state, which other code shares)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31), state


def random_choice(count: int, state: int) -> tuple[int, int]:
    """A uniform index below ``count`` and the next state (no draw for a single choice)."""
    if count <= 1:
        return 0, state
    value, state = split_mix(state)
    return value % count, state  # bias below 2^-50 for any realistic count


@register("picker", "max_score_random")
class MaxScoreRandom:
    """Highest total score wins; ties are broken uniformly at random.

    Unlike ``max_score``'s rotation in the engines' order, nothing here depends on the order
    engines are listed in: with affinity or prefix scorers, engines tie mostly when none holds
    anything (a cache miss), and a rotation that restarts from the same engine after every
    decided pick would hand every miss to the first engines in the list. State: the generator
    state (an int), seeded by ``seed``.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed & _MASK64

    def initial_state(self) -> object:
        return self.seed

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]:
        rng = state if isinstance(state, int) else self.seed
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s >= best - 1e-9]
        index, rng = random_choice(len(tied), rng)
        return tied[index], rng
