"""Small runs of the benchmarks so they cannot rot (the real figures come from the CLI).

They assert structure and sanity (figures present, positive, the paced engine really paced),
never the performance targets: this machine is shared and the runs are tiny.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from gateway.bench.harness import cpu_seconds, kernel_seconds
from gateway.bench.overhead import PacedResult, _median_run, render_table, run_overhead
from gateway.cli import main
from tests.support.strict_json import strict_json


def test_overhead_benchmark_smoke() -> None:
    # (the paced case with its floor, as --paced-floor runs it: one smoke for both)
    result = run_overhead(
        n=24,
        stream_tokens=8,
        paced_streams=24,  # (more than a few: the warm-up must open as many connections as a wave uses)
        paced_tokens=(4, 16),
        paced_waves=1,
        paced_repeats=2,
        paced_floor=True,
        paced_idle_s=0.25,
        dispatcher_requests=12,  # (x 20 at c=8: 240 a profile; n // 2 is no more)
    )
    assert 0 < result.cpu_ms_per_request < 50
    assert 0 <= result.cpu_us_per_sse_event < 5000
    assert result.rps_c32 > 10 and result.idle_rss_mb > 10
    assert result.gateway_p50_ms > 0 and result.direct_p50_ms > 0
    assert result.connections_opened_c256 == 0  # (measured on a warm pool)

    paced = result.paced
    assert paced is not None
    # every token is its own event, plus the role chunk and [DONE]; 12 more tokens, 12 more events
    assert paced.events_per_stream[0] >= 4
    assert paced.events_per_stream[1] - paced.events_per_stream[0] == pytest.approx(12, abs=1)
    assert all(0 < cpu < 100 for cpu in paced.cpu_ms_per_stream)
    assert math.isfinite(paced.cpu_us_per_sse_event) and math.isfinite(paced.cpu_ms_per_request)
    # (read in 10 ms clock ticks: in so short a run only its presence is checked)
    assert math.isfinite(paced.kernel_us_per_sse_event)
    # tokens 20 ms apart: were the engine not pacing, streams of 16 tokens would end in a few ms
    assert paced.max_gap_ms >= 15
    # the measured waves reuse the warm-up's connections to the gateway: no set-up counted as
    # per-request CPU
    assert paced.connections_opened == 0

    # the bare relay on the same stack sees the same engine's streams, event for event
    floor = paced.floor
    assert floor is not None and floor.floor is None
    for run in (paced, floor):  # two alternating runs of each, the median one reported
        assert len(run.runs_us_per_event) == 2
        assert run.cpu_us_per_sse_event in run.runs_us_per_event
    assert floor.events_per_stream == paced.events_per_stream
    assert math.isfinite(floor.kernel_us_per_sse_event)
    assert math.isfinite(floor.cpu_us_per_sse_event) and floor.max_gap_ms >= 15
    assert floor.connections_opened == 0
    checks = "\n".join(row[0] for row in paced.checks())
    assert "a bare relay on the same stack" in checks and "above the floor" in checks
    assert "in the kernel" in checks

    assert result.dispatchers is not None
    assert set(result.dispatchers.added_p50_ms) == {"least-load", "hyperflexis"}
    assert all(math.isfinite(v) for v in result.dispatchers.added_p50_ms.values())
    # each gateway's own CPU per request in the throughput case: a fraction of a millisecond
    # to a few, never nothing (a gateway that served every request spent something on each)
    assert set(result.dispatchers.cpu_ms_per_request) == {"least-load", "hyperflexis"}
    assert all(0.01 < v < 50 for v in result.dispatchers.cpu_ms_per_request.values())

    table = render_table(result)
    assert "CPU per relayed SSE event" in table and "idle RSS" in table
    assert "hyperflexis over least-load, added p50 (c=1)" in table
    assert "hyperflexis gateway CPU per request vs least-load" in table
    assert "paced: CPU per relayed SSE event (24 streams, 20 ms apart)" in table


def test_large_body_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "large-body", "--requests", "6", "--prompt-bytes", "20000", "--streams", "8"]
    argv += ["--stream-tokens", "30", "--big-bytes", "1000000", "--big-texts", "mixed", "--rounds", "1"]
    assert main([*argv, "--results-dir", str(tmp_path)]) == 0

    table = capsys.readouterr().out
    assert "parse + estimate" in table and "over a small request" in table and "in the kernel" in table
    assert "1 MB mixed body: added largest gap" in table
    [written] = tmp_path.glob("large-body-*.json")
    data = json.loads(written.read_text())

    assert data["small_cpu_ms"] > 0
    assert [case["text"] for case in data["prompts"]] == ["english", "mixed"]
    for case in data["prompts"]:
        assert case["gateway_cpu_ms"] > 0 and case["parse_ms"] > 0
        assert case["direct_p50_ms"] > 0 and case["gateway_p50_ms"] > 0
        assert math.isfinite(case["over_small_kernel_ms"])  # (10 ms ticks: a figure, not its size)
        assert 20_000 <= case["body_bytes"] < 20_200  # the prompt's UTF-8 bytes and the JSON around

    [big] = data["big_bodies"]
    # the text's UTF-8 bytes, and JSON escapes its newlines as two bytes each
    assert big["text"] == "mixed" and 1_000_000 <= big["body_bytes"] < 1_010_000
    assert big["gateway_cpu_ms"] > 0 and big["parse_ms"] > 0
    assert [r["big_body"] for r in big["rounds"]] == [False, True]
    for r in big["rounds"]:
        # 8 streams of 30 tokens, 20 ms apart: the largest gap is at least about the pacing
        assert r["events"] >= 8 * 30 and r["max_gap_ms"] >= 15
    with_body = big["rounds"][1]
    assert with_body["big_body_status"] == 200 and with_body["max_gap_in_flight_ms"] is not None
    assert math.isfinite(big["added_gap_ms"])
    assert {c["target"] for c in data["checks"]} >= {"<= 1 ms", "<= 20 ms"}


def test_large_body_key_only_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--key-only``: the prefix-index key of each prompt, in process, no engines started."""
    argv = ["bench", "large-body", "--key-only", "--key-repeat", "2", "--prompt-bytes", "20000"]
    argv += ["--prompt-texts", "english,non-ascii", "--results-dir", str(tmp_path)]
    assert main(argv) == 0

    table = capsys.readouterr().out
    assert "20 KB english prompt" in table and "prefix-index key, fresh prompt" in table
    assert "next turn (history cached" in table
    [written] = tmp_path.glob("large-body-key-*.json")
    data = json.loads(written.read_text())
    assert [case["text"] for case in data["prompts"]] == ["english", "non-ascii"]
    for case in data["prompts"]:
        assert 19_990 <= case["utf8_bytes"] <= 20_000 and case["chars"] <= case["utf8_bytes"]
        assert case["blocks"] == case["tokens"] // 16 > 0
        assert case["encode_ms"] > 0 and case["chain_ms"] > 0 and case["turn_ms"] > 0
        assert case["total_ms"] >= max(case["encode_ms"], case["chain_ms"])
        assert case["match_ms"] > 0
    assert {c["target"] for c in data["checks"]} == {"<= 2 ms", "<= 4 ms"}
    assert "match on 4 engines" in table


