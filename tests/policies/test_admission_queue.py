"""AdmissionQueue: literal scenarios plus hypothesis properties against a brute-force model."""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest import queue_bench
from policies.admission_queue import AdmissionQueue
from policies.api import RequestView
from policies.queue_order import ORDERS, LateLast, OrderContext, QueuedRequest, QueueOrder, make_order

CTX = OrderContext(prefill_tokens_per_s=1000.0, decode_step_s=0.02)


def req(
    seq: int, *, arrival: float = 0.0, prompt: int = 100, ttft: float = 10.0, deadline: float = math.inf
) -> QueuedRequest:
    view = RequestView(
        request_id=f"r{seq}", model="m", prompt_tokens=prompt, max_output_tokens=8, arrival=arrival
    )
    return QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=0.05, seq=seq, queue_deadline=deadline)


def drain(queue: AdmissionQueue, now: float, ctx: OrderContext = CTX) -> list[int]:
    out = []
    while (item := queue.pop(now, ctx)) is not None:
        out.append(item.seq)
    return out


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_empty_queue(name: str) -> None:
    queue = AdmissionQueue(make_order(name))
    assert len(queue) == 0 and not queue
    assert queue.peek(0.0, CTX) is None
    assert queue.pop(0.0, CTX) is None
    assert list(queue.iter_in_order(0.0, CTX, 10)) == []
    assert queue.expire(1e9) == []
    assert queue.remove("nope") is None
    assert queue.next_expiry() == math.inf


def test_fcfs_push_pop_peek_and_duplicates() -> None:
    queue = AdmissionQueue(make_order("fcfs"))
    for seq, arrival in [(0, 3.0), (1, 1.0), (2, 2.0), (3, 1.0)]:
        queue.push(req(seq, arrival=arrival), 4.0, CTX)
    with pytest.raises(ValueError, match="already queued"):
        queue.push(req(0), 4.0, CTX)
    assert len(queue) == 4 and "r1" in queue and queue.queued_prompt_tokens == 400
    first = queue.peek(4.0, CTX)
    assert first is not None and first.seq == 1
    assert [i.seq for i in queue.iter_in_order(4.0, CTX, 3)] == [1, 3, 2]
    assert [i.seq for i in queue.iter_in_order(4.0, CTX, 0)] == []
    assert drain(queue, 4.0) == [1, 3, 2, 0]
    assert queue.queued_prompt_tokens == 0


def test_remove_and_expire_leave_exactly_once() -> None:
    queue = AdmissionQueue(make_order("fcfs"))
    for seq in range(5):
        queue.push(req(seq, arrival=float(seq), deadline=10.0 + seq), float(seq), CTX)
    removed = queue.remove("r2")
    assert removed is not None and removed.seq == 2
    assert queue.remove("r2") is None
    assert queue.next_expiry() == 10.0
    assert [i.seq for i in queue.expire(11.0)] == [0, 1]
    assert queue.next_expiry() == 13.0
    assert queue.expire(11.5) == []
    assert drain(queue, 12.0) == [3, 4]
    assert queue.expire(100.0) == []  # popped items never expire afterwards


def test_aging_promotes_lazily() -> None:
    queue = AdmissionQueue(make_order("sjf_aging"))  # theta_age 5 s
    queue.push(req(0, arrival=0.0, prompt=4000), 0.0, CTX)
    for seq in range(1, 4):
        queue.push(req(seq, arrival=float(seq), prompt=10), float(seq), CTX)
    head = queue.peek(4.99, CTX)
    assert head is not None and head.seq == 1
    head = queue.peek(5.0, CTX)
    assert head is not None and head.seq == 0
    assert queue.key_of("r0") == (0.0, 0.0, 0.0, 0)
    assert drain(queue, 5.0) == [0, 1, 2, 3]


def test_sedf_demotes_infeasible_lazily() -> None:
    queue = AdmissionQueue(make_order("sedf"))
    queue.push(req(0, ttft=2.0, prompt=1000), 0.0, CTX)  # infeasible after t = 1.0
    queue.push(req(1, ttft=5.0, prompt=10), 0.0, CTX)
    assert [i.seq for i in queue.iter_in_order(1.0, CTX, 5)] == [0, 1]
    assert [i.seq for i in queue.iter_in_order(1.5, CTX, 5)] == [1, 0]


