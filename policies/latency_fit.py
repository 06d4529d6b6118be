"""Online re-fit of the HyperFlexis latency model, and the quantities the dispatcher derives from it.

The model (HyperFlexis §3, after DistServe):

* eq.(1) prefill of a batch, seconds: ``E_p = a + b * sum(l_in) + c * sum(l_in ** 2)``;
* eq.(2) one decode step of a batch, seconds: ``E_d = a' + b' * sum(l_cur) + c' * B``.

Appendix A fits the coefficients by least squares "minimising the total squared relative error
between predicted and actual latencies", i.e. weighted least squares with weights ``1 / y**2``.
Relative error matters because the dispatcher compares predictions against targets of very
different sizes (a 20 ms decode step against a 50 ms TPOT; a 2 s prefill against a 20 s TTFT):
plain least squares would fit the long prefills and leave short ones off by a large factor.

Coefficients are constrained to be non-negative (a negative ``b`` would predict that longer
prompts are faster), solved exactly by trying every support set of the three unknowns (NNLS for
three variables). With too few samples, or a design that cannot separate the terms (every
sample the same length, or the same batch size), the fit returns the prior unchanged.

Also here, because they are what the fitted coefficients are *for*: the eq.(5) / appendix B
token budget and the Algorithm 1 maturity time. Everything is pure; :class:`LatencyModel` is a
value whose ``observe_*`` and ``refit`` return new models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations

import numpy as np
import numpy.typing as npt

#: (a, b, c) of eq.(1) or (a', b', c') of eq.(2); seconds, seconds/token, seconds/token² (or /request)
Coeffs = tuple[float, float, float]

#: fewest samples a fit is attempted with; below it the prior is returned
MIN_SAMPLES = 8
#: largest condition number of the column-normalised design accepted before falling back
MAX_CONDITION = 1e8
#: token budget reported when eq.(5) puts no bound on it (b == 0, or an infinite TTFT)
UNBOUNDED_TOKENS = 1 << 30

_Matrix = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One observed prefill: the prompt lengths of the batch (tokens) and how long it took (s)."""

    input_lengths: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One observed decode step: sum of current lengths (prompt + generated tokens so far) over
    the batch, the batch size ``B``, and the step time in seconds."""

    current_lengths_sum: int
    batch_size: int
    seconds: float


def predict_prefill(coeffs: Coeffs, input_lengths: Sequence[int]) -> float:
    """Eq.(1), seconds, for a prefill batch with these prompt lengths."""
    a, b, c = coeffs
    return a + b * sum(input_lengths) + c * sum(n * n for n in input_lengths)


def predict_decode(coeffs: Coeffs, current_lengths_sum: int, batch_size: int) -> float:
    """Eq.(2), seconds, for one decode step of ``batch_size`` requests."""
    a, b, c = coeffs
    return a + b * current_lengths_sum + c * batch_size


def _usable(seconds: float) -> bool:
    # relative error is undefined at y <= 0; a non-finite timing is a measurement bug
    return math.isfinite(seconds) and seconds > 0.0


def _prefill_rows(samples: Sequence[PrefillSample]) -> tuple[_Matrix, _Matrix]:
    rows = [
        (1.0, float(sum(s.input_lengths)), float(sum(n * n for n in s.input_lengths)), s.seconds)
        for s in samples
        if s.input_lengths and _usable(s.seconds)
    ]
    data = np.array(rows, dtype=np.float64).reshape(len(rows), 4)
    return data[:, :3], data[:, 3]


def _decode_rows(samples: Sequence[DecodeSample]) -> tuple[_Matrix, _Matrix]:
    rows = [
        (1.0, float(s.current_lengths_sum), float(s.batch_size), s.seconds)
        for s in samples
        if s.batch_size > 0 and _usable(s.seconds)
    ]
    data = np.array(rows, dtype=np.float64).reshape(len(rows), 4)
    return data[:, :3], data[:, 3]


def _nonnegative_least_squares(
    design: _Matrix, target: _Matrix, prior: Coeffs, relative: bool, min_samples: int, max_condition: float
) -> Coeffs:
    if design.shape[0] < max(min_samples, design.shape[1]):
        return prior
    # weights 1/y on the residual, i.e. 1/y² on its square: minimises squared relative error
    weights = 1.0 / target if relative else np.ones_like(target)
    a_mat = design * weights[:, None]
    rhs = target * weights
    # normalise columns so 1, sum(l) and sum(l²) (spanning ~6 orders of magnitude) are comparable;
    # the condition number then measures collinearity, not units
    norms = np.linalg.norm(a_mat, axis=0)
    if not np.all(norms > 0.0):
        return prior
    scaled = a_mat / norms
    condition = float(np.linalg.cond(scaled))
    if not math.isfinite(condition) or condition > max_condition:
        return prior
    best: _Matrix | None = None
    best_residual = math.inf
    # exact NNLS for three unknowns: the optimum is the unconstrained least-squares solution on
    # some support set, so try them all and keep the best one that is non-negative
    for size in (3, 2, 1):
        for support in combinations(range(3), size):
            cols = list(support)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], rhs, rcond=None)
            if np.any(solution < 0.0):
                continue
            residual = float(np.sum((scaled[:, cols] @ solution - rhs) ** 2))
            if residual < best_residual:
                full = np.zeros(3)
                full[cols] = solution
                best, best_residual = full, residual
    if best is None:
        return prior
    coeffs = best / norms
    return (float(coeffs[0]), float(coeffs[1]), float(coeffs[2]))


def fit_prefill(
    samples: Sequence[PrefillSample],
    prior: Coeffs,
    *,
    relative: bool = True,
    min_samples: int = MIN_SAMPLES,
    max_condition: float = MAX_CONDITION,
) -> Coeffs:
    """Fit eq.(1)'s ``(a, b, c) >= 0`` to ``samples``; ``prior`` when there is too little to go on.

    ``relative=True`` (appendix A) minimises squared relative error; ``False`` is plain least
    squares (kept for comparison). Samples with non-positive or non-finite seconds are ignored.
    Falls back to ``prior`` with fewer than ``min_samples`` usable samples or when the
    column-normalised design's condition number exceeds ``max_condition`` (e.g. every batch had
    the same total length, so ``b`` and ``c`` cannot be told apart).
    """
    design, target = _prefill_rows(samples)
    return _nonnegative_least_squares(design, target, prior, relative, min_samples, max_condition)


def fit_decode(
    samples: Sequence[DecodeSample],
    prior: Coeffs,
    *,
    relative: bool = True,
    min_samples: int = MIN_SAMPLES,
    max_condition: float = MAX_CONDITION,
) -> Coeffs:
    """Fit eq.(2)'s ``(a', b', c') >= 0``; same contract as :func:`fit_prefill`.

    A constant batch size makes ``a'`` and ``c'`` inseparable: that is ill-conditioned and
    returns the prior.
    """
    design, target = _decode_rows(samples)
    return _nonnegative_least_squares(design, target, prior, relative, min_samples, max_condition)


def prediction_error(coeffs: Coeffs, samples: Sequence[PrefillSample | DecodeSample]) -> float:
    """Mean absolute relative error ``|predicted - actual| / actual`` over usable samples.

    Prefill samples are predicted with eq.(1), decode samples with eq.(2), so pass the matching
    coefficients. ``nan`` when no sample is usable.
    """
    errors = []
    for sample in samples:
        if not _usable(sample.seconds):
            continue
        if isinstance(sample, PrefillSample):
            predicted = predict_prefill(coeffs, sample.input_lengths)
        else:
            predicted = predict_decode(coeffs, sample.current_lengths_sum, sample.batch_size)
        errors.append(abs(predicted - sample.seconds) / sample.seconds)
    return sum(errors) / len(errors) if errors else math.nan


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Current coefficients of one engine (or engine type) plus the recent samples they come from.

    ``prefill``/``decode`` are what predictions use now; ``prior_*`` (normally the engine latency
    profile) is what a fit falls back to. The sample rings keep the newest ``capacity`` samples.
    Every method returns a new model; the caller decides when to :meth:`refit` (e.g. every k
    observations or on a timer), because a fit costs O(capacity) numpy work.
    """

    prefill: Coeffs
    decode: Coeffs
    prior_prefill: Coeffs
    prior_decode: Coeffs
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()
    capacity: int = 512
    min_samples: int = MIN_SAMPLES
    #: no fitted coefficient goes below this share of the prior's. The gateway's samples are whole
    #: requests: under load a TTFT is mostly waiting, so the relative-error fit can explain it with
    #: a constant and drive ``b`` to 0, and a zero per-token cost makes the eq.(5) budget
    #: unbounded (measured: 70 k prompt tokens handed to one engine in a turn, P0 timed out for 5 s).
    prior_floor: float = 0.25

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not 0.0 <= self.prior_floor <= 1.0:
            raise ValueError(f"prior_floor must be in [0, 1], got {self.prior_floor}")

    @classmethod
    def from_prior(
        cls, prefill: Coeffs, decode: Coeffs, capacity: int = 512, min_samples: int = MIN_SAMPLES
    ) -> LatencyModel:
        """A model that predicts with the profiled coefficients until it has seen enough."""
        return cls(prefill, decode, prefill, decode, capacity=capacity, min_samples=min_samples)

    def observe_prefill(self, sample: PrefillSample) -> LatencyModel:
        """Add a prefill sample, dropping the oldest beyond ``capacity``."""
        return replace(self, prefill_samples=(*self.prefill_samples, sample)[-self.capacity :])

    def observe_decode(self, sample: DecodeSample) -> LatencyModel:
        """Add a decode-step sample, dropping the oldest beyond ``capacity``."""
        return replace(self, decode_samples=(*self.decode_samples, sample)[-self.capacity :])

    def refit(self) -> LatencyModel:
        """Re-fit both stages on the rings (relative error, non-negative), priors as fallback and
        ``prior_floor`` times the priors as lower bounds."""
        prefill = fit_prefill(self.prefill_samples, self.prior_prefill, min_samples=self.min_samples)
        decode = fit_decode(self.decode_samples, self.prior_decode, min_samples=self.min_samples)
        return replace(
            self,
            prefill=self._floored(prefill, self.prior_prefill),
            decode=self._floored(decode, self.prior_decode),
        )

    def _floored(self, fitted: Coeffs, prior: Coeffs) -> Coeffs:
        a, b, c = (max(f, self.prior_floor * p) for f, p in zip(fitted, prior, strict=True))
        return (a, b, c)

    def predict_prefill(self, input_lengths: Sequence[int]) -> float:
        return predict_prefill(self.prefill, input_lengths)

    def predict_decode(self, current_lengths_sum: int, batch_size: int) -> float:
        return predict_decode(self.decode, current_lengths_sum, batch_size)

    def prefill_error(self) -> float:
        """Mean relative error of the current prefill coefficients on the ring (``nan`` if empty)."""
        return prediction_error(self.prefill, self.prefill_samples)

    def decode_error(self) -> float:
        """Mean relative error of the current decode coefficients on the ring (``nan`` if empty)."""
        return prediction_error(self.decode, self.decode_samples)