def test_the_paced_figure_is_the_median_runs_whole() -> None:
    """One run's figures, the median by CPU per event (the higher middle of an even count), with
    every run's figure beside it: not a mix of runs, not the best one."""

    def run(us: float, per_request: float) -> PacedResult:
        return PacedResult(20, 20.0, (4, 16), (5.0, 17.0), (1.0, 2.0), us, per_request, 25.0, 1.0)

    runs = [run(24.0, 0.3), run(15.0, 0.5), run(19.0, 0.4)]
    median = _median_run(runs)
    assert (median.cpu_us_per_sse_event, median.cpu_ms_per_request) == (19.0, 0.4)
    assert median.runs_us_per_event == (24.0, 15.0, 19.0)
    assert _median_run([run(24.0, 0.3), run(15.0, 0.5)]).cpu_us_per_sse_event == 24.0


def test_prefix_memory_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``slogate bench prefix-memory`` at 61,440 blocks into 3 MiB (the real run: a million into
    64 MiB): every case filled with distinct blocks, its checks met, the curve measured."""
    argv = ["bench", "prefix-memory", "--blocks", "61440", "--budget-mib", "3", "--checkpoints", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0

    out = capsys.readouterr().out
    assert "| dispatches | 61,440 | 3 |" in out and "NO" not in out.split("figure", 1)[1]
    cases = {c["feed"]: c for c in json.loads((tmp_path / "cases.json").read_text())}
    assert set(cases) == {"dispatches", "events", "held"}
    held = cases["held"]
    assert held["entries"] == 61_440 and held["evicted"] == 0  # distinct blocks, all kept
    assert held["measured_mib"] * 2**20 / held["entries"] < 100  # (bytes a block)
    for feed in ("dispatches", "events"):
        case = cases[feed]
        assert 0 < case["measured_mib"] <= case["counted_mib"] <= 3.0 and case["evicted"] > 0
        assert [p["blocks"] for p in case["curve"]] == [20_480, 40_960, 61_440]
    assert (tmp_path / "prefix_memory.png").stat().st_size > 10_000 and (tmp_path / "table.md").exists()
    # blocks go 64 to a prompt: any other count was filled short and reported as asked
    assert main(["bench", "prefix-memory", "--blocks", "100000", "--out", str(tmp_path)]) == 2
    assert "a multiple of 64" in capsys.readouterr().err


def test_kernel_seconds_is_the_time_spent_in_the_kernel() -> None:
    """The paced and large-body figures split CPU into the kernel's part with this: reading
    /dev/zero in megabytes is mostly kernel work (zero-filling), and the figure must agree with
    what the process's own clock says of its system time."""
    pid = os.getpid()
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        k0, s0, c0 = kernel_seconds(pid), os.times().system, cpu_seconds(pid)
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            os.read(fd, 1 << 20)
        k1, s1, c1 = kernel_seconds(pid), os.times().system, cpu_seconds(pid)
    finally:
        os.close(fd)
    assert k1 - k0 > 0.05 and abs((k1 - k0) - (s1 - s0)) <= 0.03
    assert k1 - k0 <= c1 - c0 + 0.02


