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
    # out of rotation and back without a health change: a drain (a role flip's), a stall
    st.tuples(st.just("drain"), st.integers(0, 15), st.booleans()),
    st.tuples(st.just("stall"), st.integers(0, 15), st.booleans()),
    st.tuples(st.just("choose"), st.integers(1, 4), st.booleans()),
    # time passes (scraped states may go stale) and the monitor's check touches every engine
    st.tuples(st.just("tick"), st.integers(0, 15), st.floats(0.0, 5.0)),
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
    elif kind == "drain":
        fleet.set_draining(engine, bool(step[2]))
    elif kind == "stall":
        fleet.set_stalled(engine, bool(step[2]))
    elif kind == "tick":
        for other in ids:
            fleet.touch(other)


@settings(max_examples=200, deadline=None)
@given(engines=st.integers(1, 16), ops=st.lists(op, min_size=1, max_size=80))
def test_ranked_choice_equals_the_full_pass(engines: int, ops: list[tuple[object, ...]]) -> None:
    fast_fleet, full_fleet = offline_fleet({"m": engines}), offline_fleet({"m": engines})
    fast = Router(fast_fleet, compile_profile(LEAST_LOAD))
    full = Router(full_fleet, compile_profile(LEAST_LOAD))
    full._ranked = False  # the reference: score every candidate
    assert fast._ranked
    clock = 0.0
    for seq, step in enumerate(ops):
        # time passes only with the monitor's tick (which touches every engine), as live: the ranked
        # index re-reads an entry's staleness when it is rebuilt, at least once per tick
        if step[0] == "tick":
            clock += float(step[2])  # type: ignore[arg-type]
        now = clock
        if step[0] == "choose":
            view = RequestView(f"q{seq}", "m", 10, 10)
            max_load = float(step[1]) if step[2] else None  # type: ignore[arg-type]
            a = fast.choose(view, max_load=max_load, now=now)
            b = full.choose(view, max_load=max_load, now=now)
            assert (a and a.engine_id) == (b and b.engine_id)
            assert fast._picker_states == full._picker_states
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


def test_a_saturated_placement_makes_no_snapshot_entry() -> None:
    """Ranked by load, a release and the placement it lets through move the engines in the index
    from their records: no snapshot entry is made for them until something reads entries (each
    made two per placement, most of a saturated placement's cost at 256 engines)."""
    fleet = offline_fleet({"m": 8})
    router = Router(fleet, compile_profile(LEAST_LOAD))
    built = 0
    build = fleet._build

    def counting(record: object, now: float) -> EngineSnapshot:
        nonlocal built
        built += 1
        return build(record, now)  # type: ignore[arg-type]

    fleet._build = counting  # type: ignore[method-assign,assignment]
    placed: list[tuple[str, str]] = []
    for i in range(16):  # two per engine: every engine full at max_load 2
        record = router.choose(RequestView(f"r{i}", "m", 10, 10), max_load=2.0, now=0.0)
        assert record is not None
        fleet.reserve(record.engine_id, f"r{i}", RunningEntry(10, 10, 0.1, 0.0))
        placed.append((record.engine_id, f"r{i}"))
    assert router.choose(RequestView("full", "m", 10, 10), max_load=2.0, now=0.0) is None
    built = 0
    for i, (engine_id, rid) in enumerate(placed):
        fleet.release(engine_id, rid)
        record = router.choose(RequestView(f"n{i}", "m", 10, 10), max_load=2.0, now=0.1)
        assert record is not None and record.engine_id == engine_id  # (the one slot free)
        fleet.reserve(engine_id, f"n{i}", RunningEntry(10, 10, 0.1, 0.1))
        assert router.choose(RequestView(f"x{i}", "m", 10, 10), max_load=2.0, now=0.1) is None
    assert built == 0
    # a reader of entries gets them current
    assert [e.in_flight for e in fleet.candidates("m", 0.2)] == [2] * 8
    assert built == 8


def test_a_reservation_on_a_stale_engine_ranks_it_by_its_own_count() -> None:
    """An engine whose scraped state went stale is ranked by the gateway's count alone, also
    when a reservation moves it in the index without a snapshot entry."""
    fleet = offline_fleet({"m": 2})  # (stale after 3 s)
    router = Router(fleet, compile_profile(LEAST_LOAD))
    fleet.record_state("m-0", EngineState(num_running=5), 0.0)  # busy with others' work, then
    for i in range(2):
        fleet.reserve("m-1", f"b{i}", RunningEntry(10, 10, 0.1, 0.0))
    chosen = router.choose(RequestView("q0", "m", 10, 10), now=0.1)
    assert chosen is not None and chosen.engine_id == "m-1"  # 2 < 5
    for engine_id in fleet.records:  # the monitor's check, 4 s on: its state is stale now
        fleet.touch(engine_id)
    chosen = router.choose(RequestView("q1", "m", 10, 10), now=4.0)
    assert chosen is not None and chosen.engine_id == "m-0"  # 0 < 2
    fleet.reserve("m-0", "a0", RunningEntry(10, 10, 0.1, 4.0))
    chosen = router.choose(RequestView("q2", "m", 10, 10), now=4.1)
    assert chosen is not None and chosen.engine_id == "m-0"  # 1 < 2: its stale report counts not


def test_a_scrape_moves_the_engine_in_the_index() -> None:
    """A scraped state reaches the ranked choice at the next placement (the engine is rebuilt),
    though nothing else read the fleet's entries in between."""
    fleet = offline_fleet({"m": 2})
    router = Router(fleet, compile_profile(LEAST_LOAD))
    first = router.choose(RequestView("q0", "m", 10, 10), now=0.0)
    assert first is not None and first.engine_id == "m-0"  # (ties: fleet order)
    fleet.record_state("m-0", EngineState(num_running=5), 0.1)
    for i in range(3):  # m-0 carries 5 of others' requests now: m-1 until it has as many
        chosen = router.choose(RequestView(f"q{i + 1}", "m", 10, 10), now=0.2)
        assert chosen is not None and chosen.engine_id == "m-1"
        fleet.reserve("m-1", f"q{i + 1}", RunningEntry(10, 10, 0.1, 0.2))


def test_engines_out_of_rotation_leave_the_index_alone() -> None:
    """Reserving on or releasing from an engine that is not routable (draining here) does not
    send the next placement through a rebuild of the entries."""
    fleet = offline_fleet({"m": 3})
    router = Router(fleet, compile_profile(LEAST_LOAD))
    for engine in ("m-0", "m-1"):  # (m-2 the least loaded: chosen, were it still in rotation)
        fleet.reserve(engine, f"busy-{engine}", RunningEntry(10, 10, 0.1, 0.0))
    fleet.reserve("m-2", "held", RunningEntry(10, 10, 0.1, 0.0))
    fleet.set_draining("m-2", True)
    fleet.release("m-2", "held")
    chosen = router.choose(RequestView("q0", "m", 10, 10), now=0.0)  # (membership redone)
    assert chosen is not None and chosen.engine_id != "m-2"
    fleet.reserve("m-2", "late", RunningEntry(10, 10, 0.1, 0.0))
    fleet.release("m-2", "late")
    assert not fleet._unranked
