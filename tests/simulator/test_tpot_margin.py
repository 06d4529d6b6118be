"""HyperFlexis plans TPOT targets with a margin (``tpot_plan``): with exact predictions Algorithm 1
holds the mean inter-token time at the target itself, so streams it held the others back for
missed it by a millisecond."""

from __future__ import annotations

import math

from gateway.experiments.replay import summarize
from gateway.simulator.grid import Cell, _scenario
from gateway.simulator.scenario import run
from policies.api import RequestView
from policies.hyperflexis import HyperFlexisParams, RunningRequest, WorkerView, dispatch
from policies.queue_order import QueuedRequest

PREFILL = (0.02, 5e-5, 0.0)
DECODE = (0.02, 2e-6, 1e-4)


def _turn(params: HyperFlexisParams) -> tuple[int, float]:
    """(prompt tokens taken, maturity) of one worker running a tight-TPOT stream."""
    running = (RunningRequest(prompt_tokens=500, generated=50, tpot_slo=0.05, prefilled=True),)
    worker = WorkerView("w", PREFILL, DECODE, running=running, maturity=0.0)
    queue = [
        QueuedRequest(RequestView(f"r-{i}", "m", 400, 100, arrival=0.0), ttft_slo=10.0, tpot_slo=0.25, seq=i)
        for i in range(40)
    ]
    decision = dispatch(queue, [worker], 0.0, params)
    taken = sum(400 for a in decision.assignments if a.engine_id == "w")
    return taken, decision.maturity.get("w", math.inf)


def test_a_tpot_margin_takes_less_per_turn_and_holds_longer() -> None:
    exact = _turn(HyperFlexisParams(tpot_plan=1.0))
    planned = _turn(HyperFlexisParams(tpot_plan=0.9))
    assert 0 < planned[0] < exact[0]
    # per prompt token taken, the hold is longer (the running stream gets more time back)
    assert planned[1] / planned[0] > exact[1] / exact[0]


def test_hyperflexis_is_not_below_least_load_where_the_tight_tpot_barely_fits() -> None:
    """tpot-bound on engines at half the prior's speed, 4.27 QPS on two engines (0.74x of their
    sustained capacity; the grid's 0.6x cell while capacity was measured on a short backlog):
    without the margin HyperFlexis attained 46.0 % against least-load's 56.3 %, interactive
    streams at 41 ms against their 40 ms target."""
    cell = Cell("tpot-bound", 0.5, 0.6, 4.27)
    attained = {
        policy: summarize(run(_scenario(cell, policy, 2, 60.0, 0)).outcomes).attainment
        for policy in ("hyperflexis", "least-load")
    }
    assert attained["hyperflexis"] >= attained["least-load"], attained
