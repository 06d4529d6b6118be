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
three variables).

The prior (normally the engine's latency profile) enters the fit as a ridge toward its shape at
the data's level (so an engine uniformly faster or slower than its profile costs nothing), with
the Bayesian weight "the samples' own relative noise over how far a prior may be off": the data
decide every direction they can see, and a direction they cannot see (every prompt the same
length, every decode batch the same size) follows the prior's shape instead of collapsing onto
one coefficient. Below ``min_samples`` the prior is returned.
A prefill fit also keeps its per-token cost at no less than :data:`TOKEN_COST_FLOOR` of the
slope the samples show (seconds per prompt token if all of it were per-token), so data that hide
the length dependence cannot make the eq.(5) token budget unbounded.

A prefill sample may come from a mixed engine step (chunked prefill: the prompts ran in the same
forward pass as other requests' decodes). It then carries that batch's decode context and size,
and the decode share of the step, by the decode coefficients fitted first, is taken out of it.
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

#: the prior of an engine without a latency profile (a 7B-class engine, seconds)
DEFAULT_PREFILL: Coeffs = (0.025, 1e-4, 0.0)
DEFAULT_DECODE: Coeffs = (0.012, 4e-8, 1e-4)

#: fewest samples a fit is attempted with; below it the prior is returned
MIN_SAMPLES = 8
#: how far (relatively) a prior may be from the truth: the ridge toward it weighs the samples'
#: own relative noise variance over this squared (see :func:`_ridge_nnls`)
PRIOR_SPREAD = 1.0
#: the least ridge weight, in samples: enough to settle what the data cannot see, nothing more
_MIN_RIDGE = 1e-6
#: a sample whose residual is beyond this many robust standard deviations (and beyond
#: OUTLIER_FLOOR, relatively) is left out of a second fit: timing hiccups are not the engine
OUTLIER_SIGMAS = 3.0
OUTLIER_FLOOR = 0.05
#: a fitted per-token prefill cost is at least this share of the median slope of the samples
TOKEN_COST_FLOOR = 0.02
#: ...of the samples of at least this many prompt tokens (a KV block: fewer is the fixed cost)
FLOOR_MIN_TOKENS = 16
#: token budget reported when eq.(5) puts no bound on it (b == 0, or an infinite TTFT)
UNBOUNDED_TOKENS = 1 << 30

_Matrix = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One observed prefill: the prompt lengths of the batch (tokens) and how long it took (s).

    ``decode_context`` / ``decode_batch``: the summed current length and the number of requests
    that decoded in the same engine step (0 for a step that only prefilled); their share of
    ``seconds`` is not eq.(1)'s and is taken out when the sample is fitted.
    """

    input_lengths: tuple[int, ...]
    seconds: float
    decode_context: int = 0
    decode_batch: int = 0


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


def decode_share(decode: Coeffs, sample: PrefillSample) -> float:
    """Seconds of a mixed step that its decodes add to the prefill: eq.(2) without its intercept
    (one forward pass pays one fixed cost, counted as eq.(1)'s ``a``)."""
    if sample.decode_batch <= 0:
        return 0.0
    return decode[1] * sample.decode_context + decode[2] * sample.decode_batch


def prefill_seconds(sample: PrefillSample, decode: Coeffs | None) -> float:
    """The sample's prefill time alone: ``seconds`` less its decodes' share (``nan`` for a mixed
    sample when no decode coefficients are given: it cannot be used yet)."""
    if sample.decode_batch <= 0:
        return sample.seconds
    if decode is None:
        return math.nan
    return sample.seconds - decode_share(decode, sample)


def _usable(seconds: float) -> bool:
    # relative error is undefined at y <= 0; a non-finite timing is a measurement bug
    return math.isfinite(seconds) and seconds > 0.0


def _prefill_rows(samples: Sequence[PrefillSample], decode: Coeffs | None) -> tuple[_Matrix, _Matrix]:
    rows = []
    for s in samples:
        seconds = prefill_seconds(s, decode)
        if s.input_lengths and _usable(seconds):
            rows.append(
                (1.0, float(sum(s.input_lengths)), float(sum(n * n for n in s.input_lengths)), seconds)
            )
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


def _nnls(gram: _Matrix, moment: _Matrix, norm: float) -> _Matrix | None:
    """Exact NNLS for three unknowns from the normal equations (``gram = AᵀA``, ``moment = Aᵀb``,
    ``norm = bᵀb``): the optimum is the unconstrained least-squares solution on some support set,
    so solve each (3x3 at most) and keep the best one that is non-negative."""
    best: _Matrix | None = None
    best_residual = math.inf
    for size in (3, 2, 1, 0):
        for support in combinations(range(3), size):
            cols = list(support)
            full = np.zeros(3)
            if cols:
                sub = gram[np.ix_(cols, cols)]
                try:
                    solution = np.linalg.solve(sub, moment[cols])
                except np.linalg.LinAlgError:  # singular: the least-norm solution
                    solution = np.linalg.lstsq(sub, moment[cols], rcond=None)[0]
                if np.any(solution < 0.0) or not np.all(np.isfinite(solution)):
                    continue
                full[cols] = solution
            # |Ax - b|² = xᵀAᵀAx - 2xᵀAᵀb + bᵀb
            residual = float(full @ gram @ full - 2.0 * full @ moment + norm)
            if residual < best_residual:
                best, best_residual = full, residual
    return best


def _ridge_nnls(
    design: _Matrix, target: _Matrix, prior: Coeffs, relative: bool, min_samples: int, prior_spread: float
) -> Coeffs:
    """Non-negative least squares of ``design @ x ~ target`` with a ridge toward ``prior``.

    The ridge row of coefficient k is ``sqrt(lam) * s_k * (x_k - level * prior_k)``: ``s_k`` is
    the RMS of column k in the (weighted) design, so moving x_k by d changes a typical (relative)
    prediction by about ``s_k * d``; ``level`` is the factor that best fits the prior's
    predictions to the data (the prior's shape, at the data's level). ``lam`` is the Bayesian
    ridge weight ``noise² / prior_spread²``: the samples' own residual variance (from a first,
    barely regularised pass) over how far, relatively, a prior may be off. So the prior weighs
    like a fraction of one sample, and its share shrinks as 1/n; it decides only what the data
    cannot see. Columns are scaled by ``s_k`` so the unknowns are comparable. Samples whose
    residual is an outlier (:data:`OUTLIER_SIGMAS`) are then left out and the fit done again.
    """
    n = design.shape[0]
    if n < max(min_samples, 1):
        return prior
    # weights 1/y on the residual, i.e. 1/y² on its square: minimises squared relative error
    weights = 1.0 / target if relative else np.ones_like(target)
    a_mat = design * weights[:, None]
    rhs = target * weights
    scale = np.sqrt(np.mean(a_mat * a_mat, axis=0))
    # a column the data never exercise (all zero) is decided by the ridge alone: the prior
    scale = np.where(scale > 0.0, scale, 1.0)
    # the ridge pulls toward the prior's shape at the data's level: a prior that is right up to a
    # constant factor (an engine uniformly faster or slower than its profile) costs nothing, and a
    # prior far off in level (1 s per token) does not drag the fit toward it
    prior_vec = np.array(prior, dtype=np.float64)
    predicted = a_mat @ prior_vec
    norm = float(predicted @ predicted)
    level = max(0.0, float(predicted @ rhs) / norm) if norm > 0.0 else 1.0
    center = scale * level * prior_vec
    scaled = a_mat / scale
    # one sample's size in rhs units (1 for relative fits): what prior_spread is relative to
    unit = float(np.sqrt(np.mean(rhs * rhs)))
    best = _ridge_passes(scaled, rhs, center, max(prior_spread, 1e-12) * unit)
    if best is None:
        return prior
    # one robust pass: samples far off the fit (a timing hiccup, a step misread) are left out
    residuals = scaled @ best - rhs
    spread = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    # (around the median residual: a first pass dragged onto one far sample, which 1/y weights
    # give hundreds of times the pull of the rest, had every residual far from 0 and kept none)
    keep = np.abs(residuals - np.median(residuals)) <= max(OUTLIER_SIGMAS * spread, OUTLIER_FLOOR * unit)
    if not keep.all() and int(keep.sum()) >= max(min_samples, 3):
        again = _ridge_passes(scaled[keep], rhs[keep], center, max(prior_spread, 1e-12) * unit)
        if again is not None:
            best = again
    coeffs = best / scale
    return (float(coeffs[0]), float(coeffs[1]), float(coeffs[2]))


def _ridge_passes(scaled: _Matrix, rhs: _Matrix, center: _Matrix, spread: float) -> _Matrix | None:
    """The ridge fit in scaled coordinates: a first pass barely regularised, whose residual
    variance over ``spread²`` then weighs the ridge of the second."""
    n = scaled.shape[0]
    gram = scaled.T @ scaled
    moment = scaled.T @ rhs
    norm = float(rhs @ rhs)
    lam = _MIN_RIDGE
    best: _Matrix | None = None
    for _ in range(2):
        # the ridge rows sqrt(lam) * (x - center) added to the normal equations
        best = _nnls(gram + lam * np.eye(3), moment + lam * center, norm + lam * float(center @ center))
        if best is None:
            return None
        residual = float(np.sum((scaled @ best - rhs) ** 2)) / max(n - 3, 1)
        lam = max(_MIN_RIDGE, residual / (spread * spread))
    return best


def fit_prefill(
    samples: Sequence[PrefillSample],
    prior: Coeffs,
    *,
    decode: Coeffs | None = None,
    relative: bool = True,
    min_samples: int = MIN_SAMPLES,
    prior_spread: float = PRIOR_SPREAD,
) -> Coeffs:
    """Fit eq.(1)'s ``(a, b, c) >= 0`` to ``samples``; ``prior`` when there is too little to go on.

    ``decode``: the decode coefficients that take mixed samples' decode share out (without them
    mixed samples are left out). ``relative=True`` (appendix A) minimises squared relative error;
    ``False`` is plain least squares (kept for comparison). Samples with non-positive or
    non-finite seconds (after the decode share) are ignored. Falls back to ``prior`` with fewer
    than ``min_samples`` usable samples; ``prior_spread`` sets the ridge toward it (module doc).
    The per-token cost ``b`` is kept at no less than :data:`TOKEN_COST_FLOOR` of the median
    slope ``seconds / sum(lengths)`` of the samples.
    """
    design, target = _prefill_rows(samples, decode)
    fitted = _ridge_nnls(design, target, prior, relative, min_samples, prior_spread)
    if fitted is prior:
        return prior
    a, b, c = fitted
    # (over prefills of a block or more: one of none or a few, a prompt the engine held (nearly)
    # whole in its prefix cache, has a "slope" of its whole time, and a dozen of them set b at
    # 6x the real one)
    tokens = design[:, 1]
    with_tokens = tokens >= FLOOR_MIN_TOKENS
    if not with_tokens.any():
        # Only short prompts: they say nothing of a long one's per-token cost, and the fit could
        # set it to 0 (a 4,000-token prompt then predicted at its fixed cost, eq.(5)'s budget
        # unbounded). The prior's, at the level the samples run at against the prior, holds.
        predicted = design @ np.asarray(prior, dtype=np.float64)
        level = float(np.median(target / predicted)) if bool((predicted > 0).all()) else 1.0
        return (a, max(b, prior[1] * level), c)
    slopes = target[with_tokens] / tokens[with_tokens]
    return (a, max(b, TOKEN_COST_FLOOR * float(np.median(slopes))), c)


def fit_decode(
    samples: Sequence[DecodeSample],
    prior: Coeffs,
    *,
    relative: bool = True,
    min_samples: int = MIN_SAMPLES,
    prior_spread: float = PRIOR_SPREAD,
) -> Coeffs:
    """Fit eq.(2)'s ``(a', b', c') >= 0``; same contract as :func:`fit_prefill`.

    A constant batch size makes ``a'`` and ``c'`` inseparable: the data fix ``a' + c' * B`` and
    the ridge splits it as the prior does.
    """
    design, target = _decode_rows(samples)
    return _ridge_nnls(design, target, prior, relative, min_samples, prior_spread)


def prediction_error(
    coeffs: Coeffs, samples: Sequence[PrefillSample | DecodeSample], decode: Coeffs | None = None
) -> float:
    """Mean absolute relative error ``|predicted - actual| / actual`` over usable samples.

    Prefill samples are predicted with eq.(1), decode samples with eq.(2), so pass the matching
    coefficients (and, for mixed prefill samples, the decode coefficients that take their decode
    share out; without them those are skipped). ``nan`` when no sample is usable.
    """
    prefill_design, prefill_target = _prefill_rows(
        [s for s in samples if isinstance(s, PrefillSample)], decode
    )
    decode_design, decode_target = _decode_rows([s for s in samples if isinstance(s, DecodeSample)])
    design = np.vstack((prefill_design, decode_design))
    target = np.concatenate((prefill_target, decode_target))
    if not target.size:
        return math.nan
    predicted = design @ np.array(coeffs, dtype=np.float64)
    return float(np.mean(np.abs(predicted - target) / target))


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Current coefficients of one engine (or engine type) plus the recent samples they come from.

    ``prefill``/``decode`` are what predictions use now; ``prior_*`` (normally the engine latency
    profile) is what a fit is pulled toward and falls back to. The sample rings keep the newest
    ``capacity`` samples. Every method returns a new model; the caller decides when to
    :meth:`refit` (e.g. every k observations or on a timer), because a fit costs O(capacity)
    numpy work.
    """

    prefill: Coeffs
    decode: Coeffs
    prior_prefill: Coeffs
    prior_decode: Coeffs
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()
    capacity: int = 512
    min_samples: int = MIN_SAMPLES
    #: how far the prior may be off, relatively (the ridge toward it, see the module doc); it
    #: replaces the old floor at a quarter of the prior, which kept a fit from learning an engine
    #: more than 4x faster than its profile
    prior_spread: float = PRIOR_SPREAD

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not self.prior_spread > 0.0:
            raise ValueError(f"prior_spread must be > 0, got {self.prior_spread}")

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

    def decode_is_fitted(self) -> bool:
        """Whether the decode ring is large enough for :meth:`refit` to fit it (not the prior)."""
        return sum(1 for s in self.decode_samples if s.batch_size > 0 and _usable(s.seconds)) >= max(
            self.min_samples, 1
        )

    def refit(self) -> LatencyModel:
        """Re-fit both stages on the rings (relative error, non-negative, ridge toward the priors):
        decode first, then prefill with mixed samples' decode share taken out by the new decode
        coefficients (left out while decode still stands on its prior)."""
        decode = fit_decode(
            self.decode_samples,
            self.prior_decode,
            min_samples=self.min_samples,
            prior_spread=self.prior_spread,
        )
        prefill = fit_prefill(
            self.prefill_samples,
            self.prior_prefill,
            decode=decode if self.decode_is_fitted() else None,
            min_samples=self.min_samples,
            prior_spread=self.prior_spread,
        )
        return replace(self, prefill=prefill, decode=decode)

    def predict_prefill(self, input_lengths: Sequence[int]) -> float:
        return predict_prefill(self.prefill, input_lengths)

    def predict_decode(self, current_lengths_sum: int, batch_size: int) -> float:
        return predict_decode(self.decode, current_lengths_sum, batch_size)

    def prefill_error(self) -> float:
        """Mean relative error of the current prefill coefficients on the ring (``nan`` if empty)."""
        return prediction_error(self.prefill, self.prefill_samples, self.decode)

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
    if tpot_s == math.inf:
        # no TPOT to keep (nothing runs with one the engine can meet): the limit of the bound,
        # the TTFT alone, (TTFT - a) / b (the formula's inf - inf read as no budget at all)
        numerator, tpot_s = ttft_s - a, 1.0
    else:
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
