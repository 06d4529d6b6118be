"""The dispatch core in process, with many engines and no I/O: reservation at assignment,
cancellation, expiry, per-model queues, ejection; and a property test over random event sequences
in which every counter returns to zero and no limit is ever exceeded."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.errors import GatewayError
from gateway.dispatch.core import PRUNE_KEEP_BELOW, ClassLimits, DispatchCore, Ticket
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.offline import offline_core, offline_fleet
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from gateway.router import Router
from policies.api import EngineState, RequestView, Role
from policies.hyperflexis import HyperFlexisParams
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL
from policies.pipeline import compile_profile
from policies.queue_order import QueuedRequest, make_order


def ticket(
    rid: str, model: str = "a", now: float = 0.0, timeout: float = 30.0, slo_class: str = "c"
) -> Ticket:
    view = RequestView(request_id=rid, model=model, prompt_tokens=100, max_output_tokens=10, arrival=now)
    item = QueuedRequest(
        view=view, ttft_slo=1.0, tpot_slo=0.1, seq=int(rid.split("-")[-1]), queue_deadline=now + timeout
    )
    return Ticket(item, slo_class, RunningEntry(100, 10, 0.1, now), now)


def loads(fleet: Fleet) -> dict[str, int]:
    return {e: r.in_flight for e, r in fleet.records.items()}


def test_capacity_is_reserved_at_assignment_not_when_the_request_is_sent() -> None:
    fleet = offline_fleet({"a": 2})
    core = offline_core(fleet, max_engine_load=2)
    placed = [core.submit(ticket(f"r-{i}"), 0.0) for i in range(20)]
    assert sum(p is not None for p in placed) == 4  # 2 engines x 2: the other 16 queue
    assert loads(fleet) == {"a-0": 2, "a-1": 2}
    core.step(0.0)
    assert core.outbox == [] and core.queued() == 16
    # one finishes: exactly one queued request takes its place, reserved before anyone runs
    done = next(rid for rid in fleet.records["a-0"].running)
    fleet.release("a-0", done)
    core.step(0.1)
    assert [rid for rid, _ in core.outbox] == ["r-4"]
    assert loads(fleet) == {"a-0": 2, "a-1": 2}


def test_a_duplicate_id_is_refused_never_merged() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1)
    assert core.submit(ticket("r-1"), 0.0) is not None
    assert core.submit(ticket("r-2"), 0.0) is None
    with pytest.raises(ValueError, match="already queued"):
        core.submit(ticket("r-2"), 0.0)
    with pytest.raises(KeyError):
        fleet.reserve("a-0", "r-1", RunningEntry(1, 1, 0.1, 0.0))
    assert core.queued() == 1 and fleet.records["a-0"].in_flight == 1


def test_one_models_backlog_never_holds_back_another_models_engine() -> None:
    fleet = offline_fleet({"a": 1, "b": 1})
    core = offline_core(fleet, max_engine_load=1)
    for i in range(300):
        core.submit(ticket(f"a-{i}", "a"), 0.0)
    assert core.queued("a") == 299
    b = [core.submit(ticket(f"b-{i}", "b"), 0.0) for i in range(5)]
    assert b[0] is not None and b[0].engine_id == "b-0"  # placed at once despite 299 queued for a
    fleet.release("b-0", "b-0")
    core.step(0.0)
    assert [rid for rid, _ in core.outbox] == ["b-1"]


def test_queue_timeout_fires_at_the_deadline_and_says_when() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1, limits=ClassLimits(queue_timeout_s=2.0))
    core.submit(ticket("r-0", timeout=2.0), 0.0)
    core.submit(ticket("r-1", now=0.5, timeout=2.0), 0.5)
    assert core.next_wake() == 2.5
    core.step(2.4)
    assert core.outbox == []
    core.step(2.5)
    [(rid, error)] = core.outbox
    assert rid == "r-1" and isinstance(error, GatewayError) and error.code == "queue_timeout"
    assert core.queued() == 0 and core.queued_per_class == {("a", "c"): 0}


def test_cancel_takes_a_queued_request_out_once() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1)
    core.submit(ticket("r-0"), 0.0)
    core.submit(ticket("r-1"), 0.0)
    assert core.cancel("r-1", 0.1) and not core.cancel("r-1", 0.1)
    fleet.release("a-0", "r-0")
    core.step(0.2)
    assert core.outbox == [] and core.queued() == 0 and fleet.records["a-0"].in_flight == 0


def test_ejecting_the_last_engine_refuses_its_models_queue_at_once() -> None:
    fleet = offline_fleet({"a": 2, "b": 1})
    core = offline_core(fleet, max_engine_load=1)
    for i in range(5):
        core.submit(ticket(f"a-{i}", "a"), 0.0)
    core.submit(ticket("b-0", "b"), 0.0)
    core.submit(ticket("b-1", "b"), 0.0)
    fleet.eject("a-0", "down")
    assert core.outbox == [] and core.queued("a") == 3  # a-1 still serves model a
    fleet.eject("a-1", "down")
    assert sorted(rid for rid, _ in core.outbox) == ["a-2", "a-3", "a-4"]
    assert all(isinstance(e, GatewayError) and e.status == 503 for _, e in core.outbox)
    assert core.queued("b") == 1
    with pytest.raises(GatewayError) as refused:
        core.submit(ticket("a-9", "a"), 0.0)
    assert refused.value.status == 503


@pytest.mark.parametrize("dispatcher", ["pipeline", "hyperflexis"])
def test_draining_the_last_engine_refuses_its_models_queue_at_once(dispatcher: str) -> None:
    """Drained (or flipped away), the model's last front engine left its queue waiting for the
    queue timeout while new arrivals of the model got a 503 at once."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(
        fleet, max_engine_load=1, dispatcher=dispatcher, order="slo_tpot", tightest_ttft_s=5.0
    )
    for i in range(3):
        core.submit(ticket(f"a-{i}", "a"), 0.0)
    core.outbox.clear()  # (the one placed at once)
    assert core.queued("a") >= 1
    fleet.set_draining("a-0", True)
    assert core.queued("a") == 0 and core.outbox
    assert all(isinstance(e, GatewayError) and e.status == 503 for _, e in core.outbox)


def test_queue_full_prunes_an_infeasible_request_with_a_bounded_look() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1, limits=ClassLimits(max_queued=3))
    core.submit(ticket("r-0"), 0.0)
    for i in range(1, 4):
        core.submit(ticket(f"r-{i}", now=float(i)), float(i))
    # at t=3.5, r-1's TTFT deadline (2.0) is past: it is shed to make room
    assert core.submit(ticket("r-4", now=3.5), 3.5) is None
    assert [rid for rid, _ in core.outbox] == ["r-1"]
    assert core.submit(ticket("r-5", now=3.5), 3.5) is None  # r-2 (due at 3.0) goes next
    assert [rid for rid, _ in core.outbox] == ["r-1", "r-2"]
    # nothing infeasible left (r-3 is due at 4.0): the class is full
    with pytest.raises(GatewayError) as full:
        core.submit(ticket("r-6", now=3.5), 3.5)
    assert full.value.status == 429 and full.value.code == "queue_full"


