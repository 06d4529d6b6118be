"""The sliding-window minimum the dispatcher budgets eq.(5) against."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch.offline import offline_core, offline_fleet
from gateway.dispatch.window_min import WindowMin
from gateway.fleet.registry import RunningEntry
from policies.api import RequestView
from policies.hyperflexis import HyperFlexisParams


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.01, 30.0), st.booleans()), max_size=60))
def test_window_min_equals_the_minimum_of_the_window(steps: list[tuple[float, float, bool]]) -> None:
    window = WindowMin(10.0)
    seen: list[tuple[float, float]] = []
    now = 0.0
    for dt, value, add in steps:
        now += dt
        if add:
            window.add(value, now)
            seen.append((now, value))
        expected = min((v for t, v in seen if t >= now - 10.0), default=math.inf)
        assert window.min(now) == expected


def test_hyperflexis_budgets_against_recent_arrivals_then_falls_back_to_the_profile() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(
        fleet,
        dispatcher="hyperflexis",
        hyperflexis=HyperFlexisParams(tightest_window_s=30.0),
        tightest_ttft_s=0.1,
    )
    assert core._tightest("a", 0.0) == 0.1  # nothing seen yet: the profile's tightest
    for i, ttft in enumerate((5.0, 2.0, 8.0)):
        view = RequestView(f"r-{i}", "a", 100, 10, 0.0)
        core.submit(core.ticket(view, ttft, 0.5, "c", RunningEntry(100, 10, 0.5, 0.0), float(i)), float(i))
    assert core._tightest("a", 3.0) == 2.0
    assert core._tightest("a", 31.5) == 8.0  # the 2 s one left the window; 8 s arrived at t=2
    assert core._tightest("a", 60.0) == 0.1


def test_window_min_stays_bounded_without_reads() -> None:
    window = WindowMin(10.0)
    for i in range(10_000):  # increasing values: none is dropped for a smaller newcomer
        window.add(float(i), float(i))
    assert len(window._items) <= 11
