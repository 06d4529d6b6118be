"""SLO outcome accounting: each objective judged on its own, per class."""

from __future__ import annotations

import pytest

from gateway import metrics
from gateway.dispatch.slo_service import SloService
from gateway.settings import load_settings
from policies.slo import SloSource, SloTarget

TARGET = SloTarget(ttft_s=1.0, tpot_s=0.1, slo_class="acct-test", source=SloSource.TASK)


def outcome(objective: str, result: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "slogate_slo_outcomes_total", {"slo_class": "acct-test", "objective": objective, "outcome": result}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "met"),
    [
        (0.5, 0.05, {"ttft", "tpot", "both"}),
        (2.0, 0.05, {"tpot"}),  # late first token, steady stream: TPOT met, TTFT and both missed
        (0.5, 0.20, {"ttft"}),
        (0.5, None, {"ttft", "tpot", "both"}),  # one token: no inter-token time to miss
        (None, None, set()),  # failed or shed
    ],
)
def test_each_objective_is_judged_on_its_own(
    ttft_s: float | None, tpot_s: float | None, met: set[str]
) -> None:
    slo = SloService(load_settings(None))
    before = {(o, r): outcome(o, r) for o in ("ttft", "tpot", "both") for r in ("met", "missed")}
    slo.finished(TARGET, None, "e0", ttft_s, tpot_s, 0.0, 10, 10, 1)
    for objective in ("ttft", "tpot", "both"):
        result = "met" if objective in met else "missed"
        assert outcome(objective, result) == before[(objective, result)] + 1, objective
