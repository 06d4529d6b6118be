"""A stalled engine: healthy by its health route, yet producing nothing for the work it holds.

A health check asks whether the engine answers, not whether it makes progress: an engine whose
scheduler hung, or whose GPU is wedged, keeps passing it while every request sent there waits out
its timeouts (minutes for a first token). Such an engine is taken out of rotation (no new work;
what it holds keeps its own limits) until it makes progress again or holds nothing.
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
