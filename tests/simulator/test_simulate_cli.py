"""``slogate simulate`` end to end at small scale: table, JSON, plots, rates and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.simulator.cli import parse_rates
from tests.support.strict_json import strict_json


def test_a_small_comparison_writes_its_table_points_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim"
    argv = [
        "simulate",
        "--workload",
        "hyperflexis-4task",
        "--policies",
        "least-load,least-load+prio,hyperflexis",
        "--qps",
        "10:20:10",
        "--engines",
        "2",
        "--requests",
        "200",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "(6/6)" in captured.err  # progress per finished point
    points = strict_json((out / "points.json").read_text())
    assert sorted((p["policy"], p["qps"]) for p in points) == sorted(
        (p, q) for p in ("least-load", "least-load+prio", "hyperflexis") for q in (10.0, 20.0)
    )
    assert all(p["requests"] == 200 and 0.0 <= p["attainment"] <= 1.0 and p["e2e_p50_s"] > 0 for p in points)
    table = (out / "table.md").read_text()
    assert table.count("\n| least-load+prio | ") == 2 and "E2E p50" in table
    assert (out / "attainment_vs_qps.png").stat().st_size > 10_000


def test_a_priority_ramp_is_classified_by_priority_and_plotted_over_time(tmp_path: Path) -> None:
    out = tmp_path / "ramp"
    argv = [
        "simulate",
        "--workload",
        "priority-ramp",
        "--policies",
        "round-robin,hyperflexis",
        "--qps",
        "20",
        "--engines",
        "1",
        "--duration",
        "30",
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    points = strict_json((out / "points.json").read_text())
    assert {p["policy"] for p in points} == {"round-robin", "hyperflexis"}
    assert (out / "ttft_over_time_20qps.png").stat().st_size > 10_000


def test_rates() -> None:
    assert parse_rates("4:16:4") == [4.0, 8.0, 12.0, 16.0]
    assert parse_rates("0.5:1.5:0.5") == [0.5, 1.0, 1.5]
    assert parse_rates("3,1.5") == [3.0, 1.5]
    for bad in ("", "a:b:c", "4:1:0", "0,2", "1:2"):
        with pytest.raises(SystemExit):
            parse_rates(bad)


def test_an_unknown_workload_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no-such-workload"):
        main(["simulate", "--workload", "no-such-workload", "--out", str(tmp_path)])


def test_the_scale_bench_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scale"
    argv = [
        "bench",
        "simulator",
        "--engines",
        "1,2",
        "--per-engine",
        "40",
        "--policies",
        "hyperflexis",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    points = strict_json((out / "points.json").read_text())
    assert [(p["engines"], p["requests"]) for p in points] == [(1, 40), (2, 80)]
    assert all(p["events"] > p["requests"] and p["us_per_event"] > 0 for p in points)
    assert (out / "simulator_scale.png").stat().st_size > 5_000
