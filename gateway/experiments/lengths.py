"""Token-length distributions for workloads: each draws an integer in ``[lo, hi]`` from a seeded rng.

A sample is rounded and then clipped, so the realised mean moves from the parameter's when much
mass falls outside ``[lo, hi]``: a normal with std > mean (Table 1's ``sharegpt``) clipped at 1
gains ~15 % on its mean, which is why heavy-spread lengths are better given as a lognormal with
the same mean and std (:meth:`LogNormal.from_mean_std`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol


class LengthDist(Protocol):
    @property
    def lo(self) -> int: ...

    @property
    def hi(self) -> int: ...

    def sample(self, rng: random.Random) -> int: ...


def _clip(value: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(value)))


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int
    lo: int = 1
    hi: int = 1 << 30

    def sample(self, rng: random.Random) -> int:
        return _clip(self.value, self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class Uniform:
    """Integers ``low..high`` inclusive, equally likely."""

    low: int
    high: int
    lo: int = 1
    hi: int = 1 << 30

    def sample(self, rng: random.Random) -> int:
        return _clip(rng.randint(self.low, self.high), self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class Normal:
    """HyperFlexis Table 1's model: mean ± std, clipped."""

    mean: float
    std: float
    lo: int = 1
    hi: int = 1 << 30

    def sample(self, rng: random.Random) -> int:
        return _clip(rng.gauss(self.mean, self.std), self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """``exp(N(ln median, sigma²))``: right-skewed, p99/p50 = exp(2.33·sigma) before clipping."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 30

    @classmethod
    def from_mean_std(cls, mean: float, std: float, lo: int = 1, hi: int = 1 << 30) -> LogNormal:
        """The lognormal with this (unclipped) mean and std."""
        sigma2 = math.log1p((std / mean) ** 2)
        return cls(mean * math.exp(-sigma2 / 2), math.sqrt(sigma2), lo, hi)

    def sample(self, rng: random.Random) -> int:
        return _clip(self.median * math.exp(rng.gauss(0.0, self.sigma)), self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class Pareto:
    """Type-I Pareto, ``P(X > x) = (scale / x) ** alpha`` for x >= scale: a power-law tail, infinite
    variance for alpha <= 2 and infinite mean for alpha <= 1, so ``hi`` is what bounds it."""

    scale: float
    alpha: float
    lo: int = 1
    hi: int = 1 << 30

    def sample(self, rng: random.Random) -> int:
        return _clip(self.scale * rng.paretovariate(self.alpha), self.lo, self.hi)