def token_budget(ttft_s: float, tpot_s: float, decode_step_s: float, a: float, b: float) -> int:
    """Eq.(5) / appendix B: prompt tokens a worker can take without breaking TTFT or TPOT.

    ``floor((TTFT*TPOT - TTFT*E_d - a*TPOT) / (b*TPOT))`` with ``TTFT``/``TPOT`` the tightest
    targets (s), ``E_d = decode_step_s`` the decode step of what runs there (s) and ``a, b`` the
    eq.(1) intercept and per-token slope (the quadratic term is dropped, as in the paper).

    Returns 0 when the bound is negative or when ``TPOT <= E_d`` (decoding already uses all of
    the TPOT, so no prefill can be amortised), and :data:`UNBOUNDED_TOKENS` when nothing bounds
    it (``b == 0`` with a feasible intercept, or an infinite TTFT).
    """
    if not tpot_s > decode_step_s or tpot_s <= 0.0:
        return 0
    # TTFT*(TPOT - E_d) rather than TTFT*TPOT - TTFT*E_d: same value, and no inf - inf for TTFT = inf
    numerator = ttft_s * (tpot_s - decode_step_s) - a * tpot_s
    if math.isnan(numerator) or numerator < 0.0:
        return 0
    if b <= 0.0:
        return UNBOUNDED_TOKENS
    tokens = numerator / (b * tpot_s)
    if tokens >= UNBOUNDED_TOKENS:
        return UNBOUNDED_TOKENS
    # 1e-9 absorbs binary rounding so a budget that is an integer on paper is not lost by one
    return math.floor(tokens + 1e-9)


def maturity_time(now: float, e_p: float, e_d: float, min_tpot: float) -> float:
    """Algorithm 1: when a worker can next take work, ``now + E_p + (E_p / relax) * E_d``.

    ``relax = min_tpot - E_d`` is the time each decode step saves against the tightest TPOT on
    the worker; ``E_p / relax`` steps amortise the prefill just dispatched. All seconds on the
    caller's clock. With nothing to amortise (``E_p == 0``) the worker is mature ``now``; when
    ``relax <= 0`` decoding never catches up and the result is ``math.inf`` (callers cap it, e.g.
    with a maximum hold time).
    """
    if e_p < 0.0 or e_d < 0.0:
        raise ValueError(f"E_p and E_d must be >= 0, got E_p={e_p}, E_d={e_d}")
    if e_p == 0.0:
        return now
    relax = min_tpot - e_d
    if relax <= 0.0:
        return math.inf
    return now + e_p + (e_p / relax) * e_d