def test_iter_in_order_survives_remove_but_not_push() -> None:
    queue = AdmissionQueue(make_order("fcfs"))
    for seq in range(20):
        queue.push(req(seq, arrival=float(seq)), 0.0, CTX)
    seen = []
    for item in queue.iter_in_order(0.0, CTX, 100):
        seen.append(item.seq)
        if item.seq == 3:
            queue.remove("r4")
            queue.remove("r10")
    assert seen == [s for s in range(20) if s not in (4, 10)]
    iterator = queue.iter_in_order(0.0, CTX, 100)
    next(iterator)
    queue.push(req(99), 0.0, CTX)
    with pytest.raises(RuntimeError):
        next(iterator)


def test_context_tolerance() -> None:
    queue = AdmissionQueue(make_order("sedf"), context_tolerance=0.05)
    queue.push(req(0, ttft=2.0, prompt=1000), 0.0, CTX)
    nudged = OrderContext(prefill_tokens_per_s=1020.0, decode_step_s=0.02)
    queue.peek(0.0, nudged)
    assert queue.context is CTX  # 2 % is estimator noise: keys stay
    slow = OrderContext(prefill_tokens_per_s=400.0, decode_step_s=0.02)
    queue.peek(0.0, slow)
    assert queue.context is slow
    assert queue.key_of("r0") == (1.0, -2.0, 0)  # 2.5 s of prefill cannot meet a 2 s deadline
    fcfs = AdmissionQueue(make_order("fcfs"))
    fcfs.push(req(0), 0.0, CTX)
    fcfs.peek(0.0, slow)
    assert fcfs.context is CTX  # order ignores the context: never rebuilds


def test_kairos_stamps_fcfs_backlog() -> None:
    queue = AdmissionQueue(make_order("kairos"))
    queue.push(req(0, prompt=300), 0.0, CTX)
    queue.push(req(1, prompt=200), 0.0, CTX)
    stamped = queue.get("r1")
    assert stamped is not None and stamped.prefill_tokens_ahead == 300
    first = queue.get("r0")
    assert first is not None and first.prefill_tokens_ahead == 0
    fcfs = AdmissionQueue(make_order("fcfs"))
    fcfs.push(req(0), 0.0, CTX)
    assert fcfs.get("r0") == req(0)  # only orders that use the backlog pay for the stamp


def test_compaction_bounds_dead_entries() -> None:
    queue = AdmissionQueue(make_order("sjf_aging"))
    for seq in range(1000):
        queue.push(req(seq, arrival=0.0, prompt=seq % 97), 0.0, CTX)
    for seq in range(0, 1000, 2):
        queue.remove(f"r{seq}")
    for seq in range(1000, 1200):
        queue.push(req(seq, arrival=1.0), 1.0, CTX)
    queue.peek(6.0, CTX)  # every request ages: one dead entry each
    assert len(queue._order) <= 2 * len(queue) + 64
    assert len(drain(queue, 6.0)) == 700


# -- properties -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Push:
    prompt: int
    ttft_ms: int
    age_ms: int
    timeout_ms: int | None


@dataclass(frozen=True)
class Pop:
    pass


@dataclass(frozen=True)
class Remove:
    index: int


@dataclass(frozen=True)
class Expire:
    pass


@dataclass(frozen=True)
class Advance:
    ms: int


@dataclass(frozen=True)
class Scan:
    limit: int


@dataclass(frozen=True)
class Retune:
    rate: int


Op = Push | Pop | Remove | Expire | Advance | Scan | Retune