def test_the_prune_keeps_its_deadlines_only_while_the_class_is_full_or_nearly() -> None:
    """The deadlines heap the prune reads is made when the class is first full and dropped once
    it is half empty: kept for every class, its O(n) clean-ups held the loop 10-60 ms at
    10,000 queued, for a prune that a class never full never runs."""
    limit = PRUNE_KEEP_BELOW
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1, limits=ClassLimits(max_queued=limit))
    core.submit(ticket("r-0"), 0.0)
    core.submit(ticket("r-1", now=1.0), 1.0)  # (due at 2.0)
    for i in range(2, limit + 1):
        core.submit(ticket(f"r-{i}", now=3.0), 3.0)  # (due at 4.0)
    assert core._class_deadlines == {}  # (full, but no arrival has needed the prune yet)
    assert core.submit(ticket(f"r-{limit + 1}", now=3.5), 3.5) is None  # r-1 shed for it
    assert [rid for rid, _ in core.outbox] == ["r-1"]
    heap = core._class_deadlines[("a", "c")]
    assert len([e for e in heap if e[2] in core.tickets]) == limit
    for i in range(limit + 1, limit // 2 + 1, -1):
        assert core.cancel(f"r-{i}", 3.6) and ("a", "c") in core._class_deadlines  # kept
    assert core.cancel(f"r-{limit // 2 + 1}", 3.6) and core._class_deadlines == {}  # half empty
    core.submit(ticket("r-900", now=1.7), 3.6)  # (due at 2.7)
    while core.queued("a") < limit:
        core.submit(ticket(f"r-{1000 + core.queued('a')}", now=3.7), 3.7)
    # full again: the heap is made anew from what is queued, r-900 (due at 2.7) shed
    assert core.submit(ticket("r-2000", now=3.7), 3.7) is None
    assert [rid for rid, _ in core.outbox] == ["r-1", "r-900"]


def test_a_small_class_keeps_its_deadlines_while_it_empties_and_fills() -> None:
    """Dropped when a class of two was half empty, the heap was made again from every queued
    ticket (of every class) the next time the class filled: a pass over 2,000 queued requests of
    another class on nearly every arrival of the small one."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1)
    core.limits = lambda c: ClassLimits(max_queued=2 if c == "tiny" else 100_000)  # type: ignore[method-assign]
    core.submit(ticket("r-0"), 0.0)
    for i in range(1, 2001):
        core.submit(ticket(f"r-{i}", now=5.0, timeout=60.0, slo_class="big"), 5.0)
    heaps = []  # (the lists themselves: an id may be reused once a list is freed)
    for n in range(20):
        first, second = 3000 + 3 * n, 3001 + 3 * n
        core.submit(ticket(f"r-{first}", now=5.0, slo_class="tiny"), 5.0)
        core.submit(ticket(f"r-{second}", now=5.0, slo_class="tiny"), 5.0)
        with pytest.raises(GatewayError):  # full, and nothing in it infeasible yet
            core.submit(ticket(f"r-{3002 + 3 * n}", now=5.0, slo_class="tiny"), 5.0)
        heaps.append(core._class_deadlines[("a", "tiny")])
        assert core.cancel(f"r-{first}", 5.0) and core.cancel(f"r-{second}", 5.0)
    assert all(heap is heaps[0] for heap in heaps)  # made once
    assert len(core._class_deadlines[("a", "tiny")]) <= 64 + 2 * 2  # (and kept small)


def test_hyperflexis_places_on_an_idle_engine_within_the_arrival_call() -> None:
    fleet = offline_fleet({"a": 4})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    placed = core.submit(ticket("r-0"), 10.0)
    assert placed is not None and fleet.records[placed.engine_id].in_flight == 1


def test_hyperflexis_does_not_poll_a_saturated_fleet() -> None:
    fleet = offline_fleet({"a": 8})
    core = offline_core(
        fleet, dispatcher="hyperflexis", order="slo_tpot", limits=ClassLimits(max_queued=10_000)
    )
    for record in fleet.records.values():
        # engines out of KV: nothing fits until something finishes
        record.state = type("S", (), {"num_gpu_blocks": 1, "block_size": 1, "kv_usage": 1.0})()  # type: ignore[assignment]
    for i in range(2000):
        core.submit(ticket(f"r-{i}", now=0.0, timeout=1e9), 0.0)
    core.step(0.0)
    assert core.outbox == []
    # every worker is parked: the only timer left is the queue expiry, nothing polls
    assert core.next_wake() == 1e9
    assert all(math.isinf(core.workers.maturity[e]) for e in fleet.records)
    # the queue timeout is noticed at its deadline, with no wake in between
    core.step(1e9)
    assert len(core.outbox) == 2000 and core.queued() == 0
    assert all(isinstance(e, GatewayError) and e.code == "queue_timeout" for _, e in core.outbox)


def _view(rid: str) -> RequestView:
    return RequestView(request_id=rid, model="a", prompt_tokens=10, max_output_tokens=10)


async def test_an_assignment_racing_a_cancellation_gives_the_capacity_back() -> None:
    fleet = offline_fleet({"a": 1})
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    loop = DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            make_order("fcfs", {}),
            lambda _: ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
            lambda _: ClassLimits(),
            max_engine_load=1,
        )
    )
    loop.start()
    try:
        first = await loop.place(_view("r-1"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        waiter = asyncio.create_task(loop.place(_view("r-2"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0)))
        await asyncio.sleep(0)
        assert loop.core.queued() == 1
        loop.release(first.engine_id, "r-1")
        loop.core.step(loop.clock())  # r-2 is assigned and reserved ...
        loop._deliver()
        waiter.cancel()  # ... and its client leaves before the coroutine resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert fleet.records["a-0"].in_flight == 0 and fleet.records["a-0"].running == {}
    finally:
        await loop.stop()


# -- property test ------------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "step", "first", "finish", "disconnect", "tick", "eject", "readmit"]),
        st.integers(0, 1000),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS, dispatcher=st.sampled_from(["pipeline", "hyperflexis"]), max_load=st.sampled_from([1, 2, None])
)
def test_counters_return_to_zero_and_limits_hold(
    ops: list[tuple[str, int]], dispatcher: str, max_load: int | None
) -> None:
    fleet = offline_fleet({"a": 3, "b": 2})
    core: DispatchCore = offline_core(
        fleet,
        dispatcher=dispatcher,
        order="slo_tpot" if dispatcher == "hyperflexis" else "fcfs",
        max_engine_load=max_load,
        limits=ClassLimits(max_queued=8, queue_timeout_s=2.0),
    )
    now = 0.0
    seq = 0
    placed: dict[str, str] = {}  # rid -> engine, as the serving flows would hold them
    engines = list(fleet.records)

    expired: list[str] = []

    def deliver() -> None:
        for rid, result in core.outbox:
            if isinstance(result, EngineRecord):
                placed[rid] = result.engine_id
            elif result.code == "queue_timeout":
                expired.append(rid)
        core.outbox.clear()

    for op, arg in ops:
        if op == "arrive":
            seq += 1
            rid = f"r-{seq}"
            try:
                record = core.submit(ticket(rid, "ab"[arg % 2], now, 2.0, "c" if arg % 3 else "d"), now)
            except GatewayError:
                record = None
            if record is not None:
                placed[rid] = record.engine_id
        elif op == "step":
            core.step(now)
        elif op == "first" and placed:
            rid = sorted(placed)[arg % len(placed)]
            record = fleet.records[placed[rid]]
            fleet.mark_prefilled(placed[rid], rid)
            fleet.add_generated(record, record.running[rid], arg % 7)
        elif op in ("finish", "disconnect") and placed and arg % 2:
            rid = sorted(placed)[arg % len(placed)]
            fleet.release(placed.pop(rid), rid)
        elif op == "disconnect" and core.tickets:
            core.cancel(sorted(core.tickets)[arg % len(core.tickets)], now)
        elif op == "tick":
            now += arg / 500.0  # up to 2 s: queue timeouts and maturity times fire
            core.step(now)
        elif op == "eject":
            fleet.eject(engines[arg % len(engines)], "gone")
        elif op == "readmit":
            fleet.record_health(engines[arg % len(engines)], True, 1, 1)
        deliver()
        for engine_id, record in fleet.records.items():
            assert (
                record.in_flight == len(record.running) == sum(1 for e in placed.values() if e == engine_id)
            )
            assert record.running_tokens == sum(
                e.prompt_tokens + e.generated for e in record.running.values()
            )
            assert record.unprefilled == {
                r: e.prompt_tokens for r, e in record.running.items() if not e.prefilled
            }
            if max_load is not None:
                assert record.in_flight <= max_load
        assert sum(core.queued_per_class.values()) == len(core.tickets) == core.queued("a") + core.queued("b")
        assert set(core.tickets).isdisjoint(placed)

    # drain: everything placed finishes; with every engine back and free, what still waits must be
    # placed, not left to expire (liveness), unless it was about to expire anyway
    for engine_id in engines:
        fleet.record_health(engine_id, True, 1, 1)
    drain_start = now
    deadlines = {rid: t.item.queue_deadline for rid, t in core.tickets.items()}
    expired.clear()
    for _ in range(400):
        for rid, engine_id in list(placed.items()):
            fleet.release(engine_id, rid)
            del placed[rid]
        now += 0.01
        core.step(now)
        deliver()
        if not core.tickets and not placed:
            break
    assert core.tickets == {} and placed == {}
    stranded = [rid for rid in expired if deadlines[rid] > drain_start + 1.0]
    assert not stranded, f"waited with free engines until their queue timeout: {stranded}"
    assert all(v == 0 for v in core.queued_per_class.values())
    assert all(
        r.in_flight == 0
        and r.in_flight_tokens == 0
        and r.running_tokens == 0
        and not r.running
        and not r.unprefilled
        for r in fleet.records.values()
    )


def test_red_ranks_a_client_batch_as_one() -> None:
    """x-slo-batch members carry their batch's deadlines: a tight outlier in a loose batch no
    longer jumps a lone request that is due sooner than the batch as a whole (MFS RED)."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, order="red", max_engine_load=1)
    core.submit(ticket("busy-0"), 0.0)  # the engine is taken: the rest queue
    lone = ticket("lone-1", now=0.0)
    lone.item = QueuedRequest(lone.item.view, ttft_slo=2.0, tpot_slo=0.1, seq=1, queue_deadline=30.0)
    core.submit(lone, 0.0)
    for i, ttft in enumerate([0.5, 10.0, 10.0, 10.0], start=2):
        member = ticket(f"batch-{i}")
        member.item = QueuedRequest(member.item.view, ttft_slo=ttft, tpot_slo=0.1, seq=i, queue_deadline=30.0)
        member.batch = ("tenant", "job-7")
        core.submit(member, 0.0)
    order = [item.view.request_id for item in core.queues["a"].iter_in_order(0.0, core.context("a"), 10)]
    assert order[0] == "lone-1", order  # plain EDF would put batch-2 (due at 0.5 s) first
    assert set(order[1:]) == {"batch-2", "batch-3", "batch-4", "batch-5"}
    assert all(len(t.item.batch_deadlines) == 4 for t in core.tickets.values() if t.batch)
    core.cancel("batch-2", 0.1)
    assert core._batches[("tenant", "job-7", "a")] == {"batch-3", "batch-4", "batch-5"}


def test_hyperflexis_an_engine_that_goes_idle_takes_the_next_request_at_once() -> None:
    """At concurrency 1 each request used to wait out the previous one's turn (~37 ms on the
    default prior) behind an engine with nothing to do."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    first = core.submit(ticket("r-1", now=0.0), 0.0)
    assert first is not None and core.workers.maturity["a-0"] > 0.01  # holding for its turn
    fleet.mark_prefilled("a-0", "r-1")
    fleet.release("a-0", "r-1")
    second = core.submit(ticket("r-2", now=0.002), 0.002)
    assert second is not None and second.engine_id == "a-0"
    # while it still runs something, a newcomer to the empty queue joins its turn (the engine's
    # first token came well within the prefill predicted for it, and the turn's budget has room),
    # and the hold it joined does not end sooner
    held_until = core.workers.maturity["a-0"]
    third = core.submit(ticket("r-3", now=0.003), 0.003)
    assert third is not None and third.engine_id == "a-0"
    assert core.workers.maturity["a-0"] >= held_until
    # one the turn's budget has no room for waits for the turn to end, the hold unchanged
    held_until = core.workers.maturity["a-0"]
    big = ticket("r-4", now=0.004)
    big.item = replace(big.item, view=replace(big.item.view, prompt_tokens=400_000))
    assert core.submit(big, 0.004) is None
    assert core.workers.maturity["a-0"] == held_until and core.queued() == 1


def test_hyperflexis_arrivals_join_a_hold_within_its_turns_budget_on_a_fast_engine() -> None:
    """Arrivals to an empty queue join a held worker only on an engine whose prefills came faster
    than predicted, and only within the eq.(5) budget of the turn whose hold they join."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")

    def sized(rid: str, prompt: int, now: float) -> Ticket:
        t = ticket(rid, now=now)
        t.item = replace(t.item, view=replace(t.item.view, prompt_tokens=prompt))
        t.entry = RunningEntry(prompt, 10, 0.1, now)
        return t

    assert core.submit(sized("r-0", 100, 0.0), 0.0) is not None
    # an arrival during the hold of an engine that never showed it is faster than predicted waits
    assert core.submit(sized("r-1", 100, 0.0001), 0.0001) is None
    # a cancellation ends the hold's prefills too, but says nothing of the engine's speed
    assert core.cancel("r-1", 0.0001)
    fleet.release("a-0", "r-0")
    core.step(0.0002)
    assert "a-0" not in core.workers.prefill_ratio
    assert core.submit(sized("r-1", 100, 0.0003), 0.0003) is not None
    # a first token well within the prefill predicted for it: the prior is slow, not the engine
    fleet.mark_prefilled("a-0", "r-1")
    assert core.outbox == []  # (the event asked for a step: the prefill is timed at its end)
    core.step(0.0004)
    assert core.workers.prefill_ratio["a-0"] < 0.5
    fleet.release("a-0", "r-1")
    assert core.submit(sized("r-2", 100, 0.0005), 0.0005) is not None
    # behind a queued request nothing joins, though the hold's budget has room for it
    assert core.submit(sized("r-3", 400_000, 0.0006), 0.0006) is None
    assert core.submit(sized("r-4", 100, 0.0007), 0.0007) is None and core.queued() == 2
    assert core.cancel("r-3", 0.0007) and core.cancel("r-4", 0.0007)
    joined = 0
    now = 0.0007
    while (now := now + 0.0001) < 0.005:
        if core.submit(sized(f"r-{joined + 5}", 100, now), now) is None:
            break
        joined += 1
    refused = f"r-{joined + 5}"
    assert 2 <= joined < 45, joined  # some joined, then the budget ran out (~3,900 tokens here)
    # first tokens give nothing back within the hold: the budget is the turn's
    assert core.cancel(refused, now)
    for rid in list(fleet.records["a-0"].unprefilled)[:-1]:
        fleet.mark_prefilled("a-0", rid)
    assert core.submit(sized("r-98", 100, now), now) is None and core.queued() == 1
    # the hold's end is the next turn, with a budget of its own
    core.step(core.workers.maturity["a-0"])
    assert core.queued() == 0 and [r for r, _ in core.outbox] == ["r-98"]


