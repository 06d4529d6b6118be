"""`slogate bench dispatchers` in front of a real engine: a small run, so it cannot rot (the figures
come from the CLI; this machine is shared and the run is tiny)."""

from __future__ import annotations

import math

from gateway.bench.overhead import run_dispatcher_latency
from gateway.realengines.servers import RunningEngine


def test_the_dispatchers_bench_measures_each_profile_in_front_of_llamacpp(
    llamacpp_server: RunningEngine,
) -> None:
    result = run_dispatcher_latency(10, engine=llamacpp_server, concurrency=2)
    assert result.engine == "llamacpp" and result.concurrency == 2
    assert set(result.added_p50_ms) == set(result.throughput_rps) == {"least-load", "hyperflexis"}
    assert all(math.isfinite(v) for v in result.added_p50_ms.values())
    assert all(v > 1 for v in result.throughput_rps.values())
    assert any("c=2, llamacpp engine" in row[0] for row in result.checks())
    assert llamacpp_server.is_running()  # (not the bench's to stop)
