"""Gateway replicas count each other's requests: two fleets (two replicas) exchange their in-flight
counts through one store, and routing, ``max_engine_load`` and HyperFlexis's seats count both."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import orjson
import pytest

from gateway.dispatch.offline import offline_core, offline_fleet
from gateway.fleet.calibration import Calibrator
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.router import Router
from gateway.state.replica_load import ReplicaLoad, Said, decode, encode
from gateway.state.store import MemoryStore, StoreError
from policies.api import EngineState, estimated_load
from policies.pipeline import compile_profile
from tests.gateway.test_dispatch_core import ticket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FlakyStore(MemoryStore):
    """A memory store that can be made unreachable."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.down = False

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        if self.down:
            raise StoreError("down")
        await super().put(key, value, ttl_s)


def replicas(
    store: MemoryStore, clock: Clock, n: int = 2, engines: int = 2
) -> list[tuple[Fleet, ReplicaLoad]]:
    made = []
    for i in range(n):
        fleet = offline_fleet({"a": engines})
        made.append((fleet, ReplicaLoad(fleet, store, f"r{i}", interval_s=0.1, clock=clock)))
    return made


async def exchange(*loads: ReplicaLoad) -> None:
    for load in loads:
        await load.round()
    for load in loads:  # (a second pass: each has read what the others wrote last)
        await load.round()


def remote(fleet: Fleet) -> dict[str, int]:
    return {e: r.remote_in_flight for e, r in fleet.records.items()}


def entry(prompt: int = 100, output: int = 10) -> RunningEntry:
    return RunningEntry(prompt, output, 0.1, 0.0)


async def test_each_replica_sees_the_others_requests_and_not_its_own_twice() -> None:
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock)
    fa.reserve("a-0", "x1", entry())
    fa.reserve("a-0", "x2", entry())
    fb.reserve("a-1", "y1", entry(50, 5))
    await exchange(la, lb)
    assert remote(fb) == {"a-0": 2, "a-1": 0}
    assert remote(fa) == {"a-0": 0, "a-1": 1}
    snap = fb.engine_snapshot("a-0")
    assert snap.in_flight == 2 and snap.in_flight_tokens == 220 and snap.running_tokens == 200
    assert fb.engine_snapshot("a-1").in_flight == 1  # (its own, once)
    assert fb.records["a-0"].seats_taken() == 2
    assert la.peers == ("r1",) and lb.peers == ("r0",)


async def test_least_load_routing_counts_the_other_replicas_requests() -> None:
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock)
    core_a, core_b = offline_core(fa), offline_core(fb)
    first = core_a.submit(ticket("r-1"), 0.0)
    assert first is not None and first.engine_id == "a-0"
    await exchange(la, lb)
    # (alone, B would take the first of two engines it sees idle: the one A just loaded)
    placed = core_b.submit(ticket("r-2"), 0.0)
    assert placed is not None and placed.engine_id == "a-1"


async def test_max_engine_load_counts_the_other_replicas_requests() -> None:
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock)
    core_a = offline_core(fa, max_engine_load=1)
    core_b = offline_core(fb, max_engine_load=1)
    assert core_a.submit(ticket("r-1"), 0.0) is not None
    assert core_a.submit(ticket("r-2"), 0.0) is not None
    await exchange(la, lb)
    # replica B has nothing of its own on either engine, yet both are full
    assert core_b.submit(ticket("r-3"), 0.0) is None
    core_b.step(0.0)
    assert core_b.outbox == []
    # one of A's requests ends: once B hears of it, B's loop is woken and its queued request takes
    # that seat
    woken: list[int] = []
    core_b.wake = lambda: woken.append(1)
    done = next(iter(fa.records["a-1"].running))
    fa.release("a-1", done)
    await exchange(la, lb)
    assert woken
    core_b.step(0.1)
    assert [(rid, rec.engine_id) for rid, rec in core_b.outbox] == [("r-3", "a-1")]


async def test_hyperflexis_counts_the_other_replicas_requests_as_taken_seats() -> None:
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock, engines=1)
    for i in range(2):
        fa.reserve("a-0", f"x{i}", entry())
    await exchange(la, lb)
    core_b = offline_core(fb, dispatcher="hyperflexis", order="slo_tpot", max_engine_load=2)
    assert core_b.submit(ticket("r-1"), 10.0) is None
    view = core_b.workers._view(fb.records["a-0"], 0.0)
    assert view.load[0] == 2 and view.load[1] == 200
    fa.release("a-0", "x0")
    await exchange(la, lb)
    core_b.step(10.1)
    assert [(rid, rec.engine_id) for rid, rec in core_b.outbox] == [("r-1", "a-0")]


