"""Small runs of both experiments so the runners cannot rot (real figures come from the CLI)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from gateway.cli import main as cli_main
from gateway.experiments.replay import Outcome, percentile, summarize
from gateway.experiments.runner import run_point
from gateway.experiments.workload import HYPERFLEXIS_4TASK, RequestSpec, poisson_workload, priority_ramp
from tests.support.strict_json import strict_json


def test_workloads_have_the_requested_shape() -> None:
    load = poisson_workload(HYPERFLEXIS_4TASK, qps=8.0, per_task=50, seed=1)
    assert len(load) == 200 and all(a.at <= b.at for a, b in itertools.pairwise(load))
    assert 180 / 8.0 < load[-1].at < 320 / 8.0  # ~25 s of arrivals at 8 QPS
    ramp = priority_ramp(HYPERFLEXIS_4TASK, qps_per_client=10, join_every_s=2, duration_s=8, seed=1)
    first_p0 = min(r.at for r in ramp if r.priority == 0)
    assert first_p0 >= 6 and min(r.at for r in ramp if r.priority == 3) < 1


def test_summary_counts_both_objectives() -> None:
    spec = RequestSpec(0.0, "t", 0, 10, 5, ttft_s=1.0, tpot_s=0.1)
    outcomes = [
        Outcome(spec, 200, 0.5, 0.05, 1.0, 5, 0.0),  # both met
        Outcome(spec, 200, 0.5, 0.50, 1.0, 5, 0.0),  # TPOT missed
        Outcome(spec, 429, float("inf"), 0.0, 0.0, 0, 0.0),  # shed
    ]
    s = summarize(outcomes)
    assert (s.attainment, s.ttft_attainment, s.errors) == (1 / 3, 2 / 3, 1)
    # latency is over the requests served; none served is no latency, not 0 s
    shed = summarize(outcomes[2:])
    assert math.isnan(shed.e2e_mean_s) and math.isnan(shed.e2e_p99_s) and shed.errors == 1


def test_percentiles_are_by_nearest_rank() -> None:
    """``int(q * n)`` made p99 the largest of any 100 values or fewer, and one rank high beyond."""
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 0.99) == 99.0 and percentile(hundred, 0.5) == 50.0
    assert percentile(hundred, 1.0) == 100.0 and percentile(hundred, 0.0) == 1.0
    assert percentile([float(i) for i in range(1, 1001)], 0.99) == 990.0
    assert percentile([7.0], 0.99) == 7.0 and math.isnan(percentile([], 0.5))


def test_attainment_point_smoke() -> None:
    result, outcomes = run_point(
        "hyperflexis",
        20.0,
        HYPERFLEXIS_4TASK,
        per_task=5,
        engines=2,
        profile="qwen-7b",
        time_scale=10.0,
        slo_profile="hyperflexis-4task",
        seed=0,
    )
    assert len(outcomes) == 20 and all(o.status == 200 for o in outcomes)
    assert 0.0 <= result.summary.attainment <= 1.0 and result.cost_units > 0
    assert set(result.by_task) == {t.name for t in HYPERFLEXIS_4TASK} and len(result.runs) == 1


def test_attainment_cli_pools_repeated_runs(tmp_path: Path) -> None:
    argv = ["experiment", "attainment", "--policies", "round-robin", "--qps", "20", "--per-task", "2"]
    argv += ["--repeat", "2", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    (row,) = strict_json((tmp_path / "results.json").read_text())
    assert row["requests"] == 16 and len(row["attainment_per_run"]) == 2  # 4 tasks x 2 x 2 seeds
    assert row["attainment"] == sum(row["attainment_per_run"]) / 2  # equal-sized runs pool to the mean
    assert "runs min-max" in (tmp_path / "table.txt").read_text()
    assert (tmp_path / "attainment_vs_qps.png").stat().st_size > 1000


def test_priority_ramp_smoke(tmp_path: Path) -> None:
    # through the CLI, so the command's registration is covered too
    argv = ["experiment", "priority-ramp", "--policies", "hyperflexis", "--qps", "8", "--join-every", "0.5"]
    argv += ["--duration", "2.5", "--engines", "1", "--time-scale", "5", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    report = strict_json((tmp_path / "results.json").read_text())
    assert report["hyperflexis"] and (tmp_path / "ttft_over_time.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("policies", "qps", "repeat"),
    [
        (["least-load", "leastload"], "2,4", 1),  # a misspelt profile
        (["least-load"], "2,4,0", 1),
        (["least-load"], "nan", 1),
        (["least-load"], "2", 0),
        ([], "2", 1),
    ],
)
def test_bad_experiment_inputs_stop_it_before_the_first_run(
    policies: list[str], qps: str, repeat: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked only when their point came up, they ended the command after the points before
    them had run, and nothing was written (the results are written at the end)."""
    from gateway.experiments.runner import _checked_inputs

    with pytest.raises(SystemExit) as info:
        _checked_inputs(policies, qps, repeat)
    assert info.value.code == 2 and "slogate experiment:" in capsys.readouterr().err
    assert _checked_inputs(["least-load", "hyperflexis+prio"], "2,4", 2) == [2.0, 4.0]


def test_the_live_replay_sends_the_bound_and_the_answer_s_own_length() -> None:
    """With task-level bounds the engine learns each answer's length from the body as well as
    the header: a gateway that does not relay x-sim-* headers dropped it, and with the bound as
    max_tokens and ignore_eos every answer ran to its task's bound."""
    import asyncio

    from gateway.experiments.replay import replay
    from tests.gateway.stub_engines import HeaderEngine

    spec = RequestSpec(0.0, "t", 0, 10, 5, ttft_s=1.0, tpot_s=0.1, max_tokens=50)
    with HeaderEngine() as engine:
        outcomes = asyncio.run(replay(engine.url, "m", [spec], 1.0, progress=False))
        sent = engine.received[-1]
    assert outcomes[0].status == 200
    assert sent["max_tokens"] == 50 and sent["sim_output_len"] == 5 and sent["ignore_eos"] is True
    assert engine.headers[-1]["x-sim-output-len"] == "5"
