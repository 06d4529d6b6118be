"""Step-time model of a GPU engine under continuous batching (HyperFlexis eq. (1) and (2)).

Pure: no I/O, no clock, no imports from ``gateway/``. The simulated engine calls
:func:`batch_step_time` once per engine step to know how long the step takes; the dispatcher and
the offline cluster simulator can call the same functions to predict it.

Units: every time is in seconds, every length in tokens.

* eq.(1), a prefill batch: ``E_p = a + b * sum(l_in) + c * sum(l_in ** 2)``;
* eq.(2), one decode step: ``E_d = a' + b' * sum(l_cur) + c' * B`` where ``l_cur`` is a request's
  current context length (prompt plus tokens generated so far) and ``B`` the batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyCoefficients:
    """Coefficients of eq.(1) (``a``, ``b``, ``c``) and eq.(2) (``a_d``, ``b_d``, ``c_d``).

    ``a``/``a_d``: fixed cost of one forward pass, s. ``b``: s per prompt token. ``c``: s per
    squared prompt token (attention). ``b_d``: s per context token read during a decode step.
    ``c_d``: s per sequence in the decode batch. All must be >= 0 (not checked here: profiles
    validate them at load).
    """

    a: float
    b: float
    c: float
    a_d: float
    b_d: float
    c_d: float


ZERO = LatencyCoefficients(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def prefill_time(coeffs: LatencyCoefficients, input_lengths: Sequence[int]) -> float:
    """Eq.(1): seconds to prefill a batch of prompts (or prompt chunks) of these lengths.

    An empty batch costs nothing (no forward pass is run).
    """
    if not input_lengths:
        return 0.0
    total = 0
    squares = 0
    for n in input_lengths:
        total += n
        squares += n * n
    return coeffs.a + coeffs.b * total + coeffs.c * squares


def decode_step_time(coeffs: LatencyCoefficients, current_lengths: Sequence[int]) -> float:
    """Eq.(2): seconds for one decode step of requests with these current context lengths.

    An empty batch costs nothing.
    """
    if not current_lengths:
        return 0.0
    return coeffs.a_d + coeffs.b_d * sum(current_lengths) + coeffs.c_d * len(current_lengths)


def batch_step_time(
    coeffs: LatencyCoefficients,
    prefill_chunk_lengths: Sequence[int],
    decode_current_lengths: Sequence[int],
) -> float:
    """Seconds for one engine step that mixes prefill chunks and decode tokens (chunked prefill).

    A mixed batch is one forward pass, so the fixed overhead is paid once: ``max(a, a_d)``. The
    variable parts add up: eq.(1) without ``a`` over the prefill chunk lengths plus eq.(2)
    without ``a_d`` over the decoding requests. A chunk's quadratic term uses the chunk length
    (the model ignores attention to earlier chunks; it is what eq.(1) was fitted on). With only
    prefills or only decodes this is exactly eq.(1) or eq.(2); with neither it is 0.
    """
    has_prefill = bool(prefill_chunk_lengths)
    has_decode = bool(decode_current_lengths)
    if not has_prefill and not has_decode:
        return 0.0
    if not has_decode:
        return prefill_time(coeffs, prefill_chunk_lengths)
    if not has_prefill:
        return decode_step_time(coeffs, decode_current_lengths)
    variable = (
        prefill_time(coeffs, prefill_chunk_lengths)
        - coeffs.a
        + decode_step_time(coeffs, decode_current_lengths)
        - coeffs.a_d
    )
    return max(coeffs.a, coeffs.a_d) + variable
