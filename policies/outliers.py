"""An engine that fails request after request while its health route answers: taken out of
rotation for a while (outlier ejection, as service meshes do it).

A health check asks whether the engine answers, not whether its answers are any good: an engine
whose model failed to load right, whose GPU throws, or which answers 500 to every completion keeps
passing it. Under least-load routing it is worse than a dead one: failing at once, it is always
the least loaded, and takes every request first. After ``consecutive_failures`` failed requests
in a row (no success between) the engine is out for ``base_ejection_s``, doubled for each
ejection in a row up to ``max_ejection_s``; back in, one more failure takes it out again, and
one success clears it. Never more than ``max_ejected_share`` of a pool, and never its last engine:
a fault that is the requests' own (every engine fails them) must not empty the fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutlierParams:
    #: failed requests in a row that take an engine out (0: never)
    consecutive_failures: int = 5
    base_ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    #: at most this share of a pool's engines out at once (stalled ones included)
    max_ejected_share: float = 0.5

    def __post_init__(self) -> None:
        if self.consecutive_failures < 0:
            raise ValueError("consecutive_failures must be >= 0")
        if not (0 < self.base_ejection_s <= self.max_ejection_s and math.isfinite(self.max_ejection_s)):
            raise ValueError("ejection times must be finite, with 0 < base_ejection_s <= max_ejection_s")
        if not 0.0 <= self.max_ejected_share <= 1.0:
            raise ValueError("max_ejected_share must be within [0, 1]")


def ejection_s(params: OutlierParams, ejections: int) -> float:
    """How long the ``ejections``-th ejection in a row (1 the first) lasts."""
    return min(params.max_ejection_s, params.base_ejection_s * 2.0 ** max(0, min(ejections - 1, 30)))


def may_eject(params: OutlierParams, out_already: int, pool: int) -> bool:
    """Whether one more engine of a pool of ``pool`` engines (healthy and not draining), of which
    ``out_already`` are out of rotation (stalled or ejected), may be ejected."""
    return (
        params.consecutive_failures > 0
        and out_already + 1 < pool  # (one at least stays in rotation)
        and out_already + 1 <= params.max_ejected_share * pool
    )