def test_rate_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``slogate bench rate`` for 2 s at 40/s (the real run: 20 s at 100 and 300/s): every
    request answered, the halves compared, the windows measured, the plot written."""
    argv = ["bench", "rate", "--rates", "40", "--seconds", "2", "--window-s", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "errors at 40/s" in out and "p50 through the gateway, second half vs first at 40/s" in out
    (point,) = strict_json((tmp_path / "points.json").read_text())
    assert point["requests"] > 40 and point["errors"] == point["direct_errors"] == 0
    assert point["first_half_p50_ms"] > 0 and point["second_half_p99_ms"] > 0
    # (>= 0: the idle CPU subtracted is one noisy second's)
    assert 0 <= point["cpu_ms_per_request"] < 50 and point["rss_after_mb"] > 0
    assert [w["start_s"] for w in point["windows"]] == [0.0, 1.0]
    assert all(w["gateway_p50_ms"] > 0 and w["direct_p50_ms"] > 0 for w in point["windows"])
    assert (tmp_path / "rate_latency.png").stat().st_size > 10_000
    assert main(["bench", "rate", "--rates", "0", "--out", str(tmp_path)]) == 2
    assert main(["bench", "rate", "--rates", "fast", "--out", str(tmp_path)]) == 2
    assert main(["bench", "rate", "--rates", "inf", "--out", str(tmp_path)]) == 2
    assert main(["bench", "rate", "--window-s", "0.001", "--out", str(tmp_path)]) == 2
    assert main(["bench", "rate", "--rates", "0.001", "--out", str(tmp_path)]) == 2
    assert main(["bench", "rate", "--rates", "1e8", "--out", str(tmp_path)]) == 2


def test_rate_schedule_and_the_climb_rule() -> None:
    from gateway.bench.sustained_rate import RatePoint, schedule

    times = schedule(200.0, 50.0, seed=3)
    assert times == schedule(200.0, 50.0, seed=3) and times == sorted(times)
    assert times[0] > 0 and times[-1] < 50.0 and abs(len(times) / 50.0 - 200.0) < 10.0

    def point(first: float, second: float) -> RatePoint:
        return RatePoint(
            100.0, 20.0, 100.0, 2000, 0, 0, 1.0, 2.0, first, second, 9.0, 30.0, 0.5, 90.0, 90.0, 1.0
        )

    assert not point(1.0, 1.9).climbs  # (within 1 ms)
    assert not point(10.0, 14.9).climbs  # (within half)
    assert point(10.0, 15.1).climbs and point(1.0, 2.1).climbs
    assert [ok for *_, ok in point(1.0, 2.1).checks()][2] is False
    assert point(math.nan, 1.0).climbs and point(1.0, math.nan).climbs  # (nothing to tell by)
