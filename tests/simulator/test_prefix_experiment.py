"""``slogate experiment prefix`` in seconds: a shrunk KV cache reaches the engines, the hit rate is
the engines' own, and the verdict reads the points as the issue states its targets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.experiments.workload import RequestSpec
from gateway.simulator.prefix_experiment import (
    Point,
    add_prefix_arguments,
    combine,
    oracle_hit_rate,
    prefix_main,
    run_point,
    scenario,
    verdict,
)
from gateway.simulator.scenario import Simulation
from tests.support.strict_json import strict_json


def test_the_kv_cache_is_shrunk_on_the_engines_and_the_gateway_sees_it() -> None:
    sim = Simulation(scenario("prefix-sessions", "round-robin", 8.0, 300, 10, 0))
    assert all(node.model.cache.num_blocks == 300 for node in sim.nodes)
    assert all(node.state().num_gpu_blocks == 300 for node in sim.nodes)


def test_prefix_aware_finds_more_history_cached_than_round_robin_with_a_small_cache() -> None:
    aware = run_point(scenario("prefix-sessions", "prefix-aware", 8.0, 1024, 200, 0))
    rr = run_point(scenario("prefix-sessions", "round-robin", 8.0, 1024, 200, 0))
    assert aware.requests == rr.requests == 200
    assert sum(rr.served.values()) == 200
    assert 0.0 < rr.hit_rate < aware.hit_rate < 1.0
    assert rr.imbalance == pytest.approx(1.0)


def _spec(at: float, *segments: tuple[int, int]) -> RequestSpec:
    return RequestSpec(
        at=at,
        task="t",
        priority=0,
        prompt_tokens=sum(n for _, n in segments),
        output_tokens=1,
        ttft_s=1.0,
        tpot_s=1.0,
        segments=segments,
    )


def test_oracle_counts_the_longest_earlier_prefix_in_whole_blocks() -> None:
    specs = [_spec(0.0, (1, 40), (2, 10)), _spec(1.0, (1, 40), (2, 10), (3, 14)), _spec(2.0, (9, 16))]
    # second request: 50 shared tokens -> 48 in whole blocks of 16; the others find nothing
    assert oracle_hit_rate(specs, 16) == pytest.approx(48 / (50 + 64 + 16))


def _point(policy: str, qps: float, hit: float, p99: float, att: float, served: list[int]) -> Point:
    return Point(
        "w",
        policy,
        qps,
        100,
        hit,
        p99 / 2,
        p99,
        att,
        0,
        0,
        {f"e{i}": n for i, n in enumerate(served)},
        {f"e{i}": 1.0 for i in range(len(served))},
    )


@pytest.mark.parametrize(
    ("ours", "met"),
    [
        # (hit, TTFT p99, attainment, served): every target met
        ((0.8, 1.0, 0.9, [26, 25, 25, 24]), [True, True, True, True]),
        # hit rate under 2x round robin's, p99 above least load's
        ((0.6, 2.5, 0.9, [26, 25, 25, 24]), [False, False, True, True]),
        # a hot spot (max/mean 1.6) and a peer attaining more
        ((0.9, 1.0, 0.7, [40, 20, 20, 20]), [True, True, False, False]),
    ],
)
def test_verdict_is_taken_where_round_robin_last_attains_half(
    ours: tuple[float, float, float, list[int]], met: list[bool]
) -> None:
    hit, p99, att, served = ours
    even = [25, 25, 25, 25]
    points = [
        _point("round-robin", 10, 0.3, 1.0, 0.9, even),
        _point("round-robin", 20, 0.35, 2.0, 0.6, even),  # the verdict's QPS
        _point("round-robin", 30, 0.35, 9.0, 0.4, even),
        _point("least-load", 20, 0.35, 2.0, 0.7, even),
        _point("sglang", 20, 0.6, 1.5, 0.8, [50, 20, 15, 15]),
        _point("prefix-aware", 20, hit, p99, att, served),
        _point("prefix-aware", 30, hit, p99, att, even),
    ]
    v = verdict(points, "w", "prefix-aware")
    assert v.qps == 20
    assert [ok for _, ok, _ in v.checks] == met
    assert v.met == all(met)


def test_no_verdict_when_round_robin_never_attains_half() -> None:
    points = [
        _point("round-robin", 10, 0.3, 9.0, 0.2, [1, 1]),
        _point("prefix-aware", 10, 0.6, 1.0, 0.9, [1, 1]),
    ]
    assert verdict(points, "w", "prefix-aware").qps is None


def test_the_command_writes_table_json_and_plot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_prefix_arguments(parser)
    args = parser.parse_args(
        [
            "--policies",
            "round-robin,least-load,prefix-aware",
            "--workloads",
            "prefix-sessions,prefix-trap",
            "--sessions-qps",
            "8",
            "--trap-qps",
            "8",
            "--seeds",
            "2",
            "--requests",
            "60",
            "--kv-blocks",
            "512",
            "--jobs",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert prefix_main(args) == 0
    text = (tmp_path / "prefix.md").read_text()
    assert "### prefix-sessions" in text and "### prefix-trap" in text and "**prefix-aware**" in text
    assert "mean of 2 seeds" in text and "Verdict (prefix-sessions, prefix-aware)" in text
    assert "hyperflexis-prefix" not in text  # one of ours by default, not run here: no verdict
    data = strict_json((tmp_path / "prefix.json").read_text())
    assert len(data["points"]) == 6 and data["kv_blocks"] == 512 and data["seeds"] == 2
    assert all(p["seeds"] == 2 and p["requests"] == 120 for p in data["points"])
    assert (tmp_path / "prefix.png").stat().st_size > 0


def test_seeds_combine_into_means_with_their_range_and_the_worst_imbalance() -> None:
    a = _point("p", 10, 0.4, 2.0, 0.8, [30, 10])
    b = _point("p", 10, 0.6, 4.0, 1.0, [20, 20])
    both = combine([a, b])
    assert both.seeds == 2 and both.requests == 200
    assert both.hit_rate == pytest.approx(0.5) and both.hit_range == (0.4, 0.6)
    assert both.attainment == pytest.approx(0.9) and both.attainment_range == (0.8, 1.0)
    assert both.ttft_p99_s == pytest.approx(3.0)
    assert both.served == {"e0": 50, "e1": 30}
    assert both.imbalance == pytest.approx(1.5)  # the first seed's 30/20, not the sums' 50/40
    assert combine([a]) is a


def test_hyperflexis_prefix_finds_more_history_than_hyperflexis() -> None:
    # history only: a turn finds its prompt cached only where its session went; HyperFlexis
    # without the index spreads the turns like round robin does
    plain = run_point(scenario("prefix-history", "hyperflexis", 6.0, 2048, 300, 0))
    aware = run_point(scenario("prefix-history", "hyperflexis-prefix", 6.0, 2048, 300, 0))
    assert aware.hit_rate >= 1.5 * plain.hit_rate
    assert aware.attainment >= plain.attainment - 0.02
