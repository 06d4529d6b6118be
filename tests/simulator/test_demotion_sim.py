"""HyperFlexis under sustained overload with ``demote_longest`` (Moore-Hodgson per SLO band): on
the 2-task set, tightest-TPOT-first alone serves every gsm8k request and lets sharegpt go late
as a whole; demoting each band's longest requests that its drain cannot fit meets more of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gateway.experiments.replay import summarize
from gateway.simulator.grid import Cell, _scenario
from gateway.simulator.scenario import run

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "routing"


def test_demoting_the_longest_meets_more_slos_under_overload_and_no_fewer_of_the_tight_class(
    tmp_path: Path,
) -> None:
    shipped = (PROFILES / "hyperflexis.yaml").read_text()
    assert "demote_longest: true" in shipped
    plain = tmp_path / "hyperflexis-plain.yaml"
    plain.write_text(shipped.replace("demote_longest: true", "demote_longest: false"))
    # one engine at twice the prior's speed, 1.5x its sustained capacity, 45 s of arrivals (offline:
    # 88.8 % against 80.3 % without demotion)
    cell = Cell("hyperflexis-2task", 2.0, 1.5, 63.1)
    results = {}
    for name, policy in (("demote", "hyperflexis"), ("plain", str(plain))):
        scenario = dataclasses.replace(_scenario(cell, policy, 1, 45.0, 0), engines=1)
        outcomes = run(scenario).outcomes
        results[name] = (
            summarize(outcomes).attainment,
            summarize([o for o in outcomes if o.spec.task == "gsm8k"]).attainment,
        )
    assert results["demote"][0] >= results["plain"][0] + 0.04, results
    assert results["demote"][1] >= results["plain"][1] - 0.01, results