OPS = st.one_of(
    st.builds(
        Push,
        prompt=st.integers(0, 3000),
        ttft_ms=st.integers(1, 4000),
        age_ms=st.integers(0, 3000),
        timeout_ms=st.none() | st.integers(0, 8000),
    ),
    st.just(Pop()),
    st.builds(Remove, index=st.integers(0, 200)),
    st.just(Expire()),
    st.builds(Advance, ms=st.integers(0, 2500)),
    st.builds(Scan, limit=st.integers(0, 12)),
    st.builds(Retune, rate=st.sampled_from([250, 1000, 1030, 4000])),
)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(ORDERS)), ops=st.lists(OPS, max_size=80))
def test_queue_matches_brute_force(name: str, ops: list[Op]) -> None:
    """Any interleaving: every pushed request leaves exactly once, and pop / peek / iter_in_order
    agree with a brute-force sort of every queued item's current key."""
    order = make_order(name, {"theta_age_s": 2.0} if name == "sjf_aging" else None)
    queue = AdmissionQueue(order)
    ctx = CTX
    now_ms = 10_000
    pushed: list[str] = []
    left: list[str] = []
    seq = 0

    def brute(now: float) -> list[QueuedRequest]:
        held = queue.context or ctx
        return sorted(queue.items(), key=lambda i: order.key(i, now, held)[0])

    for op in ops:
        now = now_ms / 1000
        if isinstance(op, Push):
            arrival = (now_ms - op.age_ms) / 1000
            deadline = math.inf if op.timeout_ms is None else arrival + op.timeout_ms / 1000
            item = req(seq, arrival=arrival, prompt=op.prompt, ttft=op.ttft_ms / 1000, deadline=deadline)
            queue.push(item, now, ctx)
            pushed.append(item.view.request_id)
            seq += 1
        elif isinstance(op, Pop):
            queue.peek(now, ctx)  # adopt the context first so the brute force uses the same one
            expected = brute(now)
            got = queue.pop(now, ctx)
            if not expected:
                assert got is None
            else:
                assert got is not None and got.seq == expected[0].seq
                left.append(got.view.request_id)
        elif isinstance(op, Remove):
            queued = sorted(queue.items(), key=lambda i: i.seq)
            if queued:
                victim = queued[op.index % len(queued)].view.request_id
                assert queue.remove(victim) is not None
                left.append(victim)
        elif isinstance(op, Expire):
            due = {i.view.request_id for i in queue.items() if i.queue_deadline <= now}
            expired = queue.expire(now)
            assert {i.view.request_id for i in expired} == due
            assert [i.queue_deadline for i in expired] == sorted(i.queue_deadline for i in expired)
            left.extend(due)
        elif isinstance(op, Advance):
            now_ms += op.ms
        elif isinstance(op, Scan):
            scanned = [i.seq for i in queue.iter_in_order(now, ctx, op.limit)]
            assert scanned == [i.seq for i in brute(now)[: op.limit]]
        else:
            ctx = OrderContext(prefill_tokens_per_s=float(op.rate), decode_step_s=0.02)
        assert len(queue) == len(pushed) - len(left)
        head = queue.peek(now_ms / 1000, ctx)
        expected_all = brute(now_ms / 1000)
        assert (head.seq if head else None) == (expected_all[0].seq if expected_all else None)

    now = now_ms / 1000
    left.extend(i.view.request_id for i in queue.expire(math.inf))
    while (popped := queue.pop(now, ctx)) is not None:
        left.append(popped.view.request_id)
    assert len(queue) == 0
    assert sorted(left) == sorted(pushed)  # nothing lost, nothing duplicated


def test_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    results = queue_bench.run(count=200, seed=3, peeks=10)
    assert [r.order for r in results] == list(ORDERS)
    assert all(r.items == 200 and r.push_us > 0 and r.pop_us > 0 for r in results)
    assert "kairos" in capsys.readouterr().out


HEAD_OPS = st.lists(
    st.tuples(st.sampled_from(["push", "pop", "remove", "expire", "head", "tick"]), st.integers(0, 400)),
    max_size=150,
)


def _order(name: str) -> QueueOrder:
    late_last = name.startswith("late_last:")
    order = make_order(name.removeprefix("late_last:"))
    return LateLast(order) if late_last else order


@settings(max_examples=300, deadline=None)
@given(ops=HEAD_OPS, name=st.sampled_from(sorted(ORDERS) + [f"late_last:{n}" for n in sorted(ORDERS)]))
def test_cached_head_always_matches_the_walk_in_order(ops: list[tuple[str, int]], name: str) -> None:
    """head() keeps a sorted cache across pushes, pops, removals, expiry and re-keys; it must read
    exactly what iter_in_order reads, for every order (LateLast re-keys every request once)."""
    queue = AdmissionQueue(_order(name))
    now = 0.0
    seq = 0
    for op, arg in ops:
        if op == "push":
            seq += 1
            queue.push(
                req(
                    seq,
                    arrival=now - arg / 100,
                    prompt=1 + arg,
                    ttft=0.5 + arg / 50,
                    deadline=now + 1 + arg / 40,
                ),
                now,
                CTX,
            )
        elif op == "pop":
            queue.pop(now, CTX)
        elif op == "remove" and seq:
            queue.remove(f"r{1 + arg % seq}")
        elif op == "expire":
            queue.expire(now)
        elif op == "tick":
            now += arg / 200
        limit = 1 + arg % 70
        expected = [i.view.request_id for i in queue.iter_in_order(now, CTX, limit)]
        assert [i.view.request_id for i in queue.head(now, CTX, limit)] == expected


