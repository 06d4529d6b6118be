"""Gimbal's DP-engine selection (Algorithm 1 of "Gimbal: multilayer MoE scheduling"), as a picker.

The algorithm, line by line::

    1   e* <- next engine (round robin)
    2   if metric data available:
    3-4     i_max, i_min <- argmax, argmin KVusage
    5       if KVusage[i_max] >= theta_kv:
    6-7         if KVusage[i_max] - KVusage[i_min] >= theta_diff: e* <- i_min
    8-13        elif max RunningLoad - min RunningLoad > theta_load: e* <- argmin RunningLoad
    15-17   elif the request has a user and user_engine_map[user] has not expired: e* <- it
    21  user_engine_map[user] <- e*

Here: ``KVusage`` is each engine's scraped ``kv_usage``; "metric data available" means every
candidate has a fresh scrape; ``RunningLoad`` (running and waiting tokens) is the gateway's
``EngineSnapshot.running_tokens``; the user-engine map is the router's affinity store, read
into ``RequestView.affinity`` (its TTL is the expiry) and written back with every choice, which
is line 21. Affinity applies only while no engine is over theta_kv, as in the paper, since
sticking to a user's engine while caches fill would pile more onto the fullest.

Ties in the argmax / argmin are broken at random (explicit generator state), never by the order
the engines come in. The paper's thresholds are the defaults: theta_kv 0.9, theta_diff 0.1,
theta_load 3000 tokens ("comparable to a single typical request").

``max_spread`` (off by default, to stay the paper's algorithm) adds the imbalance guard to line
17: the user's engine is not chosen while it is over the load bound (see
:class:`~policies.plugins.cache_aware.ImbalanceGuard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.api import EngineSnapshot, RequestView
from policies.plugins.cache_aware import ImbalanceGuard
from policies.plugins.pickers import random_choice
from policies.registry import register

#: the ">=" thresholds allow for float rounding: usages of 0.9 and 0.8 differ by theta_diff 0.1,
#: though 0.9 - 0.8 is 0.09999999999999998
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class GimbalState:
    """``turn``: picks made (line 1's round robin); ``rng``: the tie-breaking generator."""

    turn: int = 0
    rng: int = 0


@dataclass(frozen=True, slots=True)
class GimbalParams:
    theta_kv: float = 0.9
    theta_diff: float = 0.1
    theta_load: float = 3000.0
    guard: ImbalanceGuard | None = None


def _extreme(values: Sequence[float], largest: bool, rng: int) -> tuple[int, int]:
    """Index of the largest (smallest) value, ties broken at random."""
    target = max(values) if largest else min(values)
    tied = [i for i, v in enumerate(values) if v == target]
    pick, rng = random_choice(len(tied), rng)
    return tied[pick], rng


def select(
    request: RequestView, engines: Sequence[EngineSnapshot], params: GimbalParams, state: GimbalState
) -> tuple[EngineSnapshot, str, GimbalState]:
    """Algorithm 1 over ``engines`` (non-empty): the engine, which line chose it
    (``round_robin``, ``kv_least``, ``load_least``, ``affinity``) and the next state."""
    ordered = sorted(engines, key=lambda e: e.engine_id)
    chosen, reason = ordered[state.turn % len(ordered)], "round_robin"
    rng = state.rng
    if all(e.state is not None and not e.stale for e in engines):
        kv = [e.state.kv_usage if e.state is not None else 0.0 for e in engines]
        i_max, rng = _extreme(kv, True, rng)
        if kv[i_max] >= params.theta_kv - _EPS:
            i_min, rng = _extreme(kv, False, rng)
            if kv[i_max] - kv[i_min] >= params.theta_diff - _EPS:
                chosen, reason = engines[i_min], "kv_least"
            else:
                load = [float(e.running_tokens) for e in engines]
                if max(load) - min(load) > params.theta_load:
                    i_least, rng = _extreme(load, False, rng)
                    chosen, reason = engines[i_least], "load_least"
        elif request.affinity is not None and request.affinity.engine_id is not None:
            target = request.affinity.engine_id
            over = params.guard.over(engines) if params.guard is not None else [False] * len(engines)
            for engine, too_loaded in zip(engines, over, strict=True):
                if engine.engine_id == target and not too_loaded:
                    chosen, reason = engine, "affinity"
                    break
    return chosen, reason, GimbalState(state.turn + 1, rng)


@register("picker", "gimbal")
class Gimbal:
    """Gimbal's Algorithm 1 (see the module docstring); ignores the pipeline's scores."""

    def __init__(
        self,
        theta_kv: float = 0.9,
        theta_diff: float = 0.1,
        theta_load: float = 3000.0,
        seed: int = 0,
        max_spread: float | None = None,
        max_ratio: float = 1.5,
    ) -> None:
        if not 0.0 <= theta_kv <= 1.0:
            raise ValueError(f"theta_kv must be in [0, 1], got {theta_kv}")
        if not 0.0 <= theta_diff <= 1.0:
            raise ValueError(f"theta_diff must be in [0, 1], got {theta_diff}")
        if theta_load < 0:
            raise ValueError(f"theta_load must be >= 0, got {theta_load}")
        guard = None if max_spread is None else ImbalanceGuard(max_spread, max_ratio)
        self.params = GimbalParams(theta_kv, theta_diff, theta_load, guard)
        self.seed = seed

    def initial_state(self) -> object:
        return GimbalState(0, self.seed)

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]:
        current = state if isinstance(state, GimbalState) else GimbalState(0, self.seed)
        chosen, _, new_state = select(request, engines, self.params, current)
        return chosen, new_state
