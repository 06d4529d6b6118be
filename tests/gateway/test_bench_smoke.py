"""A small run of the overhead benchmark so it cannot rot (the real figures come from the CLI)."""

from __future__ import annotations

from gateway.bench.overhead import render_table, run_overhead


def test_overhead_benchmark_smoke() -> None:
    result = run_overhead(n=60, stream_tokens=8)
    assert 0 < result.cpu_ms_per_request < 50
    assert 0 <= result.cpu_us_per_sse_event < 5000
    assert result.rps_c32 > 10 and result.idle_rss_mb > 10
    assert result.gateway_p50_ms > 0 and result.direct_p50_ms > 0
    table = render_table(result)
    assert "CPU per relayed SSE event" in table and "idle RSS" in table