# -- findings of the independent review, each a test that failed before its fix -------------------


def test_a_batch_spanning_two_models_stays_in_each_models_queue() -> None:
    fleet = offline_fleet({"x": 1, "y": 1})
    core = offline_core(fleet, order="red", max_engine_load=1)
    core.submit(ticket("x-0", "x"), 0.0)
    core.submit(ticket("y-0", "y"), 0.0)
    for rid, model in (("y-1", "y"), ("x-1", "x")):
        member = ticket(rid, model)
        member.batch = ("default", "job")
        core.submit(member, 0.0)
    assert [i.view.request_id for i in core.queues["x"].items()] == ["x-1"]
    assert [i.view.request_id for i in core.queues["y"].items()] == ["y-1"]
    fleet.release("y-0", "y-0")
    core.step(0.1)
    assert [(rid, r.engine_id) for rid, r in core.outbox] == [("y-1", "y-0")]  # type: ignore[union-attr]


def test_a_full_worker_whose_queue_emptied_takes_the_next_arrival() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot", max_engine_load=2)
    assert core.submit(ticket("r-1"), 0.0) is not None
    core.step(1.0)
    assert core.submit(ticket("r-2", now=1.0), 1.0) is not None
    assert core.submit(ticket("r-3", now=1.0), 1.0) is None
    core.step(2.0)  # the worker is full: no timer, it waits for its own events
    assert core.next_wake(2.0) == 31.0  # (r-3's queue timeout)
    core.cancel("r-3", 2.0)
    fleet.release("a-0", "r-1")  # not idle (r-2 runs), and nothing queued at that moment
    assert core.submit(ticket("r-4", now=2.1), 2.1) is not None


def test_the_class_limit_applies_within_one_models_queue() -> None:
    fleet = offline_fleet({"a": 1, "b": 1})
    core = offline_core(fleet, max_engine_load=1, limits=ClassLimits(max_queued=2))
    for i in range(3):
        core.submit(ticket(f"a-{i}", "a", now=0.0), 0.0)
    with pytest.raises(GatewayError):
        core.submit(ticket("a-9", "a", now=0.0), 0.0)
    core.submit(ticket("b-0", "b"), 0.0)
    assert core.submit(ticket("b-1", "b"), 0.0) is None  # queued behind b-0, not refused for a's backlog


def test_hyperflexis_places_a_request_whose_output_bound_exceeds_the_kv_on_an_idle_engine() -> None:
    fleet = offline_fleet({"a": 1})
    fleet.record_state("a-0", EngineState(kv_usage=0.0, block_size=16, num_gpu_blocks=64), 0.0)  # 1024 tokens
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    big = ticket("r-1")
    big.item = QueuedRequest(
        RequestView("r-1", "a", 100, 32_768, arrival=0.0),
        ttft_slo=1.0,
        tpot_slo=0.1,
        seq=1,
        queue_deadline=30.0,
    )
    assert core.submit(big, 0.0) is not None


