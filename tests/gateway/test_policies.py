"""Table-driven tests of the routing plugins and pipeline on literal snapshots."""

from __future__ import annotations

import pytest

from policies.api import EngineSnapshot, EngineState, PolicyConfigError, RequestView, Role, estimated_load
from policies.pipeline import compile_profile
from policies.plugins.load import KvFree, LeastLoad, NotSaturated
from policies.plugins.pickers import MaxScore, RoundRobin

REQ = RequestView(request_id="r", model="m", prompt_tokens=10, max_output_tokens=10)


def eng(
    engine_id: str,
    in_flight: int = 0,
    running: int | None = None,
    waiting: int = 0,
    at_scrape: int = 0,
    **kw: object,
) -> EngineSnapshot:
    state = None if running is None else EngineState(num_running=running, num_waiting=waiting, kv_usage=0.5)
    return EngineSnapshot(
        engine_id, "m", in_flight=in_flight, in_flight_at_scrape=at_scrape, state=state, **kw
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (eng("a", in_flight=3), 3.0),  # no metrics: shadow only
        (eng("a", in_flight=3, running=5, waiting=2, at_scrape=3), 7.0),  # engine sees more (other gateways)
        (eng("a", in_flight=6, running=5, waiting=2, at_scrape=3), 10.0),  # 3 dispatched since the scrape
        (eng("a", in_flight=1, running=0, waiting=0, at_scrape=4), 1.0),  # finished since: never below shadow
        (eng("a", in_flight=2, running=9, waiting=0, stale=True), 2.0),  # stale metrics ignored
    ],
)
def test_estimated_load(engine: EngineSnapshot, expected: float) -> None:
    assert estimated_load(engine) == expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0, 0], [1.0, 1.0]),
        ([0, 4], [1.0, 0.0]),
        ([2, 4, 3], [1.0, 0.0, 0.5]),
        ([5], [1.0]),
    ],
)
def test_least_load_scores(loads: list[int], expected: list[float]) -> None:
    engines = [eng(f"e{i}", in_flight=n) for i, n in enumerate(loads)]
    assert LeastLoad().score(REQ, engines, 0.0) == pytest.approx(expected)


def test_least_load_respects_weight() -> None:
    engines = [eng("a", in_flight=4, weight=2.0), eng("b", in_flight=3)]
    assert LeastLoad().score(REQ, engines, 0.0) == pytest.approx([1.0, 0.0])


def test_kv_free_unknown_is_neutral() -> None:
    assert KvFree().score(REQ, [eng("a"), eng("b", running=1)], 0.0) == pytest.approx([0.5, 0.5])


def test_not_saturated_keeps_all_when_all_saturated() -> None:
    f = NotSaturated(max_load=2)
    assert [e.engine_id for e in f.filter(REQ, [eng("a", in_flight=2), eng("b", in_flight=1)], 0)] == ["b"]
    assert len(f.filter(REQ, [eng("a", in_flight=2), eng("b", in_flight=3)], 0)) == 2


def test_round_robin_cycles_in_id_order_and_threads_state() -> None:
    picker = RoundRobin()
    engines = [eng("c"), eng("a"), eng("b")]
    state = picker.initial_state()
    picked = []
    for _ in range(6):
        chosen, state = picker.pick(REQ, engines, [0, 0, 0], state)
        picked.append(chosen.engine_id)
    assert picked == ["a", "b", "c", "a", "b", "c"]


def test_max_score_rotates_ties_only() -> None:
    picker = MaxScore()
    engines = [eng("a"), eng("b"), eng("c")]
    state = picker.initial_state()
    first, state = picker.pick(REQ, engines, [1.0, 1.0, 0.2], state)
    second, state = picker.pick(REQ, engines, [1.0, 1.0, 0.2], state)
    assert {first.engine_id, second.engine_id} == {"a", "b"}
    only, _ = picker.pick(REQ, engines, [0.1, 0.9, 0.2], state)
    assert only.engine_id == "b"


