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
