"""The fleet's ranked index gives exactly the engine the full least-load pass would.

Two fleets receive the same random sequence of reservations, releases, scrapes and health flips;
one router uses the index, the other the scorer over every candidate. After every operation both
must choose the same engine (or both none), picker state included, so ties rotate alike.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch.offline import offline_fleet
from gateway.fleet.rank_index import RankIndex
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.router import Router
from policies.api import EngineSnapshot, EngineState, RequestView
from policies.pipeline import compile_profile

LEAST_LOAD = {"scorers": [{"name": "least_load"}]}

op = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 15)),
    st.tuples(st.just("release"), st.integers(0, 15)),
    st.tuples(st.just("scrape"), st.integers(0, 15), st.integers(0, 6), st.integers(0, 6)),
    st.tuples(st.just("health"), st.integers(0, 15), st.booleans()),
    st.tuples(st.just("choose"), st.integers(1, 4), st.booleans()),
)


def _apply(fleet: Fleet, step: tuple[object, ...], seq: int, now: float) -> None:
    kind = step[0]
    ids = list(fleet.records)
    engine = ids[int(step[1]) % len(ids)]  # type: ignore[call-overload]
    record = fleet.records[engine]
    if kind == "reserve":
        fleet.reserve(engine, f"r{seq}", RunningEntry(10, 10, 0.1, now))
    elif kind == "release" and record.running:
        fleet.release(engine, next(iter(record.running)))
    elif kind == "scrape":
        fleet.record_state(engine, EngineState(num_running=int(step[2]), num_waiting=int(step[3])), now)  # type: ignore[call-overload]
    elif kind == "health":
        fleet.record_health(engine, bool(step[2]), 1, 1)


@settings(max_examples=200, deadline=None)
@given(engines=st.integers(1, 16), ops=st.lists(op, min_size=1, max_size=80))
def test_ranked_choice_equals_the_full_pass(engines: int, ops: list[tuple[object, ...]]) -> None:
    fast_fleet, full_fleet = offline_fleet({"m": engines}), offline_fleet({"m": engines})
    fast = Router(fast_fleet, compile_profile(LEAST_LOAD))
    full = Router(full_fleet, compile_profile(LEAST_LOAD))
    full._ranked = False  # the reference: score every candidate
    assert fast._ranked
    for seq, step in enumerate(ops):
        now = seq * 0.01
        if step[0] == "choose":
            view = RequestView(f"q{seq}", "m", 10, 10)
            max_load = float(step[1]) if step[2] else None  # type: ignore[arg-type]
            a = fast.choose(view, max_load=max_load, now=now)
            b = full.choose(view, max_load=max_load, now=now)
            assert (a and a.engine_id) == (b and b.engine_id)
            assert fast._picker_state == full._picker_state
            continue
        _apply(fast_fleet, step, seq, now)
        _apply(full_fleet, step, seq, now)


def test_the_index_follows_loads_and_keeps_fleet_order_in_ties() -> None:
    def snap(i: int, in_flight: int) -> EngineSnapshot:
        return EngineSnapshot(engine_id=f"e{i}", model="m", in_flight=in_flight)

    index = RankIndex(lambda e: e.load)
    index.reset([snap(0, 2), snap(1, 1), snap(2, 1), snap(3, 3)])
    assert index.least() == [1, 2]
    index.update(2, snap(2, 0))
    assert index.least() == [2]
    index.update(2, snap(2, 1))
    index.update(0, snap(0, 1))
    assert index.least() == [0, 1, 2]  # fleet order, whatever order they joined in
    for slot in (0, 1, 2):
        index.update(slot, snap(slot, 5))
    assert index.least() == [3]


def test_weighted_engines_keep_the_full_pass() -> None:
    fleet = offline_fleet({"m": 2})
    fleet.records["m-1"].adapter.config.weight = 2.0
    assert not Router(fleet, compile_profile(LEAST_LOAD))._ranked
    assert (
        Router(offline_fleet({"m": 2}), compile_profile({"scorers": [{"name": "kv_free"}]}))._ranked is False
    )


def test_ranking_turned_on_after_candidates_were_read_does_not_break_snapshots() -> None:
    fleet = offline_fleet({"m": 3})
    fleet.candidates("m", 0.0)  # routable slots exist before the index does
    router = Router(fleet, compile_profile(LEAST_LOAD))
    fleet.reserve("m-1", "r", RunningEntry(10, 10, 0.1, 0.0))
    fleet.snapshot(0.1)
    view = RequestView("q", "m", 10, 10)
    first = router.choose(view, now=0.2)
    assert first is not None and first.engine_id != "m-1"


def test_a_snapshot_entry_carries_each_field_of_its_engine() -> None:
    """The fleet makes entries positionally (they are made on every reservation and release):
    each field must still come from its own source, whatever order the fields are declared in."""
    from gateway.dispatch.offline import fleet_of
    from gateway.settings import EngineConfig
    from policies.api import Role

    config = EngineConfig(
        url="http://127.0.0.1:10000",
        kind="vllm",  # type: ignore[arg-type]
        model="m",
        name="e",
        role=Role.PREFILL,
        weight=2.5,
        priority_scheduling=False,  # (not the True of healthy: the two could be swapped unseen)
    )
    fleet = fleet_of([config], 3.0)
    record = fleet.records["e"]
    state = EngineState(num_running=3, num_waiting=4, kv_usage=0.25)
    fleet.record_state("e", state, 10.0)
    fleet.reserve("e", "r1", RunningEntry(100, 20, 0.1, 10.0))
    record.adapters = frozenset({"lora-a"})
    fleet.touch("e")
    snap = fleet.engine_snapshot("e", now=11.0)
    expected = EngineSnapshot(
        engine_id="e",
        model="m",
        role=Role.PREFILL,
        healthy=True,
        stale=False,
        weight=2.5,
        in_flight=1,
        in_flight_tokens=120,
        in_flight_at_scrape=0,
        state=record.state,
        accepts_priority=False,
        running_tokens=100,
        adapters=frozenset({"lora-a"}),
    )
    assert snap == expected and snap.load == expected.load
    assert fleet.engine_snapshot("e", now=100.0).stale is False  # (not dirty: the entry stands)
    fleet.touch("e")
    assert fleet.engine_snapshot("e", now=100.0).stale is True
