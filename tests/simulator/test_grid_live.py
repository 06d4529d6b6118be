"""The grid's live check: a cell replayed in real time through engine and gateway processes (the
engines at the cell's true speed, the gateway with the profile's prior) agrees with the offline
run of the same requests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.simulator.disturbance import Disturbance
from gateway.simulator.grid import Cell, _run, _scenario, live_check


@pytest.mark.alone  # (live against offline)
def test_a_cell_replayed_live_agrees_with_the_simulator_at_the_engines_true_speed() -> None:
    # engines twice the prior's speed: were the speed not applied live, every request would
    # take about twice as long there as offline
    cell = Cell("hyperflexis-2task", 2.0, 0.6, 25.0)
    scenario = _scenario(cell, "hyperflexis", 1, 3.0, 0)
    offline = _run(cell, "hyperflexis", scenario)
    table = live_check([offline], [(cell, "hyperflexis", scenario)])
    row = [c.strip() for c in table.splitlines()[-1].split("|")[1:-1]]
    assert row[:2] == [cell.name, "hyperflexis"]
    offline_att, live_att = (float(x.rstrip("%")) / 100 for x in row[2:4])
    assert abs(offline_att - offline.attainment) <= 0.0005
    assert abs(live_att - offline_att) <= 0.1, table
    offline_p50, live_p50 = float(row[5]), float(row[6])
    assert abs(live_p50 - offline_p50) <= 0.25 * offline_p50, table


def test_a_run_the_live_check_cannot_replay_is_a_row_that_says_so_and_the_rest_still_run(
    tmp_path: Path,
) -> None:
    cell = Cell("hyperflexis-2task", 1.0, 0.6, 25.0)
    # a disturbance the live stack does not set up: refused before any process starts
    scenario = dataclasses.replace(
        _scenario(cell, "hyperflexis", 1, 1.0, 0), disturbances=(Disturbance.parse("stale-scrapes:1:2"),)
    )
    offline = _run(cell, "hyperflexis", dataclasses.replace(scenario, disturbances=()))
    out = tmp_path / "live.md"
    table = live_check([offline], [(cell, "hyperflexis", scenario)], out)
    assert "failed: a live replay does not set up disturbances" in table
    assert out.read_text().strip() == table.strip()
