"""A small run of ``slogate bench overhead --tracing``'s case, so it cannot rot (figures come from the
CLI), and its checks: rows the bench can fail, not figures it only reports."""

from __future__ import annotations

import pytest

from gateway.bench.overhead import TRACING_ON_TOLERANCE_MS, TracingCost, run_tracing_cost

ROWS = [
    "tracing off: added p50 (c=1)",
    "tracing on vs off: added p50 (c=1)",
    "tracing on vs off: CPU per plain request",
    "tracing on vs off: CPU per streamed request",
]


def test_tracing_cost_case_smoke() -> None:
    cost = run_tracing_cost(10, 4)
    for figures in (cost.added_p50_ms, cost.cpu_ms_per_request, cost.cpu_ms_per_stream):
        assert set(figures) == {"off", "on"}
    assert all(v > 0 for v in (*cost.cpu_ms_per_request.values(), *cost.cpu_ms_per_stream.values()))
    assert [row[0] for row in cost.checks()] == ROWS


def _cost(off: float, on: float) -> TracingCost:
    return TracingCost({"off": off, "on": on}, {"off": off, "on": on}, {"off": off, "on": on})


def test_within_tolerance_passes() -> None:
    assert all(met for *_, met in _cost(0.3, 0.29 + min(TRACING_ON_TOLERANCE_MS.values())).checks())


@pytest.mark.parametrize(
    ("off", "on", "failing"),
    [
        (0.3, 0.3 + max(TRACING_ON_TOLERANCE_MS.values()) + 0.01, ROWS[1:]),  # tracing on costs too much
        (1.5, 1.5, ROWS[:1]),  # tracing off misses the untraced target
    ],
)
def test_the_checks_can_fail(off: float, on: float, failing: list[str]) -> None:
    rows = _cost(off, on).checks()
    assert [name for name, _, _, met in rows if not met] == failing