def test_pipeline_least_load_picks_emptiest_of_the_fleet_s_candidates() -> None:
    """The candidates are the fleet's (the router's path): its model's engines in rotation, in
    a role that takes the request whole or its prefill (a pipeline method of the same name, which
    nothing but this test called, is gone)."""
    from gateway.dispatch.offline import offline_fleet
    from gateway.fleet.registry import RunningEntry

    fleet = offline_fleet({"m": 5, "x": 1})
    for rid in ("r1", "r2"):
        fleet.reserve("m-0", rid, RunningEntry(10, 10, 0.1, 0.0))  # busy
    fleet.record_health("m-2", False, 1, 1)  # sick
    fleet.set_draining("m-3", True)  # draining
    fleet.set_role("m-4", Role.DECODE)  # a decode engine takes no request at the front
    candidates = fleet.candidates("m", 0.0)
    assert [e.engine_id for e in candidates] == ["m-0", "m-1"]
    pipeline = compile_profile({"scorers": [{"name": "least_load"}], "picker": {"name": "max_score"}})
    chosen, _ = pipeline.choose(REQ, candidates, pipeline.picker.initial_state(), 0.0)
    assert chosen is not None and chosen.engine_id == "m-1"


def test_pipeline_filter_to_nothing_returns_none() -> None:
    class DropAll:
        def filter(self, request: RequestView, engines: object, now: float) -> list[EngineSnapshot]:
            return []

    pipeline = compile_profile({"picker": {"name": "round_robin"}})
    pipeline = type(pipeline)((("drop", DropAll()),), (), pipeline.picker_name, pipeline.picker)
    assert pipeline.choose(REQ, [eng("a")], 0, 0.0) == (None, 0)


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (
            {"scorers": [{"name": "nope"}]},
            "unknown scorer plugin 'nope'; known scorer plugins: dynamo_cost, kv_free, kv_utilisation, least_load, "
            "lora_affinity, prefix_match, queue_depth, session_affinity, token_load",
        ),
        (
            {"filters": [{"name": "not_saturated", "params": {"max": 3}}]},
            "has no parameter 'max'; it accepts: max_load",
        ),
        ({"filters": [{"name": "not_saturated", "params": {"max_load": 0}}]}, "max_load must be >= 1"),
        ({"scorers": [{"name": "least_load", "weight": -1}]}, "weight must be a finite number >= 0"),
        # inf x a score of 0 is NaN: every pick then failed
        ({"scorers": [{"name": "least_load", "weight": float("inf")}]}, "weight must be a finite number"),
        ({"scorers": [{"name": "least_load", "weight": float("nan")}]}, "weight must be a finite number"),
        ({"scorers": [{"name": "least_load", "weight": True}]}, "weight must be a finite number"),
        ({"picker": {"name": "random"}}, "unknown picker plugin 'random'"),
        ({"scorer": []}, "unknown keys ['scorer']"),
        ({"scorers": "least_load"}, "must be a list"),
        # a misspelt key inside an entry was ignored: the plugin ran on its defaults, unsaid
        ({"scorers": [{"name": "least_load", "wieght": 5}]}, "unknown keys ['wieght']"),
        ({"scorers": [{"name": "prefix_match", "parms": {"max_spread": None}}]}, "unknown keys ['parms']"),
        ({"filters": [{"name": "not_saturated", "weight": 2}]}, "unknown keys ['weight']"),
        ({"picker": {"name": "max_score_random", "seed": 7}}, "unknown keys ['seed']"),
        # NaN passed the guard's bounds, and then no engine was ever over it: the guard was off
        (
            {"scorers": [{"name": "prefix_match", "params": {"max_spread": float("nan")}}]},
            "max_spread must be a finite",
        ),
        (
            {"scorers": [{"name": "prefix_match", "params": {"max_ratio": float("inf")}}]},
            "max_ratio must be a finite",
        ),
    ],
)
def test_bad_profiles_fail_with_a_message_that_says_how_to_fix(
    profile: dict[str, object], message: str
) -> None:
    with pytest.raises(PolicyConfigError) as info:
        compile_profile(profile)
    assert message in str(info.value)