def test_late_last_keeps_late_requests_behind_the_rest_in_the_inner_order() -> None:
    queue = AdmissionQueue(LateLast(make_order("fcfs")))
    # 1000 tokens/s: a 500-token prompt needs 0.5 s; deadlines at arrival + ttft
    for seq, ttft in enumerate((0.6, 5.0, 0.7, 5.0, 0.55), start=1):
        queue.push(req(seq, arrival=0.0, prompt=500, ttft=ttft), 0.0, CTX)
    assert [i.view.request_id for i in queue.head(0.0, CTX, 10)] == ["r1", "r2", "r3", "r4", "r5"]
    # at 0.15 s r1 (last feasible start 0.1) and r5 (0.05) are late; r3 (0.2) is not yet
    assert [i.view.request_id for i in queue.head(0.15, CTX, 10)] == ["r2", "r3", "r4", "r1", "r5"]
    assert [i.view.request_id for i in queue.head(0.25, CTX, 10)] == ["r2", "r4", "r1", "r3", "r5"]


@settings(max_examples=100, deadline=None)
@given(ops=HEAD_OPS)
def test_min_need_is_the_least_need_queued_and_its_heap_stays_bounded(ops: list[tuple[str, int]]) -> None:
    queue = AdmissionQueue(make_order("fcfs"))
    now, seq = 0.0, 0
    for op, arg in ops:
        if op == "push":
            seq += 1
            queue.push(req(seq, prompt=1 + arg, deadline=now + 1 + arg / 40), now, CTX)
        elif op == "pop":
            queue.pop(now, CTX)
        elif op == "remove" and seq:
            queue.remove(f"r{1 + arg % seq}")
        elif op == "expire":
            queue.expire(now)
        elif op == "tick":
            now += arg / 200
        items = queue.items()
        if arg % 3:
            # (read now and then: the heap starts at the first read, over what is queued then,
            # and pushes, pops, removals and expiry keep it from there)
            continue
        assert queue.min_need() == min((i.view.prompt_tokens + 8 for i in items), default=0)
        assert queue._needs is not None
        assert len(queue._needs) <= 64 + 2 * max(1, len(items)) + 1


@pytest.mark.parametrize("name", ["fcfs", "slo_tpot", "strict_priority"])
def test_a_head_read_while_the_queue_was_short_does_not_grow_with_it(name: str) -> None:
    """A head read whole from a short queue stayed "whole" for orders that never re-key, so every
    later arrival was inserted into it: 20,000 arrivals made it the whole queue, O(n) per
    arrival and per departure. It is cut back to a prefix, and reads stay right."""
    queue = AdmissionQueue(make_order(name))
    for i in range(5):
        queue.push(req(i, arrival=float(i)), 10.0, CTX)
    assert len(list(queue.head(10.0, CTX, 8))) == 5  # read whole
    for i in range(20_000):
        queue.push(req(100 + i, arrival=float(i % 97) / 10, prompt=1 + i % 50), 10.0, CTX)
        assert len(queue._head) <= 2 * 64 + 1
    expected = [item.view.request_id for item in queue.iter_in_order(10.0, CTX, 200)]
    assert [item.view.request_id for item in queue.head(10.0, CTX, 200)] == expected
    for _ in range(300):
        queue.pop(10.0, CTX)
    expected = [item.view.request_id for item in queue.iter_in_order(10.0, CTX, 50)]
    assert [item.view.request_id for item in queue.head(10.0, CTX, 50)] == expected


def test_the_deadline_heap_holds_about_what_is_queued() -> None:
    """Popped items' deadline entries stayed until they surfaced, and one early live deadline
    pinned every later one: the heap held every item queued within the timeout."""
    queue = AdmissionQueue(make_order("fcfs"))
    # stays queued (last in order) with the least deadline
    queue.push(req(0, arrival=1e9, deadline=1.0), 0.0, CTX)
    for i in range(1, 30_000):
        queue.push(req(i, arrival=float(i), deadline=1e6 + i), float(i), CTX)
        assert queue.pop(float(i), CTX) is not None
    assert len(queue) == 1 and len(queue._deadlines) <= 64 + 2 * 2
    assert queue.next_expiry() == 1.0