async def test_a_scrape_holds_the_other_replicas_requests_once() -> None:
    """The engine's report counts every replica's requests: the estimate adds only what came
    since the scrape, from any replica."""
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock, engines=1)
    fa.reserve("a-0", "x1", entry())
    await exchange(la, lb)
    state = EngineState(num_running=1, num_waiting=0, kv_usage=0.5, num_gpu_blocks=100, block_size=10)
    fb.record_state("a-0", state, 0.0)
    assert estimated_load(fb.engine_snapshot("a-0", 0.0)) == 1  # (not 2: the report has it)
    fa.reserve("a-0", "x2", entry())
    await exchange(la, lb)
    assert estimated_load(fb.engine_snapshot("a-0", 0.0)) == 2
    # KV: 500 of 1,000 tokens used at the scrape (x1's 110 among them), x2's 110 since
    assert fb.records["a-0"].free_kv_tokens() == 1000 - 500 - 110


async def test_a_replica_that_stops_withdraws_at_once_and_one_that_dies_expires() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    (fa, la), (fb, lb), (fc, lc) = replicas(store, clock, n=3)
    fa.reserve("a-0", "x", entry())
    fb.reserve("a-0", "y", entry())
    await exchange(la, lb, lc)
    assert remote(fc)["a-0"] == 2
    await la.stop()
    await lc.round()
    assert remote(fc)["a-0"] == 1
    # b dies without a word: its count is kept until its key expires, then it leaves the group
    clock.now += lb.ttl_s - 0.01
    await lc.round()
    assert remote(fc)["a-0"] == 1
    clock.now += 0.02
    await lc.round()
    assert remote(fc)["a-0"] == 0 and lc.peers == ()
    assert await store.members(lc.group) == {"r2"}


async def test_an_unreachable_store_keeps_the_others_counts_for_the_ttl_then_drops_them() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    (fa, la), (fb, lb) = replicas(store, clock)
    fa.reserve("a-1", "x", entry())
    await exchange(la, lb)
    store.down = True
    clock.now += 1.0
    await lb.round()
    assert remote(fb)["a-1"] == 1 and lb.errors == 1
    clock.now += lb.ttl_s
    await lb.round()
    assert remote(fb)["a-1"] == 0 and lb.errors == 2
    store.down = False
    await exchange(la, lb)  # (A's key expired meanwhile: it is back once A writes again)
    assert remote(fb)["a-1"] == 1


def _said(
    engines: object, replica: object = "r9", seq: object = 1, v: object = 1, life: object = "l1"
) -> bytes:
    return orjson.dumps({"v": v, "r": replica, "i": life, "seq": seq, "engines": engines})


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b"[]",
        _said({}, v=2),
        _said({}, replica=5),
        _said({}, seq="1"),
        _said({}, seq=True),
        _said({}, life=None),
        _said([]),
        _said({"a-0": [1, 2]}),
        _said({"a-0": [-1, 0, 0]}),
        _said({"a-0": [True, 0, 0]}),
        _said({"a-0": [1.5, 0, 0]}),
        _said({"a-0": [2_000_000, 0, 0]}),
        _said({"a-0": [1, 1 << 60, 0]}),
    ],
)
def test_a_value_this_version_does_not_write_is_not_read(value: bytes) -> None:
    assert decode(value, {"a-0"}) is None


def test_engines_this_fleet_does_not_know_are_left_out() -> None:
    fleet = offline_fleet({"a": 1})
    fleet.reserve("a-0", "x", entry())
    value = _said({"a-0": [1, 110, 100], "elsewhere": [5, 5, 5]}, seq=7)
    assert decode(value, set(fleet.records)) == Said("r9", "l1", 7, {"a-0": (1, 110, 100)})
    known = set(fleet.records)
    assert decode(encode(fleet, "me", "x", 3), known) == Said("me", "x", 3, {"a-0": (1, 110, 100)})
    assert decode(encode(None, "me", "x", 4), known) == Said("me", "x", 4, {})


async def test_a_store_value_from_a_stranger_is_skipped_not_fatal() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    (fa, la), (fb, lb) = replicas(store, clock)
    fa.reserve("a-0", "x", entry())
    await store.join(lb.group, "stranger")
    await store.put(lb.key("stranger"), b"\xff garbage", 10)
    await exchange(la, lb)
    assert remote(fb)["a-0"] == 1 and lb.peers == ("r0",) and lb.errors == 0


