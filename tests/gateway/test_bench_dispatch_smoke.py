"""Smoke run of ``slogate bench dispatch``: a tiny grid, so the benchmark cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from tests.support.strict_json import strict_json


def test_bench_dispatch_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "dispatch",
            "--engines",
            "4,8",
            "--queued",
            "40",
            "--seconds",
            "0.4",
            "--rate",
            "400",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    points = strict_json((out / "points.json").read_text())
    assert {(p["dispatcher"], p["engines"]) for p in points} == {
        ("pipeline", 4),
        ("pipeline", 8),
        ("hyperflexis", 4),
        ("hyperflexis", 8),
        ("floor", 4),
        ("floor", 8),
    }
    for p in points:
        assert p["placements"] > 0 and p["us_per_placement"] > 0 and 0 < p["loop_share"] < 1
        assert p["mean_queued"] >= 1  # saturated: requests were waiting throughout
        assert p["warmup_s"] == pytest.approx(0.2)
        # where the time went adds up to the whole, and every part was reached
        split = dict(p["split_us"])
        assert set(split) == {"arrivals", "turns", "engine events"} and all(v > 0 for v in split.values())
        assert sum(split.values()) == pytest.approx(p["us_per_placement"])
    assert (out / "dispatch_cost.png").stat().st_size > 10_000
    table = (out / "table.md").read_text()
    assert "µs per placement" in table
    # the floor is a reference, never judged against the targets
    assert all("(the floor)" in line for line in table.splitlines() if line.startswith("| floor"))


def test_the_measurement_starts_once_the_standing_queue_has_turned_over() -> None:
    from gateway.bench.dispatch import steady_state_after

    # 10,000 queued at 1,000 placements/s wait 10 s: measured from 11 s, when the late ones are in
    assert steady_state_after(10_000, 1000.0, 3.0) == pytest.approx(11.0)
    # a short queue turns over at once: the fleet's fill sets the warm-up
    assert steady_state_after(40, 400.0, 0.4) == pytest.approx(0.2)
    assert steady_state_after(1000, 1000.0, 3.0) == pytest.approx(1.5)


def test_bench_dispatch_repeats_keep_the_median_run_whole(tmp_path: Path) -> None:
    """With --repeats each point is its median run, whole, with every run's figure beside it."""
    out = tmp_path / "bench"
    argv = ["bench", "dispatch", "--engines", "4", "--queued", "40", "--seconds", "0.3", "--rate", "400"]
    assert main([*argv, "--dispatchers", "floor", "--repeats", "3", "--out", str(out)]) == 0
    (point,) = strict_json((out / "points.json").read_text())
    runs = point["runs_us"]
    assert len(runs) == 3 and point["us_per_placement"] == sorted(runs)[1]
    assert " (runs " in (out / "table.md").read_text()
    assert main([*argv, "--repeats", "0", "--out", str(out)]) == 2


def test_the_median_run_is_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each point is one run's figures, all of them (not a mix of runs), with every run's µs."""
    from dataclasses import replace

    from gateway.bench import dispatch as bench

    base = bench.DispatchPoint("floor", 4, 40, 100, 100.0, 0.0, 0.01, 40.0, 1.0)
    figures = iter([(30.0, 3.0), (10.0, 1.0), (20.0, 2.0), (40.0, 4.0), (60.0, 6.0), (50.0, 5.0)])

    async def fake_run(*_args: object) -> bench.DispatchPoint:
        us, longest = next(figures)
        return replace(base, us_per_placement=us, max_call_ms=longest)

    monkeypatch.setattr(bench, "_run_point", fake_run)
    (point,) = bench.run_dispatch_bench([4], [40], ["floor"], seconds=0.1, repeats=3)
    assert (point.us_per_placement, point.max_call_ms, point.runs_us) == (20.0, 2.0, (30.0, 10.0, 20.0))
    (single,) = bench.run_dispatch_bench([4], [40], ["floor"], seconds=0.1, repeats=1)
    assert single.us_per_placement == 40.0 and single.runs_us == ()
    (even,) = bench.run_dispatch_bench([4], [40], ["floor"], seconds=0.1, repeats=2)
    assert (even.us_per_placement, even.max_call_ms) == (60.0, 6.0)  # (the higher middle, as overhead's)