_CONTEXTS = [
    OrderContext(1000.0, 0.02),
    OrderContext(250.0, 0.02, 0.05, 2),
    OrderContext(4000.0, 0.01, 0.0, 3),
]
_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["push", "pop", "remove", "expire", "tick", "demote", "undemote", "ctx", "head", "scan"]
        ),
        st.integers(0, 400),
        st.integers(0, 3),
        st.integers(0, 2),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(ORDERS) + ["late:" + n for n in sorted(ORDERS)]), ops=_OPS)
def test_every_read_of_the_queue_matches_a_brute_force_sort_under_any_operations(
    name: str, ops: list[tuple[str, int, int, int]]
) -> None:
    """Several tenants, priorities, TPOT classes, deadlines, demotions and context changes (the
    other tests here use one of each, so strict_priority and slo_tpot reduce to FCFS and
    demotion is never set): pop, head, iter_in_order, the counts and min_need against a brute
    force sort of what is queued, after every operation."""
    _check_every_read(name, ops, in_order=False)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(ORDERS) + ["late:" + n for n in sorted(ORDERS)]), ops=_OPS)
def test_every_read_matches_a_brute_force_sort_when_arrivals_mostly_come_in_order(
    name: str, ops: list[tuple[str, int, int, int]]
) -> None:
    """As above, with most requests pushed as they arrive (their arrival is now, their queue
    deadline a fixed timeout on), as a gateway pushes them, and one in four older: the pushes in
    key order go to the sorted run, the others to the heap, and every read merges the two."""
    _check_every_read(name, ops, in_order=True)
    queue = AdmissionQueue(make_order("fcfs"))
    for i in range(100):
        queue.push(req(i, arrival=float(i), deadline=1e3 + i), float(i), CTX)
    # (in order: all of them in the run, none in the heaps)
    assert len(queue._order.run) == 100 and not queue._order.heap and not queue._deadlines.heap


def test_expiry_reads_the_sorted_run_and_the_heap_together() -> None:
    # deadlines 5 and 20 come in order (the run), 8 does not (the heap): the earliest is in the
    # run while the heap's is later, and a due one in the run must not wait behind it
    queue = AdmissionQueue(make_order("fcfs"))
    for i, deadline in enumerate((5.0, 20.0, 8.0)):
        queue.push(req(i, arrival=float(i), deadline=deadline), 0.0, CTX)
    assert queue.next_expiry() == 5.0
    assert [i.queue_deadline for i in queue.expire(6.0)] == [5.0]
    assert queue.next_expiry() == 8.0
    assert [i.queue_deadline for i in queue.expire(30.0)] == [8.0, 20.0]
    assert len(queue) == 0 and queue.next_expiry() == math.inf


def test_compaction_keeps_the_order_of_the_run_and_the_heap() -> None:
    # arrivals in order (the run) and out of order (the heap), most of them removed: compaction
    # drops the dead entries of both, and what is left still comes out in order
    queue = AdmissionQueue(make_order("fcfs"))
    arrivals = [float(i) for i in range(600)] + [i + 0.5 for i in range(0, 600, 3)]
    for seq, arrival in enumerate(arrivals):
        queue.push(req(seq, arrival=arrival), 700.0, CTX)
    assert queue._order.run and queue._order.heap
    kept = set(range(0, len(arrivals), 7))
    for seq in range(len(arrivals)):
        if seq not in kept:
            assert queue.remove(f"r{seq}") is not None
    assert queue._dead_in_heap == len(queue._order) - len(queue)
    queue.peek(700.0, CTX)  # (a read compacts: the dead outnumber the live)
    assert len(queue._order) == len(queue) == len(kept) and queue._dead_in_heap == 0
    popped = []
    while (item := queue.pop(700.0, CTX)) is not None:
        popped.append(item.view.arrival)
    assert popped == sorted(arrivals[seq] for seq in kept)