# -- pushed changes ------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> float:
    """Seconds until ``predicate`` holds (fails past ``timeout``)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "not within the timeout"
        await asyncio.sleep(0.002)
    return time.monotonic() - started


def started_pair(
    store: MemoryStore, engines: int, interval_s: float
) -> tuple[Fleet, ReplicaLoad, Fleet, ReplicaLoad]:
    """Two replicas ``ra`` and ``rb`` exchanging through ``store``, their tasks running."""
    fa, fb = offline_fleet({"a": engines}), offline_fleet({"a": engines})
    la = ReplicaLoad(fa, store, "ra", interval_s=interval_s, push_delay_s=0.001)
    lb = ReplicaLoad(fb, store, "rb", interval_s=interval_s, push_delay_s=0.001)
    la.start()
    lb.start()
    return fa, la, fb, lb


async def test_a_placement_reaches_the_others_by_push_not_at_the_next_full_round() -> None:
    # (full rounds an hour apart: after the first, only pushes can tell)
    fa, la, fb, lb = started_pair(MemoryStore(), engines=2, interval_s=3600)
    try:
        await until(lambda: lb.peers == ("ra",) or la.peers == ("rb",))
        fa.reserve("a-1", "x", entry())
        fa.reserve("a-1", "y", entry())
        assert await until(lambda: remote(fb)["a-1"] == 2) < 1.0
        fa.release("a-1", "x")
        await until(lambda: remote(fb)["a-1"] == 1)
        # leaving, A says so: B drops A's requests without waiting for A's key to expire
        await la.stop()
        await until(lambda: remote(fb)["a-1"] == 0)
    finally:
        await lb.stop()
        await la.stop()


async def test_an_older_message_never_undoes_a_newer_one_and_a_restart_counts_anew() -> None:
    fb = offline_fleet({"a": 1})
    lb = ReplicaLoad(fb, MemoryStore(), "rb")
    lb._heard(_said({"a-0": [3, 30, 30]}, replica="ra", seq=10))
    lb._heard(_said({"a-0": [1, 10, 10]}, replica="ra", seq=9))
    assert remote(fb)["a-0"] == 3
    lb._heard(_said({"a-0": [4, 40, 40]}, replica="ra", seq=11))
    lb._heard(_said({"a-0": [2, 20, 20]}, replica="rc", seq=1))
    assert remote(fb)["a-0"] == 6 and lb.peers == ("ra", "rc")
    lb._heard(_said({}, replica="rc", seq=2))
    assert remote(fb)["a-0"] == 4
    # ra restarted under its name: its new life numbers from 1 again, and is heard
    lb._heard(_said({"a-0": [1, 10, 10]}, replica="ra", seq=1, life="l2"))
    assert remote(fb)["a-0"] == 1


async def test_a_full_round_trusts_the_key_over_a_message_of_another_life() -> None:
    """A message claiming a huge number (forged, or of a life gone) is undone by the next full
    round: within a life a later message beats the key, across lives the key wins."""
    store = MemoryStore()
    fa, fb = offline_fleet({"a": 1}), offline_fleet({"a": 1})
    la, lb = ReplicaLoad(fa, store, "ra"), ReplicaLoad(fb, store, "rb")
    fa.reserve("a-0", "x", entry())
    await exchange(la, lb)
    assert remote(fb)["a-0"] == 1
    lb._heard(_said({"a-0": [1_000_000, 0, 0]}, replica="ra", seq=2**62, life="forged"))
    assert remote(fb)["a-0"] == 1_000_000
    await lb.round()
    assert remote(fb)["a-0"] == 1
    # the same with ra's own life (read off the channel), numbered implausibly far past its key
    lb._heard(_said({"a-0": [1_000_000, 0, 0]}, replica="ra", seq=2**62, life=la.life))
    assert remote(fb)["a-0"] == 1_000_000
    await lb.round()
    assert remote(fb)["a-0"] == 1
    # a push of the key's own life, numbered past it, is newer than the key: kept
    lb._heard(encode(fa, "ra", la.life, la._seq + 5).replace(b"[1,", b"[2,"))
    await lb.round()
    assert remote(fb)["a-0"] == 2


async def test_a_twin_with_the_same_replica_id_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    lb = ReplicaLoad(offline_fleet({"a": 1}), MemoryStore(), "rb")
    lb._heard(_said({"a-0": [1, 1, 1]}, replica="rb", life="someone-else"))
    lb._heard(_said({"a-0": [1, 1, 1]}, replica="rb", life="someone-else", seq=2))
    assert [r.message for r in caplog.records].count(
        "another gateway process calls itself 'rb' too: their loads cannot be told apart; give each "
        "replica its own replica_id"
    ) == 1
    assert remote(lb.fleet)["a-0"] == 0


async def test_a_late_release_is_not_subtracted_from_the_engines_report() -> None:
    """Another replica's request ended before the engine's report, heard only after it: the
    report no longer has it, so no more of theirs is subtracted than they have now."""
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock, engines=1)
    fa.reserve("a-0", "x1", entry())
    fa.reserve("a-0", "x2", entry())
    await exchange(la, lb)
    # the engine's report, rendered after x2 ended there, reaches B before A's news does; it also
    # runs two requests no gateway sent (x1's 110 KV tokens and their 390)
    state = EngineState(num_running=3, num_waiting=0, kv_usage=0.5, num_gpu_blocks=100, block_size=10)
    fb.record_state("a-0", state, 0.0)
    fa.release("a-0", "x2")
    await exchange(la, lb)
    # three run there, as the report says (subtracting x2 from it, gone from it already, said two)
    assert estimated_load(fb.engine_snapshot("a-0", 0.0)) == 3
    assert fb.records["a-0"].free_kv_tokens() == 1000 - 500
    # a second later x1 ends: an end after the report, taken out of it (clamping again, as on
    # every release, held x1's seat until the next scrape)
    clock.now += 1.0
    fa.release("a-0", "x1")
    await exchange(la, lb)
    assert estimated_load(fb.engine_snapshot("a-0", 0.0)) == 2
    assert fb.records["a-0"].free_kv_tokens() == 1000 - 390


class LosesItsSubscription(MemoryStore):
    """A memory store whose first subscription fails at once (a dropped connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriptions = 0

    async def subscribe(self, channel: str) -> AsyncGenerator[bytes, None]:
        self.subscriptions += 1
        if self.subscriptions == 1:
            raise StoreError("connection reset")
        async for message in super().subscribe(channel):
            yield message


async def test_a_lost_subscription_is_taken_again_and_the_full_rounds_go_on() -> None:
    store = LosesItsSubscription()
    fa, la, fb, lb = started_pair(store, engines=1, interval_s=0.05)
    try:
        fa.reserve("a-0", "x", entry())
        await until(lambda: remote(fb)["a-0"] == 1)
        await until(lambda: store.subscriptions >= 3, timeout=3.0)  # (both listening again)
    finally:
        await la.stop()
        await lb.stop()


def test_replicas_break_ties_between_equally_loaded_engines_in_different_orders() -> None:
    """Replicas see the same loads: with the same rotation, simultaneous arrivals at two replicas
    went to the same one of several equally loaded engines."""
    same = [offline_core(offline_fleet({"a": 4})) for _ in range(2)]
    first = [core.submit(ticket(f"r-{i}"), 0.0) for i, core in enumerate(same)]
    assert first[0] is not None and first[1] is not None
    assert first[0].engine_id == first[1].engine_id  # (the premise: the same order)
    offset = [offline_core(offline_fleet({"a": 4})) for _ in range(2)]
    offset[1].router.offset_ties(1)
    first = [core.submit(ticket(f"r-{i}"), 0.0) for i, core in enumerate(offset)]
    assert first[0] is not None and first[1] is not None
    assert first[0].engine_id != first[1].engine_id


def test_offset_ties_leaves_a_seeded_pickers_state_alone() -> None:
    """A seeded random picker's state is its seed: an offset would silently change it."""
    fleet = offline_fleet({"a": 2})
    pipeline = compile_profile(
        {"scorers": [{"name": "least_load"}], "picker": {"name": "max_score_random", "params": {"seed": 5}}}
    )
    router = Router(fleet, pipeline)
    before = router._picker_state("a")
    router.offset_ties(12345)
    assert router._picker_state("a") == before
    fresh = Router(fleet, pipeline)
    fresh.offset_ties(12345)  # (before any placement: the state made later is not offset either)
    assert fresh._picker_state("a") == before


async def test_calibration_takes_an_engine_with_another_replicas_requests_for_busy() -> None:
    clock = Clock()
    (fa, la), (fb, lb) = replicas(MemoryStore(clock), clock, engines=1)
    record = fb.records["a-0"]
    assert Calibrator._idle(record)
    fa.reserve("a-0", "x", entry())
    await exchange(la, lb)
    assert not Calibrator._idle(record)


async def test_what_anyone_may_write_to_the_store_is_read_within_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group members and load values are read back from the store, which anything with access
    to it may write: a million members each became a key of one MGET, every round, and a load
    message of any size was parsed and walked on the event loop."""
    from gateway.state import replica_load

    monkeypatch.setattr(replica_load, "MAX_REPLICAS", 3)
    asked: list[int] = []

    class Counting(MemoryStore):
        async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
            asked.append(len(keys))
            return await super().get_many(keys)

    clock = Clock()
    store = Counting(clock)
    (_, la), (_, lb) = replicas(store, clock)
    await exchange(la, lb)  # (each hears the other first)
    for i in range(50):
        await store.join(lb.group, f"0-stranger-{i}")  # (sorting before every real replica)
    asked.clear()
    await exchange(la, lb)
    assert asked and max(asked) <= 3
    assert lb.peers == ("r0",)  # (the peer already heard is read first, past the bound)
    big = _said({f"e{i}": [1, 1, 1] for i in range(20)})
    assert decode(big, {"e0"}) is not None
    monkeypatch.setattr(replica_load, "MAX_MESSAGE_BYTES", len(big) - 1)
    assert decode(big, {"e0"}) is None
