"""A stalled engine: healthy by its health route, yet producing nothing for the work it holds.

A health check asks whether the engine answers, not whether it makes progress: an engine whose
scheduler hung, or whose GPU is wedged, keeps passing it while every request sent there waits out
its timeouts (minutes for a first token). Such an engine is taken out of rotation (no new work)
until it makes progress again or holds nothing; what it holds that can go elsewhere without loss
does (:func:`may_try_elsewhere`).
"""

from __future__ import annotations


def is_stalled(oldest_dispatch: float | None, progress_at: float, now: float, after_s: float) -> bool:
    """Whether an engine is stalled at ``now``: it holds a request sent at ``oldest_dispatch``
    (None: it holds none), and neither that request nor anything since has been followed by
    progress (a first token, a streamed event, its own work counters moving) for ``after_s``
    seconds. ``after_s`` <= 0 turns the check off."""
    if after_s <= 0.0 or oldest_dispatch is None:
        return False
    return now - max(oldest_dispatch, progress_at) >= after_s


def may_try_elsewhere(
    *,
    stream: bool,
    engine_counts_steps: bool,
    pinned: bool,
    cut_before: bool,
    predicted_prefill_s: float,
    after_s: float,
) -> bool:
    """Whether a request waiting on an engine just marked stalled, with nothing of its answer at
    the client yet, is tried on another engine now rather than left to its own limits.

    Not when it can go nowhere else (``pinned``: the engine holds what it continues); nor when it
    may be what looks like the stall rather than its victim: a plain request on an engine that
    counts no steps (it shows nothing until it ends, and may be running), one already moved off
    an engine for a stall (``cut_before``), or one whose prefill alone is predicted to take
    ``after_s`` or more (a long prompt with nothing else running shows no progress until its first
    token: cut, it would start again elsewhere and look the same there)."""
    if pinned or cut_before:
        return False
    if not stream and not engine_counts_steps:
        return False
    return predicted_prefill_s < after_s