def test_a_walk_starts_past_the_dead_entries_at_the_front() -> None:
    # requests that left from the front of the run (or were re-keyed into a late lane) leave dead
    # entries there until compaction (dead outnumbering live): a walk drops them first instead of
    # reading past all of them every time
    for read in ("scan", "head"):
        queue = AdmissionQueue(make_order("fcfs"))
        for i in range(1000):
            queue.push(req(i, arrival=float(i)), float(i), CTX)
        for i in range(400):
            assert queue.remove(f"r{i}") is not None
        assert len(queue._order.run) == 1000  # (400 dead, fewer than the live: no compaction)
        if read == "scan":
            first = list(queue.iter_in_order(1000.0, CTX, 3))
        else:
            first = list(queue.head(1000.0, CTX, 3))
        assert [i.seq for i in first] == [400, 401, 402]
        assert len(queue._order.run) == 600


def _check_every_read(name: str, ops: list[tuple[str, int, int, int]], in_order: bool) -> None:
    order = make_order(name.removeprefix("late:"))
    if name.startswith("late:"):
        order = LateLast(order)
    q = AdmissionQueue(order, context_tolerance=0.0)
    now, seq, ctx = 0.0, 0, _CONTEXTS[0]
    pushed: list[str] = []
    left: list[str] = []

    def brute() -> list[QueuedRequest]:
        held = q.context or ctx
        return sorted(q.items(), key=lambda i: order.key(i, now, held)[0])

    for op, arg, t, p in ops:
        if op == "push":
            seq += 1
            late_push = not in_order or arg % 4 == 0
            arrival = now - arg / 300 if late_push else now
            v = RequestView(f"r{seq}", "m", arg * 7, 8, arrival=arrival, tenant=f"t{t}", priority=p)
            timeout = 0.5 + arg / 50 if late_push else 0.5
            it = QueuedRequest(v, 0.2 + arg / 80, [0.02, 0.05, 0.1][p], seq, queue_deadline=now + timeout)
            q.push(it, now, ctx)
            pushed.append(v.request_id)
        elif op == "pop":
            q.peek(now, ctx)
            exp = brute()
            got = q.pop(now, ctx)
            assert (got.seq if got else None) == (exp[0].seq if exp else None)
            if got:
                left.append(got.view.request_id)
        elif op == "remove" and seq:
            r = q.remove(f"r{1 + arg % seq}")
            if r:
                left.append(r.view.request_id)
        elif op == "expire":
            due = sorted(i.queue_deadline for i in q.items() if i.queue_deadline <= now)
            gone = q.expire(now)
            assert [i.queue_deadline for i in gone] == due  # every due one, earliest first
            left += [i.view.request_id for i in gone]
        elif op == "tick":
            now += arg / 400
        elif op in ("demote", "undemote") and seq:
            q.set_demoted([f"r{1 + (arg + k) % seq}" for k in range(3)], op == "demote", now, ctx)
        elif op == "ctx":
            ctx = _CONTEXTS[p]
        elif op == "head":
            q.peek(now, ctx)
            exp = [i.seq for i in brute()[: 1 + arg % 70]]
            assert [i.seq for i in q.head(now, ctx, 1 + arg % 70)] == exp
        elif op == "scan":
            q.peek(now, ctx)
            assert [i.seq for i in q.iter_in_order(now, ctx, 1 + arg % 70)] == [
                i.seq for i in brute()[: 1 + arg % 70]
            ]
        assert len(q) == len(pushed) - len(left)
        # (every entry of the order is a queued item's current one or counted dead: what
        # compaction goes by)
        assert q._dead_in_heap == len(q._order) - len(q)
        assert q.queued_prompt_tokens == sum(i.view.prompt_tokens for i in q.items())
        assert q.min_need() == min((i.view.prompt_tokens + 8 for i in q.items()), default=0)
        if q._flows is not None:
            assert len(q._flows) == len(q)
    left += [i.view.request_id for i in q.expire(math.inf)]
    assert len(q) == 0 and sorted(left) == sorted(pushed)


# -- what compaction lets go of, and when ----------------------------------------------------------