async def test_the_live_loop_runs_after_an_arrival_its_own_look_could_not_place() -> None:
    """Two engines, one busy: the arrival's inline look examined only the busy one; the loop must
    still run and place it on the idle one (it used to wait for an unrelated event)."""
    fleet = offline_fleet({"a": 2})
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    loop = DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            make_order("slo_tpot", {}),
            lambda _: ((0.025, 1e-4, 0.0), (0.012, 4e-8, 1e-4)),
            lambda _: ClassLimits(queue_timeout_s=5.0),
            hyperflexis=HyperFlexisParams(),
            max_engine_load=1,
        )
    )
    loop.start()
    try:
        busy = await loop.place(_view("r-1"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        other = next(e for e in fleet.records if e != busy.engine_id)
        # make the busy engine the first mature worker and the idle one later
        loop.core.workers.set("a", busy.engine_id, -math.inf)
        loop.core.workers.set("a", other, loop.clock() - 1.0)
        placed = await asyncio.wait_for(
            loop.place(_view("r-2"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0)), timeout=1.0
        )
        assert placed.engine_id == other
    finally:
        await loop.stop()


@pytest.mark.parametrize("work_s", [0.0015, 0.0])
async def test_steps_that_ask_for_another_step_at_once_let_the_event_loop_run_between_them(
    work_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demotion plan over a deep queue asks for a step per slice: chained without a yield
    (an already-set Event's wait() does not yield), the slices held every stream as one call.
    A chain that has held the loop for CHAIN_YIELD_S yields; a short one runs on (a yield after
    every step cost throughput in front of fast engines)."""
    import gateway.dispatch.loop as loop_module

    # a short chain is one that holds the loop under CHAIN_YIELD_S, whatever the machine: five
    # near-empty steps on a loaded one took over the 1 ms the gateway allows
    monkeypatch.setattr(loop_module, "CHAIN_YIELD_S", 0.001 if work_s else 1.0)
    fleet = offline_fleet({"a": 1})
    loop = DispatchLoop(offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot"))
    core = loop.core
    ticks = 0
    seen: list[int] = []
    real_step = core.step

    def step(now: float) -> None:
        seen.append(ticks)
        real_step(now)
        time.sleep(work_s)  # a slice's worth of work, or next to none
        if len(seen) < 5:
            core.wake()  # (as a plan's unfinished slice does)

    core.step = step  # type: ignore[method-assign]

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    loop.start()
    try:
        loop.wake()
        for _ in range(100):
            await asyncio.sleep(0)
            if len(seen) >= 5:
                break
        assert len(seen) == 5
        if work_s:
            assert all(b > a for a, b in itertools.pairwise(seen)), seen
        else:
            assert len(set(seen)) == 1, seen
    finally:
        other.cancel()
        await loop.stop()


def test_a_request_granted_a_laxer_ttft_than_its_class_may_wait_proportionally_longer() -> None:
    limits = ClassLimits(max_queued=8, queue_timeout_s=3.5, class_ttft_s=0.7)
    assert limits.timeout_for(0.7) == limits.timeout_for(0.2) == 3.5
    assert limits.timeout_for(10.0) == pytest.approx(50.0)
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1, limits=limits)
    assert core.submit(ticket("r-1"), 0.0) is not None
    lax = core.ticket(
        RequestView("r-2", "a", 100, 10, 0.0), 10.0, 0.1, "c", RunningEntry(100, 10, 0.1, 0.0), 0.0
    )
    strict = core.ticket(
        RequestView("r-3", "a", 100, 10, 0.0), 0.7, 0.1, "c", RunningEntry(100, 10, 0.1, 0.0), 0.0
    )
    assert core.submit(lax, 0.0) is None and core.submit(strict, 0.0) is None
    core.step(10.0)  # the strict one timed out at 3.5 s; the lax one may wait until 50 s
    assert [(rid, getattr(result, "code", None)) for rid, result in core.outbox] == [("r-3", "queue_timeout")]
    assert core.queued() == 1


def test_a_fast_engine_is_not_held_for_the_prefill_a_slow_prior_predicted() -> None:
    """Prior: 0.5 s per prefill. The engine's first token comes after 5 ms: the worker's hold
    ends then (in proportion), and the queued request goes at once, not 0.5 s later."""
    fleet = offline_fleet({"a": 1})
    slow = ((0.5, 0.0, 0.0), (0.01, 0.0, 0.0))
    core = offline_core(
        fleet, dispatcher="hyperflexis", order="slo_tpot", coefficients=slow, tightest_ttft_s=60.0
    )
    first = ticket("r-1", timeout=600.0)
    assert core.submit(first, 0.0) is not None
    assert core.submit(ticket("r-2", timeout=600.0), 0.001) is None  # the worker is held
    held_until = core.workers.maturity["a-0"]
    assert held_until > 0.5
    fleet.mark_prefilled("a-0", "r-1")
    core.step(0.005)
    assert core.outbox == [] and core.next_wake() == pytest.approx(0.01)  # the recheck floor
    core.step(core.next_wake())
    assert [rid for rid, _ in core.outbox] == ["r-2"]
    # without a first token the hold stands
    fleet2 = offline_fleet({"a": 1})
    core2 = offline_core(
        fleet2, dispatcher="hyperflexis", order="slo_tpot", coefficients=slow, tightest_ttft_s=60.0
    )
    assert core2.submit(ticket("r-1", timeout=600.0), 0.0) is not None
    assert core2.submit(ticket("r-2", timeout=600.0), 0.001) is None
    held = core2.workers.maturity["a-0"]
    core2.step(0.4)  # no first token yet: the hold stands
    assert core2.outbox == [] and core2.workers.maturity["a-0"] == held


async def test_arrivals_behind_a_waiting_head_do_not_each_wake_the_loop() -> None:
    """Saturated pipeline: 50 arrivals queue behind a head that waits for capacity; the loop
    runs a handful of turns for them, not one each, and still serves every one in order as
    capacity frees."""
    fleet = offline_fleet({"a": 1})
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    loop = DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            make_order("fcfs", {}),
            lambda _: ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
            lambda _: ClassLimits(max_queued=100),
            max_engine_load=1,
        )
    )
    loop.start()
    try:
        first = await loop.place(_view("r-0"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        waiters = []
        for i in range(1, 51):  # one arrival per loop iteration, as clients arrive
            waiters.append(
                asyncio.create_task(
                    loop.place(_view(f"r-{i}"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
                )
            )
            for _ in range(3):
                await asyncio.sleep(0)
        assert loop.core.queued() == 50
        assert loop.steps <= 2, loop.steps
        served = [first.engine_id]
        loop.release(first.engine_id, "r-0")
        for i, task in enumerate(waiters, start=1):
            record = await asyncio.wait_for(task, 1.0)
            served.append(record.engine_id)
            loop.release(record.engine_id, f"r-{i}")
        assert len(served) == 51 and loop.core.queued() == 0
    finally:
        await loop.stop()


async def test_a_standing_queue_does_not_move_the_loops_timer_on_every_placement() -> None:
    """Each placement from a standing queue moves its earliest expiry; the loop keeps its earlier
    timer (whose step re-arms) instead of cancelling and re-making one per placement, and the
    requests left still expire at their deadline."""
    fleet = offline_fleet({"a": 1})
    loop = DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, compile_profile({"scorers": [{"name": "least_load"}]})),
            make_order("fcfs", {}),
            lambda _: ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
            lambda _: ClassLimits(max_queued=100, queue_timeout_s=0.6),
            max_engine_load=1,
        )
    )
    event_loop = asyncio.get_running_loop()
    armed = 0
    call_at = event_loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal armed
        armed += callback == loop._fire  # (the loop's own timer, not the test's wait_for)
        return call_at(when, callback, *args, **kwargs)

    event_loop.call_at = counting_call_at  # type: ignore[method-assign]
    loop.start()
    try:
        first = await loop.place(_view("r-0"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        waiters, arrived = [], []
        for i in range(1, 21):
            arrived.append(time.monotonic())
            waiters.append(
                asyncio.create_task(
                    loop.place(_view(f"r-{i}"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
                )
            )
            await asyncio.sleep(0.002)  # (deadlines apart: each placement moves the earliest)
        await asyncio.sleep(0)
        assert loop.core.queued() == 20
        armed = 0
        loop.release(first.engine_id, "r-0")
        for i in range(1, 11):
            record = await asyncio.wait_for(waiters[i - 1], 1.0)
            loop.release(record.engine_id, f"r-{i}")
        assert armed <= 2, armed
        for task, at in zip(waiters[11:], arrived[11:], strict=True):
            with pytest.raises(GatewayError) as refused:
                await asyncio.wait_for(task, 2.0)
            assert refused.value.code == "queue_timeout"
            assert time.monotonic() < at + 0.6 + 0.3  # (at its deadline, not at a later one's)
        record = await asyncio.wait_for(waiters[10], 1.0)
        loop.release(record.engine_id, "r-11")
    finally:
        event_loop.call_at = call_at  # type: ignore[method-assign]
        await loop.stop()


def test_each_models_queue_is_keyed_with_its_own_fastest_engine() -> None:
    """A slow model listed first must not decide what counts as late for a fast one."""
    fleet = offline_fleet({"big": 1, "a": 2})
    speeds = {"big-0": (2.0, 1e-3), "a-0": (0.05, 2e-4), "a-1": (0.02, 1e-4)}

    def coefficients(engine_id: str) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        a, b = speeds[engine_id]
        return (a, b, 0.0), (0.01, 0.0, 0.0)

    core = DispatchCore(
        fleet,
        Router(fleet, compile_profile({"scorers": [{"name": "least_load"}]})),
        make_order("fcfs", {}),
        coefficients,
        lambda _: ClassLimits(),
    )
    assert core.context("a").prefill_base_s == 0.02
    assert core.context("a").prefill_tokens_per_s == pytest.approx(1e4)
    assert core.context("a").prefill_engines == 2
    assert core.context("big").prefill_base_s == 2.0
    speeds["a-1"] = (math.nan, 1e-4)  # a degenerate fit never stops dispatch
    assert core.context("a").prefill_engines >= 1


def test_class_timeouts_stretch_at_most_twenty_fold() -> None:
    limits = ClassLimits(queue_timeout_s=3.5, class_ttft_s=0.5)
    assert limits.timeout_for(86_400.0) == pytest.approx(70.0)


def test_a_claimed_tiny_ttft_cannot_shrink_the_budget_below_the_profiles_tightest() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", tightest_ttft_s=0.5)
    view = RequestView("r-1", "a", 100, 10, 0.0)
    core.submit(core.ticket(view, 0.001, 0.1, "c", RunningEntry(100, 10, 0.1, 0.0), 0.0), 0.0)
    assert core._tightest("a", 1.0) == 0.5


def test_an_engine_flipped_to_decode_leaves_the_hyperflexis_workers_until_it_returns() -> None:
    """Its own events (a decode's release, a first token) no longer wake it as a worker, and the
    queue's placements never go to it; flipped back, it is a worker at once."""
    fleet = offline_fleet({"a": 2})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    fleet.set_role("a-1", Role.DECODE)
    assert math.isinf(core.workers.maturity["a-1"])
    fleet.reserve("a-1", "decode-0", RunningEntry(100, 10, 0.1, 0.0))
    fleet.release("a-1", "decode-0")  # a decode stage's end on it
    assert math.isinf(core.workers.maturity["a-1"])
    placed = [core.submit(ticket(f"r-{i}"), 10.0) for i in range(3)]
    assert all(p is None or p.engine_id == "a-0" for p in placed)
    fleet.set_role("a-1", Role.PREFILL)
    assert core.workers.maturity["a-1"] == -math.inf


def test_a_late_loop_serves_hyperflexis_maturities_early_by_its_lateness() -> None:
    fleet = offline_fleet({"a": 2})
    core = offline_core(fleet, dispatcher="hyperflexis", hyperflexis=HyperFlexisParams())
    for engine in fleet.records:
        core.workers.set("a", engine, 1.0)
    assert core.submit(ticket("r-1", now=0.5, timeout=60.0), 0.5) is None  # both held until 1.0
    assert core.next_wake(0.5) == 1.0
    core.step(1.3)  # the driver ran that step 0.3 s late
    assert core.lag == pytest.approx(0.3) and [rid for rid, _ in core.outbox] == ["r-1"]
    core.outbox.clear()
    # a worker held until 2.0: its timer is armed 0.3 s early, and the step run then (on time,
    # this once) finds it due: no empty step
    for engine in fleet.records:
        core.workers.set("a", engine, 2.0)
    assert core.submit(ticket("r-2", now=1.4, timeout=60.0), 1.4) is None
    assert core.next_wake(1.4) == pytest.approx(1.7)
    core.step(1.7)
    assert [rid for rid, _ in core.outbox] == ["r-2"]
    # an arrival handled late takes a worker maturing within the lateness at once
    for engine in fleet.records:
        core.workers.set("a", engine, 2.0)
    assert core.submit(ticket("r-3", now=1.75, timeout=60.0), 1.75) is not None
    # armed early only while that is still ahead: never in the past (which would only spin)
    for engine in fleet.records:
        core.workers.set("a", engine, 3.0)
    assert core.submit(ticket("r-4", now=1.8, timeout=60.0), 1.8) is None  # 3.0 is beyond the lag
    assert core.next_wake(1.8) == pytest.approx(2.7)
    for engine in fleet.records:
        core.workers.set("a", engine, 1.9)
    assert core.next_wake(1.8) == pytest.approx(1.9)  # 1.6 would be before the last step: at 1.9
    # a scrape of a held engine brings nothing before that timer: no wake (compared with the
    # maturity less the lag, 1.6, every event woke the loop while it ran late)
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    fleet.record_state("a-0", EngineState(kv_usage=0.1, block_size=16, num_gpu_blocks=1000), 1.85)
    assert wakes == []
    # the lateness leaves its window with time, steps or not: an arrival long after the stall
    # (nothing queued, so no step ran meanwhile) does not take a worker held 0.2 s more
    core.step(1.9)
    assert core.queued() == 0
    for engine in fleet.records:
        core.workers.set("a", engine, 10.2)
    assert core.submit(ticket("r-5", now=10.0, timeout=60.0), 10.0) is None
    assert core.lag == 0.0


def test_a_waiting_adapter_request_does_not_hold_back_its_model() -> None:
    # a1 is loaded on a-0 only, which is full (max_engine_load 1): the a1 request at the head
    # waits for it, and the base-model requests behind it go to the idle engines meanwhile
    fleet = offline_fleet({"a": 3})
    fleet.set_adapters("a-0", frozenset({"a1"}))
    core = offline_core(fleet, max_engine_load=1)
    assert core.submit(ticket("r-0"), 0.0) is not None  # takes one engine (least load: any)
    busy = next(e for e, r in fleet.records.items() if r.in_flight)
    if busy != "a-0":  # make a-0 the full one, whichever the first went to
        fleet.release(busy, "r-0")
        fleet.reserve("a-0", "r-0", RunningEntry(100, 10, 0.1, 0.0))
    import dataclasses

    adapter = ticket("r-1")
    view = dataclasses.replace(adapter.item.view, lora="a1")
    adapter = Ticket(dataclasses.replace(adapter.item, view=view), "c", adapter.entry, 0.0)
    assert core.submit(adapter, 0.0) is None  # a-0 is full: it waits
    placed = [core.submit(ticket(f"r-{i}"), 0.0) for i in (2, 3)]
    core.step(0.0)
    engines = {rid: record.engine_id for rid, record in core.outbox if isinstance(record, EngineRecord)}
    engines.update({f"r-{i}": p.engine_id for i, p in zip((2, 3), placed, strict=True) if p is not None})
    assert sorted(engines.get(r) for r in ("r-2", "r-3")) == ["a-1", "a-2"]
    assert core.queued() == 1  # the a1 request still waits for a-0
    fleet.release("a-0", "r-0")
    core.step(0.1)
    assert [(rid, record.engine_id) for rid, record in core.outbox if rid == "r-1"] == [("r-1", "a-0")]


def test_hyperflexis_knows_which_adapters_its_engines_hold_as_they_change() -> None:
    """The adapters held in rotation are kept between turns (a scan of the fleet per turn) and
    follow the engines' loads, unloads, ejections and drains."""
    fleet = offline_fleet({"a": 2})
    fleet.set_adapters("a-0", frozenset({"a1"}))
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    assert core._adapters_held("a") == frozenset({"a1"})
    fleet.set_adapters("a-1", frozenset({"a2"}))
    assert core._adapters_held("a") == frozenset({"a1", "a2"})
    fleet.set_draining("a-1", True)
    assert core._adapters_held("a") == frozenset({"a1"})
    fleet.set_draining("a-1", False)
    fleet.record_health("a-0", False, eject_after=1, readmit_after=1)
    assert core._adapters_held("a") == frozenset({"a2"})
    fleet.set_adapters("a-1", frozenset())
    assert core._adapters_held("a") == frozenset()


def _held_core(engines: int = 1) -> tuple[Fleet, DispatchCore]:
    fleet = offline_fleet({"a": engines})
    return fleet, offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")


def test_a_first_token_ending_a_holds_prefills_asks_the_driver_for_a_step_queue_or_not() -> None:
    """The prefill is timed by the step that event asks for: at the next arrival instead, an
    engine that answered at once looked as slow as the gap between arrivals."""
    fleet, core = _held_core()
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None and core.queued() == 0
    wakes.clear()
    fleet.mark_prefilled("a-0", "r-0")
    assert wakes  # nothing queued, and still a step
    core.step(0.001)
    assert core.workers.prefill_ratio["a-0"] < 0.1


def test_with_the_drivers_clock_an_idle_models_first_token_is_timed_without_a_step() -> None:
    """A driver that gives the core its clock gets no step for a first token when nothing is
    queued for the model (in front of an idle fleet that was a loop turn per request): the
    prefill is timed at the event itself. With requests queued a step is asked for still."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot", max_engine_load=1)
    clock = [0.0]
    core.clock = lambda: clock[0]
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None and core.queued() == 0
    wakes.clear()
    clock[0] = 0.001
    fleet.mark_prefilled("a-0", "r-0")
    assert not wakes and core.workers.prefill_ratio["a-0"] < 0.1
    # timed at the event, not at the next arrival long after it
    ratio = core.workers.prefill_ratio["a-0"]
    fleet.release("a-0", "r-0")
    assert core.submit(ticket("r-1", now=5.0), 5.0) is not None
    assert core.workers.prefill_ratio["a-0"] == ratio
    # a hold ending while the model has a queue: timed at the event too, and a step is asked
    # for to serve the queue when the hold ends
    assert core.submit(ticket("r-2", now=5.0), 5.0) is None and core.queued() == 1
    wakes.clear()
    del core.workers.prefill_ratio["a-0"]
    clock[0] = 5.001
    fleet.mark_prefilled("a-0", "r-1")
    assert wakes and core.workers.prefill_ratio["a-0"] < 0.1


def test_under_saturation_only_events_that_make_a_worker_mature_wake_the_loop() -> None:
    """A worker in a hold looks at the hold's end, which the loop's timer stands for: an arrival
    behind the queue, a scrape and a completion that leaves it busy change nothing a turn would
    do before then (each woke a turn that took nothing: three a placement at 256 engines). A
    first token that ends the hold before the timer does wake it, and the timer's turn serves
    what waited."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    clock = [0.0]
    core.clock = lambda: clock[0]
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    fleet.reserve("a-0", "x", RunningEntry(100, 10, 0.1, 0.0))  # (it runs something already)
    assert core.submit(ticket("r-0"), 0.0) is not None
    assert core.submit(ticket("r-1"), 0.0) is None
    core.step(0.0)
    armed = core.next_wake(0.0)
    assert 0.01 < armed < math.inf and core.outbox == []
    wakes.clear()
    clock[0] = 0.001
    assert core.submit(ticket("r-2", now=0.001), 0.001) is None
    fleet.record_state("a-0", EngineState(kv_usage=0.1, block_size=16, num_gpu_blocks=1000), 0.001)
    fleet.release("a-0", "x")
    assert wakes == []
    fleet.mark_prefilled("a-0", "r-0")  # far sooner than predicted: the hold ends sooner
    assert wakes and core.workers.maturity["a-0"] < armed
    at = core.next_wake(0.001)
    core.step(at)
    assert [rid for rid, _ in core.outbox] == ["r-1", "r-2"]


def _held_with_a_queue(models: tuple[str, ...] = ("a",)) -> tuple[Fleet, DispatchCore, list[int]]:
    """One engine per model running a prefilled request, each given r-0 at once (a hold begins)
    with nothing queued; the core on a driver's clock at 0, wakes counted."""
    fleet = offline_fleet({m: 1 for m in models})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    core.clock = lambda: 0.001
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    for m in models:
        fleet.reserve(f"{m}-0", f"x-{m}", RunningEntry(100, 10, 0.1, 0.0))
        fleet.mark_prefilled(f"{m}-0", f"x-{m}")
        assert core.submit(ticket(f"{m}-0", model=m), 0.0) is not None
    return fleet, core, wakes


def test_a_hold_whose_request_was_cancelled_ends_sooner_and_wakes_the_loop_for_it() -> None:
    """A cancellation ends the hold's prefills as a first token does: the hold ends sooner, and
    the loop, whose timer was armed for its old end, is woken to re-arm."""
    fleet, core, wakes = _held_with_a_queue()
    assert core.submit(ticket("r-1"), 0.0) is None
    core.step(0.0)
    armed = core.next_wake(0.0)
    wakes.clear()
    fleet.release("a-0", "a-0")  # its client left; x-a still runs
    assert wakes and core.workers.maturity["a-0"] < armed
    core.step(core.next_wake(0.001))
    assert [rid for rid, _ in core.outbox] == ["r-1"]


def test_a_hold_another_models_event_shortens_wakes_the_loop_for_that_model() -> None:
    """Timing one engine's prefill times every hold whose prefills ended: a hold of model b
    that ends sooner for it needs a turn before the loop's timer, whichever model's event ran it."""
    fleet, core, wakes = _held_with_a_queue(("a", "b"))
    core.clock = None  # (b's cancellation is timed by a later event, as without a driver's clock)
    assert core.submit(ticket("b-1", model="b"), 0.0) is None
    core.step(0.0)
    armed = core.next_wake(0.0)
    fleet.release("b-0", "b-0")  # b's hold's prefills are over, not yet timed
    core.clock = lambda: 0.002
    wakes.clear()
    fleet.mark_prefilled("a-0", "a-0")  # a has nothing queued
    assert core.workers.maturity["b-0"] < armed and wakes


def test_a_worker_that_took_its_last_kv_has_no_timer_until_its_own_completion() -> None:
    """Its hold's end would find it full (a turn that takes nothing, one a placement under
    saturation): no timer until a completion or scrape on it, which gives its hold's end one."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    fleet.record_state("a-0", EngineState(kv_usage=0.0, block_size=1, num_gpu_blocks=420), 0.0)
    fleet.reserve("a-0", "x", RunningEntry(100, 10, 0.1, 0.0))
    assert core.submit(ticket("r-0"), 0.0) is not None  # (a hold begins)
    assert core.submit(ticket("r-1"), 0.0) is None and core.submit(ticket("r-2"), 0.0) is None
    first_hold_end = core.next_wake(0.0)
    core.step(first_hold_end)  # r-1 goes: 90 KV tokens are left, r-2 needs 110
    assert [rid for rid, _ in core.outbox] == ["r-1"]
    core.outbox.clear()
    hold_end = core.workers.maturity["a-0"]
    assert first_hold_end < hold_end < math.inf
    assert core.next_wake(first_hold_end) == 30.0  # (r-2's queue timeout)
    fleet.release("a-0", "x")  # two still run: the hold is kept, now with a timer
    assert core.next_wake(first_hold_end) == hold_end
    core.step(hold_end)
    assert [rid for rid, _ in core.outbox] == ["r-2"]


@pytest.mark.parametrize("event", ["scrape", "arrival that fits"])
def test_a_worker_waiting_for_kv_gets_its_timer_back_from_a_scrape_or_an_arrival_that_fits(
    event: str,
) -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot")
    fleet.record_state("a-0", EngineState(kv_usage=0.0, block_size=1, num_gpu_blocks=420), 0.0)
    fleet.reserve("a-0", "x", RunningEntry(100, 10, 0.1, 0.0))
    assert core.submit(ticket("r-0"), 0.0) is not None
    assert core.submit(ticket("r-1"), 0.0) is None and core.submit(ticket("r-2"), 0.0) is None
    core.step(core.next_wake(0.0))  # r-1 goes, 90 KV tokens left: r-2 needs 110
    core.outbox.clear()
    hold_end = core.workers.maturity["a-0"]
    assert core.next_wake(0.06) == 30.0
    if event == "scrape":
        # the engine has more cache than it said: r-2 fits now
        fleet.record_state("a-0", EngineState(kv_usage=0.0, block_size=1, num_gpu_blocks=500), 0.06)
        expected = ["r-2"]
    else:
        view = RequestView(request_id="r-3", model="a", prompt_tokens=40, max_output_tokens=10, arrival=0.06)
        item = QueuedRequest(view=view, ttft_slo=1.0, tpot_slo=0.1, seq=3, queue_deadline=30.06)
        assert core.submit(Ticket(item, "c", RunningEntry(40, 10, 0.1, 0.06), 0.06), 0.06) is None
        expected = ["r-3"]  # (50 KV tokens fit in 90)
    assert core.next_wake(0.06) == hold_end
    core.step(hold_end)
    assert [rid for rid, _ in core.outbox] == expected


def test_a_join_keeps_the_hold_timed_from_the_turn_it_joined() -> None:
    fleet, core = _held_core()
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None
    fleet.mark_prefilled("a-0", "r-0")
    fleet.release("a-0", "r-0")
    assert core.submit(ticket("r-1", now=0.001), 0.001) is not None  # a turn at 0.001
    assert core.workers.hold_started("a-0") == 0.001
    assert core.submit(ticket("r-2", now=0.002), 0.002) is not None  # a join at 0.002
    assert core.workers.hold_started("a-0") == 0.001


def test_only_holds_of_engines_faster_than_predicted_are_joinable() -> None:
    """Holds of engines never timed (or slow) must not fill the few places a join looks at:
    nine of them held before the one fast engine, and an arrival still finds it."""
    _, core = _held_core(10)
    workers = core.workers
    workers.prefill_ratio["a-9"] = 0.05
    for i in range(10):
        workers.hold("a", f"a-{i}", 1.0, 0.0, 0.1, tokens=100)
    views = workers.held("a", 2, 0.5)
    assert [v.engine_id for v in views] == ["a-9"] and views[0].joining == 100


def test_a_restarted_engine_is_timed_afresh() -> None:
    fleet, core = _held_core()
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None
    fleet.mark_prefilled("a-0", "r-0")  # a fast first token, not timed yet by a step ...
    fleet.record_health("a-0", False, eject_after=1, readmit_after=1)  # ... then it restarts
    fleet.record_health("a-0", True, eject_after=1, readmit_after=1)
    core.step(0.0001)
    assert "a-0" not in core.workers.prefill_ratio


def test_a_hold_cancelled_late_says_the_engine_is_not_fast() -> None:
    """A cancellation times nothing exactly, but a prefill not done after most of its predicted
    time is a lower bound: the engine's old "fast" ratio must not stand."""
    fleet, core = _held_core()
    core.workers.prefill_ratio["a-0"] = 0.05  # fast, once
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None
    predicted = core.workers._holds["a-0"][1]
    fleet.release("a-0", "r-0")  # cancelled before its first token ...
    core.step(0.9 * predicted)  # ... after 90 % of the prefill predicted for it
    assert core.workers.prefill_ratio["a-0"] >= 0.5


def _overload_demotion_run(
    settle: bool = False,
    shapes: tuple[tuple[int, int], tuple[int, int]] = ((50, 2000), (50, 20)),
    slots: int = 1,
) -> tuple[DispatchCore, list[str], list[str], int, int, int]:
    """A queue that only grows in front of one engine under HyperFlexis with demotions: the core,
    what was served, what is demoted at the end, how many steps ran, how many wakes were asked
    for and how many ticks of 50 ms. Even-numbered requests have the first (prompt, output)
    shape, odd ones the second; the engine runs ``slots`` at once, all finishing each tick.
    ``settle``: step again at the same time while a demotion plan is under way."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(
        fleet,
        dispatcher="hyperflexis",
        order="slo_tpot",
        max_engine_load=slots,
        limits=ClassLimits(max_queued=10_000),
        hyperflexis=HyperFlexisParams(demote_longest=True),
    )
    wakes = 0

    def wake() -> None:
        nonlocal wakes
        wakes += 1

    core.wake = wake

    def request(i: int, now: float) -> Ticket:
        prompt, output = shapes[i % 2]
        view = RequestView(
            request_id=f"r-{i}",
            model="a",
            prompt_tokens=prompt,
            max_output_tokens=output,
            arrival=now,
        )
        item = QueuedRequest(view=view, ttft_slo=3.0, tpot_slo=0.5, seq=i, queue_deadline=now + 1e6)
        return Ticket(item, "c", RunningEntry(prompt, output, 0.5, now), now)

    served: list[str] = []
    n = steps = ticks = 0
    now = 0.0
    while now < 8.0:
        ticks += 1
        for _ in range(4 * slots):  # 4 arrivals per slot per 50 ms, every slot finishing: it only grows
            placed = core.submit(request(n, now), now)
            if placed is not None:
                served.append(f"r-{n}")
            n += 1
        record = fleet.records["a-0"]
        for rid in list(record.running):
            fleet.release("a-0", rid)
        core.step(now)
        steps += 1
        while settle and core._demote_plans:
            core.step(now)
            steps += 1
        served.extend(rid for rid, _ in core.outbox)
        core.outbox.clear()
        now += 0.05
    demoted = [item.view.request_id for item in core.queues["a"].items() if item.demoted]
    return core, served, sorted(demoted), steps, wakes, ticks


def test_under_overload_hyperflexis_demotes_the_longest_queued_and_serves_the_rest_first() -> None:
    _, served, demoted, *_ = _overload_demotion_run()
    # (more short ones arrive than the engine serves: a few of those are given up too)
    longs = sum(int(rid.split("-")[1]) % 2 == 0 for rid in demoted)
    assert demoted and longs >= 0.95 * len(demoted)
    # once the drain was measured, what was still on time went short-first
    late_half = served[len(served) // 2 :]
    shorts = sum(int(rid.split("-")[1]) % 2 == 1 for rid in late_half)
    assert shorts >= 0.8 * len(late_half), late_half


def test_a_request_takes_from_the_drain_its_prefill_and_its_own_share_of_the_decode_steps() -> None:
    """A decode step's fixed cost is paid once for the whole batch: what serving one request
    rather than another costs a batching engine is its prefill and what its sequence adds to each
    step. Charged a whole step per output token, the plan gave up the short prompts with long
    answers and kept the long prompts (offline, that cost 5 points of SLO attainment on the
    TPOT-binding set at 1.2x capacity and 1.3 in the priority ramp)."""
    _, _, demoted, *_ = _overload_demotion_run(shapes=((2000, 20), (50, 200)), slots=8)
    long_prompts = sum(int(rid.split("-")[1]) % 2 == 0 for rid in demoted)
    # (charged whole steps the long prompts were 66 % of what was given up; charged what they add,
    # 83 %: the bound sits between the two)
    assert demoted and long_prompts >= 0.75 * len(demoted)


def test_a_demotion_plan_reads_a_deep_queue_a_slice_per_step_and_decides_as_one_pass(monkeypatch) -> None:
    """A plan over the whole queue at once held the event loop for tens of milliseconds at
    10,000 queued: it reads DEMOTE_SLICE requests per call, asks for the next step itself, and
    decides what a single pass over the same queue would."""
    import gateway.dispatch.core as core_module

    whole, *_ = _overload_demotion_run()
    sliced, *_ = _overload_demotion_run()
    queued = len(whole.queues["a"])
    assert queued > 100 and len(sliced.queues["a"]) == queued
    assert whole._plan_demotions("a", whole.queues["a"], 8.0)
    monkeypatch.setattr(core_module, "DEMOTE_SLICE", 7)
    calls = 1
    while not sliced._plan_demotions("a", sliced.queues["a"], 8.0):
        calls += 1
    assert calls == -(-queued // 7)

    def demoted(core: DispatchCore) -> set[str]:
        return {item.view.request_id for item in core.queues["a"].items() if item.demoted}

    assert demoted(sliced) == demoted(whole) != set()
    # a plan left unfinished for longer than DEMOTE_MAX_GAP_S read a queue that changed since
    assert not sliced._plan_demotions("a", sliced.queues["a"], 9.0)
    assert sliced._demote_plans["a"].at == 7
    assert not sliced._plan_demotions("a", sliced.queues["a"], 9.0 + core_module.DEMOTE_MAX_GAP_S + 0.1)
    assert sliced._demote_plans["a"].at == 7 and sliced._demote_plans["a"].started > 10.0
    # driven by steps: each step reads one slice and asks for the next
    _, _, demoted_ids, steps, wakes, ticks = _overload_demotion_run(settle=True)
    assert steps > 2 * ticks and wakes >= steps - ticks
    assert demoted_ids and all(int(rid.split("-")[1]) % 2 == 0 for rid in demoted_ids)


def test_a_sliced_demotion_plan_forgets_requests_that_left_and_a_failed_one_is_dropped(monkeypatch) -> None:
    """Requests dispatched or cancelled between a plan's slices no longer take their band's drain;
    a plan whose decision raises is dropped (not retried before every dispatch until it works)."""
    import gateway.dispatch.core as core_module

    core, *_ = _overload_demotion_run()
    queue = core.queues["a"]
    monkeypatch.setattr(core_module, "DEMOTE_SLICE", 7)

    def read(plan: object) -> list[str]:  # the on-time requests the plan has read so far
        return [member[3] for members in plan.members.values() for member in members]  # type: ignore[attr-defined]

    while not core._demote_plans.get("a") or not read(core._demote_plans["a"]):
        assert not core._plan_demotions("a", queue, 8.0)  # (the oldest are late: no rows)
    gone = read(core._demote_plans["a"])[0]
    assert core.cancel(gone, 8.0)  # leaves between slices
    planned: list[list[str]] = []
    real = core_module.demote_in_bands

    def spy(bands, now, rates, share, queued):  # type: ignore[no-untyped-def]
        # what the decision is given: every on-time request read, and what is still queued
        planned.append([m[3] for members in bands.values() for m in members if m[1] >= now])
        assert gone not in queued and all(rid in queued for rid in planned[-1] if rid != gone)
        return real(bands, now, rates, share, queued)

    monkeypatch.setattr(core_module, "demote_in_bands", spy)
    while not core._plan_demotions("a", queue, 8.0):
        pass
    # (read before it left; demote_in_bands leaves it out: tests/policies/test_demotion.py)
    assert planned and gone in planned[0] and len(planned[0]) > 7

    def broken(*_args):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in the plan")

    monkeypatch.setattr(core_module, "demote_in_bands", broken)  # fails as it decides
    with pytest.raises(RuntimeError):
        while not core._plan_demotions("a", queue, 9.5):
            pass
    assert "a" not in core._demote_plans
    monkeypatch.setattr(core_module, "demote_in_bands", real)
    monkeypatch.setattr(core_module, "band_of", broken)  # fails while reading the queue
    core._plan_rows.clear()  # (rows kept from earlier plans need no band_of)
    with pytest.raises(RuntimeError):
        core._plan_demotions("a", queue, 9.6)
    assert "a" not in core._demote_plans


def test_a_dispatched_request_drains_its_band_alike_from_its_plan_row_or_without() -> None:
    """A request leaving the queue credits its band's drain with its engine time: read from the
    row the plans kept of it (and the row dropped), or computed afresh, the same figures."""
    from policies.demotion import band_of

    with_rows, *_ = _overload_demotion_run()
    without, *_ = _overload_demotion_run()
    without._plan_rows.clear()
    leaving = [item.view.request_id for item in with_rows.queues["a"].items()][:40]
    ctx = with_rows.context("a", 8.0)
    # (rows of this very context: the rows' path is the one taken, not the fallback)
    assert all(with_rows._plan_rows["a"][rid][2] is ctx for rid in leaving)
    for core in (with_rows, without):
        rates = core._band_rates["a"]
        items = [core.queues["a"].get(rid) for rid in leaving]
        rates._waiting = frozenset(band_of(i.view.priority, i.ttft_slo, i.tpot_slo) for i in items if i)
        rates._served = {}
        for item in items:
            assert item is not None
            core._drained(item, 8.0)
    served = with_rows._band_rates["a"]._served
    assert served and served == without._band_rates["a"]._served
    assert not any(rid in with_rows._plan_rows["a"] for rid in leaving)  # (read from the rows)


def test_a_plan_reuses_what_it_computed_for_each_waiting_request_and_decides_the_same(monkeypatch) -> None:
    """What does not change while a request waits (its band, rank, last feasible start and engine
    time under one context) is computed once (at 10,000 queued that was most of every plan): rows
    kept from plans at other times equal rows computed afresh and decide the same, over several
    slices and under new latency coefficients; a request queued again under a new ticket gets its new targets' row;
    rows of requests that left are dropped once they outnumber the queue, and all of them once
    it is empty."""
    import gateway.dispatch.core as core_module

    cached, *_ = _overload_demotion_run()
    fresh, *_ = _overload_demotion_run()
    queue = cached.queues["a"]
    assert cached._plan_rows["a"]  # the run's plans filled it
    monkeypatch.setattr(core_module, "DEMOTE_SLICE", 50)

    def demoted(core: DispatchCore) -> set[str]:
        return {item.view.request_id for item in core.queues["a"].items() if item.demoted}

    ctx = cached.context("a", 8.0)
    decided = []
    for context in (ctx, replace(ctx, prefill_tokens_per_s=ctx.prefill_tokens_per_s / 3)):
        for core in (cached, fresh):
            fresh._plan_rows.clear()
            core._contexts["a"] = (8.0, context)
            core._band_rates["a"].rates = dict(cached._band_rates["a"].rates)
            core._band_rates["a"].close = lambda *_a, **_k: None  # type: ignore[method-assign]
            while not core._plan_demotions("a", core.queues["a"], 8.0):
                pass
        decided.append(demoted(cached))
        assert decided[-1] == demoted(fresh) != set()
        queued = {item.view.request_id for item in queue.items()}
        kept, computed = cached._plan_rows["a"], fresh._plan_rows["a"]
        assert len(queued) > 100 and {r: kept[r] for r in queued} == {r: computed[r] for r in queued}
    assert decided[0] != decided[1]  # (the coefficients matter: the comparison can tell)
    # under one context a plan only looks rows up; a new one recomputes only the two times
    rows_before = dict(cached._plan_rows["a"])
    while not cached._plan_demotions("a", queue, 8.0):
        pass
    assert all(cached._plan_rows["a"][r] is rows_before[r] for r in queued)
    cached._contexts["a"] = (8.0, ctx)
    while not cached._plan_demotions("a", queue, 8.0):
        pass
    for r in queued:
        old, new = rows_before[r], cached._plan_rows["a"][r]
        assert new[2] is ctx and new[1] is old[1] and new[3][0] is old[3][0] and new[3][1:] != old[3][1:]

    # one request leaves and comes back queued, its view unchanged, under tighter targets
    back = queue.items()[0]
    assert cached.cancel(back.view.request_id, 8.0)
    ticket = cached.ticket(back.view, 0.5, 0.05, "c", RunningEntry(10, 10, 0.05, 8.0), 8.0)
    assert cached.submit(ticket, 8.0) is None
    while not cached._plan_demotions("a", queue, 8.0):
        pass
    seq, band, row_ctx, (_rank, last_start, _service, rid) = cached._plan_rows["a"][back.view.request_id]
    assert seq == ticket.item.seq and band == (back.view.priority, 0.5, 0.05) and rid == back.view.request_id
    prefill = row_ctx.predicted_prefill_s(back.view.prompt_tokens)
    assert row_ctx is cached.context("a", 8.0) and last_start == back.view.arrival + 0.5 - prefill

    rows = cached._plan_rows_for("a", queue)
    gone = {f"gone-{i}": next(iter(rows.values())) for i in range(2 * len(queue) + 1100)}
    rows.update(gone)
    trimmed = cached._plan_rows_for("a", queue)
    assert not set(trimmed) & set(gone) and set(trimmed) == {item.view.request_id for item in queue.items()}
    for item in queue.items():
        cached.cancel(item.view.request_id, 8.5)
    assert "a" not in cached._plan_rows


def test_demotion_bands_are_targets_to_two_digits_at_one_level() -> None:
    from policies.demotion import band_of

    # mapped and explicit targets wobble a little: one band, which can learn a drain rate
    assert band_of(0, 0.7, 0.2) == band_of(0, 0.701, 0.2004) == (0, 0.7, 0.2)
    assert band_of(0, 0.7, 0.2) != band_of(0, 2.0, 0.5) != band_of(1, 2.0, 0.5)
    assert band_of(0, 86_400.0, 1e-3) == (0, 86_000.0, 0.001)


def test_hyperflexis_marks_what_it_dispatches_late_for_the_engines_queue() -> None:
    """A request placed with its TTFT already lost is marked late on its reservation (a deadline-
    scheduling engine then ranks it behind the on-time ones, as the dispatcher's late lane does),
    placed at its arrival or from the queue; an on-time one is not, and a retry marks anew."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot", max_engine_load=1)
    late_arrival = ticket("r-1", now=5.0)  # arrived 5 s ago with a 1 s TTFT: idle backfill takes it
    late_arrival.entry.late = False
    assert core.submit(late_arrival, 10.0) is not None
    assert late_arrival.entry.late
    queued_late, queued_on_time = ticket("r-2", now=8.0), ticket("r-3", now=10.0)
    queued_late.entry.late = queued_on_time.entry.late = True  # (what the turn must overwrite)
    assert core.submit(queued_late, 10.0) is None and core.submit(queued_on_time, 10.0) is None
    placed: list[str] = []
    for now in (10.01, 10.5):  # the seat frees twice: the on-time one goes first, then the late
        record = fleet.records["a-0"]
        for rid in list(record.running):
            fleet.release("a-0", rid)
        core.step(now)
        placed += [rid for rid, _ in core.outbox]
        core.outbox.clear()
    assert placed == ["r-3", "r-2"]
    assert (queued_on_time.entry.late, queued_late.entry.late) == (False, True)
    fleet.release("a-0", "r-2")
    retried = ticket("r-4", now=10.0)
    retried.entry.late = True
    core.retry(retried, (), 10.2)  # still within its TTFT
    assert not retried.entry.late


def test_tpot_classes_are_each_engines_most_common_target_and_one_engine_breaks_a_tie_of_classes() -> None:
    """The classes HyperFlexis keeps apart: an engine's most common TPOT among its running
    requests (idle: inf), with its KV capacity. When every engine is busy and of the tight class
    while some run lax requests too, the one with the largest share of them counts as lax:
    otherwise engines that all took tight requests first would mix the classes for good (an idle
    engine is a home for lax requests already)."""
    fleet, core = _held_core(3)
    for engine in fleet.records:
        fleet.record_state(engine, EngineState(kv_usage=0.0, block_size=16, num_gpu_blocks=100), 0.0)

    def run(engine: str, n: int, tpot: float) -> None:
        for _ in range(n):
            rid = f"{engine}-{tpot}-{len(fleet.records[engine].running)}"
            fleet.reserve(engine, rid, RunningEntry(100, 10, tpot, 0.0))

    def classes() -> dict[str, float]:
        read = core._tpot_classes("a")
        assert {kv for _, kv in read.values()} == {1600}
        return {e: c for e, (c, _) in read.items()}

    run("a-0", 5, 0.04)
    run("a-0", 1, 0.25)
    run("a-1", 4, 0.04)
    run("a-1", 2, 0.25)
    assert classes() == {"a-0": 0.04, "a-1": 0.04, "a-2": math.inf}
    run("a-2", 3, 0.04)  # every engine busy and tight: a-1 runs the largest share of lax ones
    assert classes() == {"a-0": 0.04, "a-1": 0.25, "a-2": 0.04}
    run("a-2", 3, 0.25)  # (a tie of counts is the tighter class; a-2's lax share is the largest)
    assert classes() == {"a-0": 0.04, "a-1": 0.04, "a-2": 0.25}
    run("a-1", 3, 0.25)  # an engine of the lax class on its own: nothing relabelled
    assert classes() == {"a-0": 0.04, "a-1": 0.25, "a-2": 0.04}
    fleet.record_health("a-1", False, eject_after=1, readmit_after=1)
    assert "a-1" not in classes()  # out of rotation: no class
    # targets within segregate_ratio (2x) of each other are one class: 0.02 and 0.03 engines are
    # all tight, and the one running a 0.2 minority counts as lax
    fleet, core = _held_core(2)
    run("a-0", 4, 0.02)
    run("a-1", 4, 0.03)
    run("a-1", 1, 0.2)
    assert {e: c for e, (c, _) in core._tpot_classes("a").items()} == {"a-0": 0.02, "a-1": 0.2}


@pytest.mark.parametrize("segregate", [False, True])
def test_hyperflexis_keeps_a_long_lax_prompt_off_the_engine_streaming_tight_answers(segregate: bool) -> None:
    """Through the dispatch core (its classes, its workers' views): the engine streaming tight-
    TPOT answers is the first mature worker; with ``tpot_segregation`` a lax request whose
    prompt would stall those streams goes to the engine streaming lax answers instead."""
    fleet = offline_fleet({"a": 2})
    params = HyperFlexisParams(budget_ttft_share=0.25, tpot_segregation=segregate)
    core = offline_core(
        fleet,
        dispatcher="hyperflexis",
        order="slo_tpot",
        hyperflexis=params,
        coefficients=((0.02, 1e-4, 0.0), (0.01, 1e-6, 1e-4)),
    )
    for i in range(10):
        for engine, tpot in (("a-0", 0.04), ("a-1", 0.25)):
            entry = RunningEntry(1000, 10, tpot, 0.0)
            entry.prefilled, entry.generated = True, 100
            fleet.reserve(engine, f"{engine}-{i}", entry)
    core.workers.set("a", "a-0", -1.0)  # the tight engine looks first
    core.workers.set("a", "a-1", -0.5)
    view = RequestView(request_id="bg-1", model="a", prompt_tokens=5000, max_output_tokens=100, arrival=0.0)
    item = QueuedRequest(view=view, ttft_slo=10.0, tpot_slo=0.25, seq=1, queue_deadline=60.0)
    placed = core.submit(Ticket(item, "c", RunningEntry(5000, 100, 0.25, 0.0), 0.0), 0.0)
    if placed is None:  # the arrival's own look had the tight engine only: the next step places it
        core.step(0.0)
        [(rid, placed)] = core.outbox
        assert rid == "bg-1"
    assert isinstance(placed, EngineRecord) and placed.engine_id == ("a-1" if segregate else "a-0")


# -- a bug in one place does not strand the rest -----------------------------------------------


def _lora_ticket(rid: str, lora: str | None, now: float = 0.0) -> Ticket:
    t = ticket(rid, now=now)
    view = replace(t.item.view, lora=lora)
    return Ticket(replace(t.item, view=view), "c", t.entry, now)


def test_an_adapter_request_behind_another_adapters_blocked_head_wakes_the_loop() -> None:
    """Pipeline dispatch with LoRA adapters: the head waits for the only engine with its adapter;
    an arrival for another adapter, loaded on an idle engine, was queued behind it without a
    wake, and waited for an unrelated release or a scrape (or, with no metrics, its timeout)."""
    fleet = offline_fleet({"a": 2})
    fleet.set_adapters("a-0", frozenset({"X"}))
    fleet.set_adapters("a-1", frozenset({"Y"}))
    core = offline_core(fleet, max_engine_load=1)
    wakes: list[int] = []
    core.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    placed = core.submit(_lora_ticket("r-0", "X"), 0.0)
    assert placed is not None and placed.engine_id == "a-0"
    assert core.submit(_lora_ticket("r-1", "X"), 0.0) is None  # waits for a-0
    core.step(0.0)
    assert core.outbox == [] and core.queued() == 1
    wakes.clear()
    assert core.submit(_lora_ticket("r-2", "Y", 0.1), 0.1) is None
    assert wakes, "nothing asked for the step that places it"
    core.step(0.1)
    assert [(rid, r.engine_id) for rid, r in core.outbox if isinstance(r, EngineRecord)] == [("r-2", "a-1")]
    # the same adapter as the blocked head: nothing to gain from a step
    wakes.clear()
    assert core.submit(_lora_ticket("r-3", "X", 0.2), 0.2) is None
    assert not wakes


async def test_a_failing_step_still_delivers_what_it_decided_and_dispatches_the_other_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in one model's turn: the other models' turns run all the same, and what the step
    assigned before failing reaches its waiting client (it held the engine and the client until
    some unrelated delivery)."""
    fleet = offline_fleet({"a": 1, "b": 1})
    core = offline_core(fleet, max_engine_load=1)
    real = core._dispatch_pipeline

    def dispatch(model: str, now: float) -> None:
        if model == "b":
            raise RuntimeError("a bug in model b's turn")
        real(model, now)

    monkeypatch.setattr(core, "_dispatch_pipeline", dispatch)
    loop = DispatchLoop(core)
    loop.start()

    def view(rid: str, model: str) -> RequestView:
        return RequestView(request_id=rid, model=model, prompt_tokens=10, max_output_tokens=10)

    try:
        for rid, model in (("a-r0", "a"), ("b-r0", "b")):
            await loop.place(view(rid, model), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        waiting = asyncio.create_task(
            loop.place(view("a-r1", "a"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        )
        stuck = asyncio.create_task(
            loop.place(view("b-r1", "b"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        )
        await asyncio.sleep(0)
        for _ in range(20):  # whichever model the step tries first
            fleet.release("b-0", "b-r0")
            fleet.release("a-0", "a-r0")
            if waiting.done():
                break
            await asyncio.sleep(0.02)
        record = await asyncio.wait_for(waiting, 1.0)
        assert record.engine_id == "a-0"
        assert not stuck.done() and core.queued("b") == 1  # still queued, tried on every step
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
        assert fleet.records["b-0"].in_flight == 0 and core.queued() == 0
    finally:
        await loop.stop()


async def test_a_step_that_fails_after_assigning_delivers_the_assignment() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1)
    loop = DispatchLoop(core)
    real = core.step

    def step(now: float) -> None:
        real(now)  # assigns the waiting request (to the outbox) ...
        raise RuntimeError("... then fails")

    core.step = step  # type: ignore[method-assign]
    loop.start()
    try:
        await loop.place(_view("r-0"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0))
        waiting = asyncio.create_task(loop.place(_view("r-1"), 1.0, 0.1, "c", RunningEntry(10, 10, 0.1, 0.0)))
        await asyncio.sleep(0)
        fleet.release("a-0", "r-0")
        record = await asyncio.wait_for(waiting, 1.0)
        assert record.engine_id == "a-0"
    finally:
        core.step = real  # type: ignore[method-assign]
        await loop.stop()


def test_a_submit_whose_turn_fails_leaves_no_ticket_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """HyperFlexis: an arrival to a non-empty queue is queued before the turn; when the turn
    raises, the caller is told the request failed, so the ticket must not stay to be placed."""
    fleet, core = _held_core()
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None
    fleet.release("a-0", "r-0")
    core.queues["a"]  # (made by the first arrival)
    # a queued request makes the next arrival go through the queue
    monkeypatch.setattr(core.workers, "next_mature", lambda model: math.inf)
    assert core.submit(ticket("r-1", now=0.1), 0.1) is None and core.queued() == 1
    monkeypatch.undo()

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug in the turn")

    monkeypatch.setattr(core, "_run_hyperflexis", broken)
    with pytest.raises(RuntimeError):
        core.submit(ticket("r-2", now=0.2), 0.2)
    assert "r-2" not in core.tickets and core.queued() == 1
    assert sum(r.in_flight for r in fleet.records.values()) == 0


@pytest.mark.parametrize("how", ["eject", "drain", "unload"])
def test_a_lora_request_left_to_an_engine_that_goes_away_is_taken_by_another(how: str) -> None:
    """HyperFlexis left a LoRA request to the engine holding its adapter and parked the other
    worker for slack; when that engine left rotation or unloaded the adapter, only a new
    arrival woke the parked worker: the request waited out its queue timeout beside it."""
    import dataclasses

    fleet = offline_fleet({"a": 2})
    fleet.set_adapters("a-0", frozenset({"ad1"}))
    core = offline_core(
        fleet,
        dispatcher="hyperflexis",
        order="slo_tpot",
        max_engine_load=1,
        limits=ClassLimits(queue_timeout_s=30.0),
    )
    fleet.reserve("a-0", "busy", RunningEntry(100, 10, 0.1, 0.0))  # the adapter's engine: full
    core.workers.park("a", "a-0", full=True)
    plain = ticket("x-1")
    lora = Ticket(
        dataclasses.replace(plain.item, view=dataclasses.replace(plain.item.view, lora="ad1")),
        "c",
        plain.entry,
        0.0,
    )
    assert core.submit(lora, 0.0) is None
    core.step(0.0)
    core.step(0.01)
    assert core.queued() == 1  # left to a-0
    if how == "eject":
        fleet.eject("a-0", "down")
    elif how == "drain":
        fleet.set_draining("a-0", True)
    else:
        fleet.set_adapters("a-0", frozenset())
    fleet.release("a-0", "busy")
    core.step(0.02)
    assert [rid for rid, _ in core.outbox] == ["x-1"] and core.queued() == 0


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1e-4])
def test_an_unusable_fit_falls_back_on_the_default_priors_whole_context(bad: float) -> None:
    """The fallback context had no decode terms: the demotion plan then charged every request
    its prefill alone, whatever its answer's length."""
    from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL
    from policies.queue_order import marginal_service_s

    fleet = offline_fleet({"m": 2})
    core = offline_core(fleet, coefficients=(DEFAULT_PREFILL, (0.012, bad, 1e-4)))
    ctx = core.context("m", 0.0)
    assert (ctx.decode_seq_s, ctx.decode_context_s) == (DEFAULT_DECODE[2], DEFAULT_DECODE[1])
    assert ctx.prefill_base_s == DEFAULT_PREFILL[0]
    short, long = (RequestView(f"r{n}", "m", 100, n) for n in (10, 1000))
    assert marginal_service_s(long, ctx) > marginal_service_s(short, ctx) + 0.09


@pytest.mark.parametrize("dispatcher", ["pipeline", "hyperflexis"])
def test_a_step_failing_after_taking_a_request_from_its_queue_answers_it(
    dispatcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug between taking a request from its queue and assigning it (the reservation, the
    router's bookkeeping): the ticket stayed, in no queue, still counted in its class, never
    placed nor expired, and its client waited for good. It is answered with a 500 now."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher=dispatcher, max_engine_load=1)
    assert core.submit(ticket("r-0", now=0.0), 0.0) is not None
    if dispatcher == "hyperflexis":  # (a queued request: the worker is busy until an event)
        monkeypatch.setattr(core.workers, "next_mature", lambda model: math.inf)
    assert core.submit(ticket("r-1", now=0.0), 0.0) is None and core.queued() == 1
    monkeypatch.undo()
    fleet.release("a-0", "r-0")
    core.outbox.clear()
    target = (core.router, "assigned") if dispatcher == "hyperflexis" else (fleet, "reserve")
    real = getattr(*target)
    calls = 0

    def fails_once(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug while assigning")
        return real(*args, **kwargs)

    monkeypatch.setattr(*target, fails_once)
    with pytest.raises(RuntimeError):
        for at in (0.1, 0.2, 0.3):  # (HyperFlexis: once its worker is mature again)
            core.step(at)
    assert calls == 1
    [(rid, answer)] = core.outbox
    assert rid == "r-1" and isinstance(answer, GatewayError) and answer.status == 500
    assert "r-1" not in core.tickets and core.queued() == 0
    assert sum(core.queued_per_class.values()) == 0 and fleet.records["a-0"].in_flight == 0
    # the engine is free for the next one
    assert core.submit(ticket("r-2", now=0.4), 0.4) is not None


def test_an_expiry_that_fails_answers_every_request_that_expired_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, max_engine_load=1)
    assert core.submit(ticket("r-0"), 0.0) is not None
    for i in (1, 2, 3):
        assert core.submit(ticket(f"r-{i}", timeout=1.0), 0.0) is None
    real = core._expired
    calls = 0

    def fails_once(item: QueuedRequest, now: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug while refusing")
        real(item, now)

    monkeypatch.setattr(core, "_expired", fails_once)
    with pytest.raises(RuntimeError):
        core.step(2.0)
    assert sorted(rid for rid, _ in core.outbox) == ["r-1", "r-2", "r-3"]
    assert not core.tickets and core.queued() == 0 and sum(core.queued_per_class.values()) == 0


def test_an_arrivals_turn_failing_after_taking_a_queued_request_answers_that_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HyperFlexis runs a turn inside submit when a worker is mature: one failing after it took a
    queued request from the queue left that request in no queue, never placed nor expired."""
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, dispatcher="hyperflexis", max_engine_load=1)
    assert core.submit(ticket("r-0"), 0.0) is not None
    monkeypatch.setattr(core.workers, "next_mature", lambda model: math.inf)
    assert core.submit(ticket("r-1"), 0.0) is None
    monkeypatch.undo()
    fleet.release("a-0", "r-0")  # (the worker is mature again: the next arrival's turn looks)
    core.outbox.clear()
    real = core.router.assigned

    def fails_once(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(core.router, "assigned", real)
        raise RuntimeError("a bug while assigning")

    monkeypatch.setattr(core.router, "assigned", fails_once)
    with pytest.raises(RuntimeError):
        core.submit(ticket("r-2", now=0.1), 0.1)
    [(rid, answer)] = core.outbox
    assert rid == "r-1" and isinstance(answer, GatewayError) and answer.status == 500
    assert not core.tickets and core.queued() == 0 and sum(core.queued_per_class.values()) == 0
    assert fleet.records["a-0"].in_flight == 0


def test_a_queues_context_counts_only_the_engines_that_take_its_requests() -> None:
    """The queue orders' drain estimate counted every engine of the model, a P/D model's decode
    engines and ejected ones too: a queue served by one prefill engine was predicted to drain
    four times as fast as it did."""
    fleet = offline_fleet({"a": 4})
    core = offline_core(fleet)
    assert core.context("a", 0.0).prefill_engines == 4
    for engine_id in ("a-1", "a-2"):
        fleet.set_role(engine_id, Role.DECODE)
    fleet.eject("a-3", "down")
    assert core.context("a", 10.0).prefill_engines == 1


@pytest.mark.parametrize("aging_s", [None, 1.0])
def test_a_low_priority_request_is_served_under_sustained_higher_priority_load_only_with_aging(
    aging_s: float | None,
) -> None:
    """Level-0 requests arriving at twice what the one engine serves starve a level-3 request for
    as long as they come (a peer complaint: low priorities never served); with the order's
    ``aging_s`` it reaches level 0 after three periods and goes at the next free seat, ahead of
    the level-0 requests that came after it."""
    fleet = offline_fleet({"a": 1})
    order = make_order("strict_priority", {} if aging_s is None else {"aging_s": aging_s})
    core = DispatchCore(
        fleet,
        Router(fleet, compile_profile({"scorers": [{"name": "least_load"}]})),
        order,
        lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE),
        lambda _: ClassLimits(max_queued=10_000, queue_timeout_s=600.0),
        max_engine_load=1,
    )
    placed: dict[str, float] = {}
    running: list[tuple[float, str, str]] = []  # (ends at, engine, request)

    def started(rid: str, record: EngineRecord, now: float) -> None:
        placed[rid] = now
        running.append((now + 0.5, record.engine_id, rid))

    def submit(rid: str, priority: int, now: float) -> None:
        view = RequestView(rid, "a", 100, 10, arrival=now, priority=priority)
        ticket = core.ticket(view, 60.0, 0.1, "c", RunningEntry(100, 10, 0.1, now), now)
        record = core.submit(ticket, now)
        if record is not None:
            started(rid, record, now)

    arrivals = [(0.25 * i, f"p0-{i}", 0) for i in range(80)] + [(0.1, "p3", 3)]
    arrivals.sort()
    now = 0.0
    while now < 20.0:
        for at, rid, priority in [a for a in arrivals if now <= a[0] < now + 0.05]:
            submit(rid, priority, at)
        for ends, engine_id, rid in [r for r in running if r[0] <= now]:
            running.remove((ends, engine_id, rid))
            fleet.release(engine_id, rid)
        core.step(now)
        outbox, core.outbox = core.outbox, []
        for rid, result in outbox:
            assert isinstance(result, EngineRecord)
            started(rid, result, now)
        now = round(now + 0.05, 2)
    if aging_s is None:
        assert "p3" not in placed and len(placed) >= 35  # (level 0 kept the engine busy)
    else:
        # level 0 from 3.1 s; the seat that frees next (every 0.5 s) is its
        assert 3.1 <= placed["p3"] <= 3.6
        later = [rid for rid, at in placed.items() if rid != "p3" and at > placed["p3"]]
        assert later and all(int(rid.split("-")[1]) * 0.25 > 0.1 for rid in later)


def test_a_worker_view_leaves_out_a_tpot_its_engine_cannot_meet_alone() -> None:
    """What HyperFlexis plans an engine's turn for (its running requests' tightest TPOT) leaves
    out targets below the engine's step for one sequence (policies.hyperflexis.tpot_floor): one
    client's x-slo-tpot-ms: 1 held its engine to a request a second."""
    from gateway.dispatch.workers import HyperFlexisWorkers
    from policies.hyperflexis import tpot_floor

    fleet = offline_fleet({"a": 1})
    workers = HyperFlexisWorkers(fleet, lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE), None)
    (record,) = fleet.records.values()
    floor = tpot_floor(DEFAULT_DECODE)
    assert floor > 0.001
    fleet.reserve(record.engine_id, "lax", RunningEntry(100, 50, 0.2, 0.0))
    fleet.reserve(record.engine_id, "tight", RunningEntry(100, 50, floor * 1.01, 0.0))
    view = workers._view(record, 0.0)
    assert view.load is not None and view.load.min_tpot == floor * 1.01
    fleet.reserve(record.engine_id, "claims", RunningEntry(100, 50, 0.001, 0.0))
    view = workers._view(record, 0.0)
    assert view.load is not None and view.load.min_tpot == floor * 1.01 and view.load.requests == 3
    fleet.release(record.engine_id, "tight")
    view = workers._view(record, 0.0)
    assert view.load is not None and view.load.min_tpot == 0.2 and view.load.max_tpot == 0.2
