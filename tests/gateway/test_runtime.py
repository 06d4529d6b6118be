"""gateway.runtime.tune_gc: start-up state frozen out of the collector, young collections rarer."""

from __future__ import annotations

import gc

from gateway.runtime import YOUNG_THRESHOLD, tune_gc


def test_tune_gc_freezes_start_up_state_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        tune_gc()  # idempotent
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    finally:
        gc.unfreeze()  # the rest of the suite runs with the defaults
        gc.set_threshold(*before)


# -- what holds the loop: collections and late timers --------------------------------------------


def _bucket_counts(name: str, labels: dict[str, str] | None = None) -> dict[float, float]:
    """Cumulative bucket counts of a histogram series of the gateway's registry, by upper bound."""
    from gateway import metrics

    counts: dict[float, float] = {}
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name != f"{name}_bucket":
                continue
            sample_labels = {k: v for k, v in sample.labels.items() if k != "le"}
            if sample_labels == (labels or {}):
                counts[float(sample.labels["le"])] = sample.value
    return counts


def test_gc_pauses_are_timed_and_exported_by_generation() -> None:
    from gateway.runtime import GcPauses, export_gc_pauses

    before = _bucket_counts("slogate_gc_pause_seconds", {"generation": "2"})
    exported = export_gc_pauses()
    assert export_gc_pauses() is exported and gc.callbacks.count(exported._on_gc) == 1  # once
    local = GcPauses().install()
    try:
        garbage: list[object] = []
        for _ in range(50_000):  # a full collection with something to scan takes measurable time
            node: list[object] = [garbage]
            garbage = [node]
        gc.collect(2)
        assert local.count >= 1
        assert 0.0 < local.longest_s <= local.total_s
        after = _bucket_counts("slogate_gc_pause_seconds", {"generation": "2"})
        assert after[float("inf")] >= before.get(float("inf"), 0.0) + 1
        local.reset()
        assert (local.count, local.total_s, local.longest_s) == (0, 0.0, 0.0)
    finally:
        local.uninstall()
    assert local._on_gc not in gc.callbacks


def test_the_lag_probe_reports_a_stalled_loop_and_stops_cleanly() -> None:
    import asyncio
    import time

    from gateway.runtime import LoopLagProbe

    async def run() -> tuple[float, float, bool]:
        probe = LoopLagProbe(interval_s=0.02)
        probe.start()
        await asyncio.sleep(0.07)  # a few quiet ticks
        quiet = probe.last_s
        time.sleep(0.15)  # the loop held, as a long call would hold it
        await asyncio.sleep(0.01)  # the overdue timer runs now
        stalled = probe.last_s
        probe.stop()
        stopped = probe._handle is None
        return quiet, stalled, stopped

    before = _bucket_counts("slogate_event_loop_lag_seconds")
    quiet, stalled, stopped = asyncio.run(run())
    after = _bucket_counts("slogate_event_loop_lag_seconds")
    assert quiet < 0.1  # (a loaded machine may wake a timer late by some milliseconds)
    assert stalled >= 0.12
    assert stopped
    # the stall is in the histogram: an observation above 0.1 s was added
    over = (after[float("inf")] - after[0.1]) - (before.get(float("inf"), 0.0) - before.get(0.1, 0.0))
    assert over >= 1