def _largest_net_free(ops: list[Callable[[], object]]) -> int:
    """The most container objects (net of allocations) any one of ``ops`` let go of, as CPython's
    young-collection count sees them. The count is raised far above zero first: it never goes
    below zero, which would hide frees."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        ballast = [[] for _ in range(500_000)]
        largest = 0
        for op in ops:
            before = gc.get_count()[0]
            op()
            largest = max(largest, before - gc.get_count()[0])
        del ballast
        return largest
    finally:
        if was_enabled:
            gc.enable()


def _churn(queue: AdmissionQueue, size: int, rounds: int) -> list[Callable[[], object]]:
    """Operations that hold ``size`` queued and take them out of order (every other one removed
    behind the head, the rest popped), with reads that re-key (aging): each compacts its heaps
    again and again."""
    ops: list[Callable[[], object]] = []
    for seq in range(size):
        ops.append(
            lambda seq=seq: queue.push(req(seq, arrival=0.0, prompt=seq % 97, deadline=1e9 + seq), 0.0, CTX)
        )
    for i in range(rounds):
        seq = size + i
        now = 1.0 + i * 0.01
        ops.append(
            lambda seq=seq, now=now: queue.push(
                req(seq, arrival=now, prompt=seq % 97, deadline=1e9 + seq), now, CTX
            )
        )
        if i % 2:
            ops.append(lambda seq=seq: queue.remove(f"r{seq - size + 1}"))
        else:
            ops.append(lambda now=now: queue.pop(now, CTX))
    return ops


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's collector count")
def test_a_compaction_lets_go_of_what_it_replaced_a_few_entries_at_a_time() -> None:
    """Dropped at once, a compacted heap of 10,000 queued freed every dead entry (and the
    requests only those held) in one call: more deallocations than CPython's young-collection
    count could take, so that count kept only the allocations, and under a standing queue each
    compaction brought on a collection of the whole young generation (40-70 ms at 10,000 queued
    in `slogate bench dispatch`)."""
    queue = AdmissionQueue(make_order("sjf_aging", {"theta_age_s": 5.0}))
    ops = _churn(queue, 10_000, 30_000)
    ops.append(lambda: queue.peek(1e6, CTX))  # every request aged: a re-key and a compaction
    assert _largest_net_free(ops) <= 200


def test_what_compactions_replaced_stays_bounded_and_is_let_go_of() -> None:
    queue = AdmissionQueue(make_order("sjf_aging", {"theta_age_s": 0.5}))
    held_most = 0
    for op in _churn(queue, 1_000, 40_000):
        op()
        held_most = max(held_most, sum(len(entries) for entries in queue._discards.held))
    assert held_most > 0  # (compactions ran)
    assert held_most <= 16 * 1_000 + 1_000
    while queue.pop(1e6, CTX) is not None:
        pass
    assert not queue._discards.held


def test_what_re_keys_replace_stays_bounded_when_the_context_flaps() -> None:
    """A context that moves past the tolerance re-keys every item and replaces two whole heaps
    at once; alternating (an engine flapping in and out of rotation), it replaced them faster
    than arrivals and departures let go of them, and what the queue held grew for as long as the
    backlog lasted."""
    queue = AdmissionQueue(make_order("kairos"))
    contexts = [OrderContext(1000.0, 0.02), OrderContext(2000.0, 0.02)]
    for seq in range(1_000):
        queue.push(req(seq, arrival=0.0, prompt=50 + seq % 97), 0.0, contexts[0])
    held_most = 0
    for i in range(20_000):
        ctx = contexts[(i // 10) % 2]
        now = 1.0 + i * 1e-3
        queue.push(req(1_000 + i, arrival=now, prompt=50 + i % 97), now, ctx)
        assert queue.pop(now, ctx) is not None
        discards = queue._discards
        assert discards.count == sum(len(entries) for entries in discards.held)
        held_most = max(held_most, discards.count)
    assert held_most > 4 * 1_000  # (re-keys replaced heaps: something was held)
    assert held_most <= 8 * 1_001 + 4096


def test_a_queue_emptied_by_removals_holds_nothing_after_its_next_read() -> None:
    """Emptied through remove(), a queue still counted its dead entries: the next read compacted
    and parked them in the discards while nothing was queued."""
    queue = AdmissionQueue(make_order("sjf_aging", {"theta_age_s": 5.0}))
    for seq in range(1_000):
        queue.push(req(seq, arrival=0.0, prompt=seq % 97, deadline=1e9), 0.0, CTX)
    for seq in range(1_000):
        queue.remove(f"r{seq}")
    assert len(queue) == 0
    assert queue.peek(1.0, CTX) is None
    assert queue._discards.count == 0 and not queue._discards.held
