"""`slogate experiment grid`: a small run so it cannot rot, and the verdicts' baselines."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.simulator.grid import Cell, Result, _run, _scenario, plot, pooled, verdicts


def _result(cell: Cell, policy: str, attainment: float) -> Result:
    return Result(cell, policy, attainment, {}, 1.0, 2.0, 0, 1.0, 100)


def test_a_candidates_variants_are_not_its_baselines() -> None:
    cell = Cell("tpot-bound", 1.0, 1.2, 10.0)
    results = [
        _result(cell, "least-load", 0.30),
        _result(cell, "hyperflexis", 0.80),
        _result(cell, "hyperflexis-wspt", 0.75),
    ]
    # against every other policy, the variant that does better makes the candidate look "BELOW"
    assert verdicts(results, "hyperflexis-wspt")[0][2:] == (0.80, "BELOW")
    # against the baselines only, it wins its overload cell by 2.5x
    assert verdicts(results, "hyperflexis-wspt", ["hyperflexis"])[0][2:] == (0.30, "1.3x win")
    # where the best baseline is above 1/1.3, no candidate can win 1.3x: said so, not "ok"
    strong = [_result(cell, "least-load", 0.90), _result(cell, "hyperflexis", 0.91)]
    assert verdicts(strong, "hyperflexis")[0][3] == "1.3x impossible"
    # nothing attained by anyone is no win (0 >= 1.3 x 0 must not count as one)
    nothing = [_result(cell, "least-load", 0.0), _result(cell, "hyperflexis", 0.0)]
    assert verdicts(nothing, "hyperflexis")[0][3] == "no 1.3x win"
    assert verdicts([*nothing[:1], _result(cell, "hyperflexis", 0.1)], "hyperflexis")[0][3] == "1.3x win"
    # a cell that does not ask for a win (below 1.2x load, not tpot-bound) is just "ok"
    light = Cell("hyperflexis-4task", 1.0, 0.8, 10.0)
    assert (
        verdicts([_result(light, "least-load", 0.5), _result(light, "hyperflexis", 0.6)], "hyperflexis")[0][3]
        == "ok"
    )
    # and a candidate under 1.3x the best baseline where 1.3x is still possible is no win
    weak = [_result(cell, "least-load", 0.60), _result(cell, "hyperflexis", 0.70)]
    assert verdicts(weak, "hyperflexis")[0][3] == "no 1.3x win"
    # no baseline in the cell (or no result for the candidate): nothing to judge, not "ok"
    alone = [_result(cell, "hyperflexis", 0.05), _result(cell, "hyperflexis-wspt", 0.05)]
    assert verdicts(alone, "hyperflexis-wspt", ["hyperflexis"])[0][3] == "n/a"


def test_a_grid_with_no_baseline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no baseline"):
        main(
            ["experiment", "grid", "--policies", "hyperflexis,hyperflexis-wspt",
             "--candidate", "hyperflexis-wspt,hyperflexis", "--out", str(tmp_path)]
        )  # fmt: skip
    with pytest.raises(SystemExit, match="names no policy"):
        main(["experiment", "grid", "--candidate", ",", "--out", str(tmp_path)])
    # load 0 marks the priority ramp's cell: as a load it ran the ramp in a worker and crashed there
    with pytest.raises(SystemExit, match="each > 0"):
        main(["experiment", "grid", "--loads", "0,1", "--out", str(tmp_path)])


def test_the_grid_runs_and_writes_its_table_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    code = main(
        [
            "experiment", "grid", "--workloads", "hyperflexis-4task", "--speeds", "1", "--loads", "1.2",
            "--policies", "least-load,hyperflexis,hyperflexis-wspt",
            "--candidate", "hyperflexis-wspt,hyperflexis",
            "--engines", "1", "--duration", "10", "--ramp-qps", "0", "--jobs", "1", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    rows = json.loads((out / "grid.json").read_text())
    assert {r["policy"] for r in rows} == {"least-load", "hyperflexis", "hyperflexis-wspt"}
    assert all(0.0 <= r["attainment"] <= 1.0 and r["requests"] > 0 for r in rows)
    table = (out / "grid.md").read_text()
    assert "hyperflexis-wspt / best" in table and "hyperflexis-4task speed 1x load 1.2x" in table
    # each candidate's ratio is to least-load, the one baseline (the other is a variant)
    got = {r["policy"]: r["attainment"] for r in rows}
    header, row = [
        [c.strip() for c in line.split("|")]
        for line in table.splitlines()
        if line.startswith("| cell | best baseline")
        or line.startswith("| hyperflexis-4task speed 1x load 1.2x | least")
    ]
    for candidate in ("hyperflexis-wspt", "hyperflexis"):
        ratio = row[header.index(f"{candidate} / best")]
        assert ratio == f"{got[candidate] / got['least-load']:.2f}"
    assert "hyperflexis-wspt: " in table and "(1 cells, 1 that must show a 1.3x win)" in table
    assert (out / "grid.png").stat().st_size > 10_000


def test_a_disturbance_reaches_every_offline_run_and_is_refused_live(tmp_path: Path) -> None:
    base = ["experiment", "grid", "--workloads", "hyperflexis-2task", "--speeds", "0.5", "--loads", "1.2",
            "--policies", "wspt,hyperflexis", "--engines", "1", "--duration", "20", "--ramp-qps", "0",
            "--jobs", "1"]  # fmt: skip
    attainment = {}
    for name, extra in (("clean", []), ("relayed", ["--disturb", "relay-delay:0:1000:0.5"])):
        assert main([*base, *extra, "--out", str(tmp_path / name)]) == 0
        rows = json.loads((tmp_path / name / "grid.json").read_text())
        attainment[name] = {r["policy"]: r["attainment"] for r in rows}
    # every token half a second late: the 0.7 s TTFT class misses far more, whatever the policy
    for policy in ("wspt", "hyperflexis"):
        assert attainment["relayed"][policy] < attainment["clean"][policy] - 0.1
    with pytest.raises(SystemExit, match="offline only"):
        main([*base, "--disturb", "relay-delay:0:1000:0.02", "--live", "--out", str(tmp_path / "live")])


def test_runs_of_several_seeds_pool_their_requests(tmp_path: Path) -> None:
    cell = Cell("tpot-bound", 1.0, 1.2, 10.0)
    a = Result(cell, "p", 0.5, {"x": 1.0, "y": 0.0}, 1.0, 4.0, 1, 2.0, 100, {"x": 50, "y": 50})
    b = Result(cell, "p", 0.8, {"x": 0.5, "y": 1.0}, 3.0, 6.0, 2, 4.0, 300, {"x": 100, "y": 200})
    got = pooled([a, b])
    assert got.requests == 400 and got.seeds == 2 and got.errors == 3
    assert got.attainment == pytest.approx((50 + 240) / 400)
    assert got.by_task == pytest.approx({"x": 100 / 150, "y": 200 / 250})
    assert got.task_requests == {"x": 150, "y": 250}
    assert (got.e2e_p50_s, got.e2e_p99_s, got.cost_units) == (2.0, 5.0, 3.0)
    assert pooled([a]) is a
    # from the command line: every run of every seed, pooled per cell and policy
    out = tmp_path / "grid"
    code = main(
        [
            "experiment", "grid", "--workloads", "hyperflexis-4task", "--speeds", "1", "--loads", "1.2",
            "--policies", "least-load,hyperflexis", "--seeds", "3,4",
            "--engines", "1", "--duration", "3", "--ramp-qps", "0", "--jobs", "1", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    rows = json.loads((out / "grid.json").read_text())
    assert [r["seeds"] for r in rows] == [2, 2]
    # each pooled row is its seeds' runs together: run them one by one, as the grid does
    for row in rows:
        cell = Cell(row["workload"], row["speed"], row["load"], row["qps"])
        each = [_run(cell, row["policy"], _scenario(cell, row["policy"], 1, 3.0, seed)) for seed in (3, 4)]
        assert row["requests"] == sum(r.requests for r in each)
        met = sum(r.attainment * r.requests for r in each)
        assert row["attainment"] == pytest.approx(met / row["requests"])
    with pytest.raises(SystemExit):
        main(["experiment", "grid", "--seeds", "1,1", "--out", str(tmp_path / "bad")])


def test_a_grid_of_the_ramp_alone_plots_a_bar_per_policy(tmp_path: Path) -> None:
    """The ramp has no load axis: alone it left an empty figure and a legend warning."""
    cell = Cell("priority-ramp", 1.0, 0.0, 60.0)
    results = [
        Result(cell, policy, attained, {}, 1.0, 2.0, 0, 1.0, 100, {})
        for policy, attained in (("wspt", 0.68), ("hyperflexis", 0.89))
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(results, tmp_path / "ramp.png")
    assert (tmp_path / "ramp.png").stat().st_size > 10_000
