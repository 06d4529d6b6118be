"""A small run of ``slogate bench overhead --tracing``'s case, so it cannot rot (figures come from the CLI)."""

from __future__ import annotations

from gateway.bench.overhead import run_tracing_cost


def test_tracing_cost_case_smoke() -> None:
    cost = run_tracing_cost(10, 4)
    for figures in (cost.added_p50_ms, cost.cpu_ms_per_request, cost.cpu_ms_per_stream):
        assert set(figures) == {"off", "on"}
    assert all(v > 0 for v in (*cost.cpu_ms_per_request.values(), *cost.cpu_ms_per_stream.values()))
    assert [row[0] for row in cost.checks()] == [
        "tracing on vs off: added p50 (c=1)",
        "tracing on vs off: CPU per plain request",
        "tracing on vs off: CPU per streamed request",
    ]
