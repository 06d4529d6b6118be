"""The strong-baseline queue orders (llm-d-style flow control, Dynamo-style WSPT) and saturation
shedding: literal cases, properties of the flow rounds against the two-level scheduler they stand
for, and the pure shedding decision."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission_queue import AdmissionQueue
from policies.api import EngineSnapshot, PolicyConfigError, RequestView
from policies.flow_control import (
    PARKED,
    FlowRounds,
    PoolLoad,
    ShedCandidate,
    SheddingParams,
    queued_prefill_s,
    saturated,
    shed_victim,
)
from policies.queue_order import (
    FlowControl,
    OrderContext,
    QueuedRequest,
    Wspt,
    make_order,
    with_flow_round,
)

CTX = OrderContext(prefill_tokens_per_s=1000.0, decode_step_s=0.02)  # 1000 tokens = 1 s of prefill


def req(
    seq: int,
    *,
    tenant: str = "default",
    band: int = 0,
    arrival: float = 0.0,
    ttft: float = 10.0,
    prompt: int = 100,
    output: int = 16,
    deadline: float = math.inf,
) -> QueuedRequest:
    view = RequestView(
        request_id=f"r{seq}",
        model="m",
        prompt_tokens=prompt,
        max_output_tokens=output,
        arrival=arrival,
        tenant=tenant,
        priority=band,
    )
    return QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=0.05, seq=seq, queue_deadline=deadline)


def drain(queue: AdmissionQueue, now: float = 0.0) -> list[QueuedRequest]:
    out = []
    while (item := queue.pop(now, CTX)) is not None:
        out.append(item)
    return out


# -- flow control: literal cases --------------------------------------------------------------------


def test_bands_are_strict_then_tenants_take_turns_then_edf_within_a_tenant() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    # tenant a floods first (deadlines 10, 9, 8, ...), then b and c send two each; one p1 request
    for seq in range(6):
        queue.push(req(seq, tenant="a", ttft=10.0 - seq), 0.0, CTX)
    queue.push(req(10, tenant="b", ttft=30.0), 0.0, CTX)
    queue.push(req(11, tenant="b", ttft=20.0), 0.0, CTX)
    queue.push(req(12, tenant="c", ttft=1.0), 0.0, CTX)
    queue.push(req(13, tenant="c", ttft=40.0), 0.0, CTX)
    queue.push(req(20, tenant="a", band=1, ttft=0.1), 0.0, CTX)
    served = [(i.view.tenant, i.seq) for i in drain(queue)]
    # round 0: every tenant's earliest deadline, by deadline (c 1.0, a 5.0, b 20.0); round 1: the
    # next of each; then a alone, EDF; band 1 last despite the tightest deadline
    assert served == [
        ("c", 12),
        ("a", 5),
        ("b", 11),
        ("a", 4),
        ("b", 10),
        ("c", 13),
        ("a", 3),
        ("a", 2),
        ("a", 1),
        ("a", 0),
        ("a", 20),
    ]


def test_a_tenant_that_starts_sending_joins_the_current_round() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    for seq in range(100):
        queue.push(req(seq, tenant="big", arrival=0.0, ttft=5.0), 0.0, CTX)
    for _ in range(40):
        queue.pop(1.0, CTX)
    # 40 rounds served; a newcomer goes next (or right after big's current-round head)
    queue.push(req(500, tenant="small", arrival=1.0, ttft=5.0), 1.0, CTX)
    order = [i.view.tenant for i in drain(queue, 1.0)]
    assert order.index("small") <= 1


def test_a_tenant_that_stops_and_starts_again_rejoins_the_current_round_not_an_old_one() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    for seq in range(10):
        queue.push(req(seq, tenant="u", ttft=5.0), 0.0, CTX)
    queue.push(req(10, tenant="t", ttft=5.0), 0.0, CTX)
    served = [queue.pop(0.0, CTX) for _ in range(6)]  # u, t (round 0), then u's rounds 1-4
    assert [i.view.tenant for i in served if i is not None] == ["u", "t", "u", "u", "u", "u"]
    for seq in range(11, 14):
        queue.push(req(seq, tenant="t", ttft=5.0), 0.0, CTX)
    assert [i.view.tenant for i in drain(queue)[:4]] == ["t", "u", "t", "u"]


def test_an_arrival_due_before_its_tenants_head_takes_its_place_and_round() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    queue.push(req(1, tenant="a", ttft=5.0), 0.0, CTX)
    queue.push(req(2, tenant="a", ttft=6.0), 0.0, CTX)
    queue.push(req(3, tenant="b", ttft=9.0), 0.0, CTX)
    held = queue.get("r1")
    assert held is not None and held.flow_round == 0.0
    second = queue.get("r2")
    assert second is not None and second.flow_round == PARKED
    queue.push(req(4, tenant="a", ttft=1.0), 0.0, CTX)
    demoted, head = queue.get("r1"), queue.get("r4")
    assert demoted is not None and demoted.flow_round == PARKED
    assert head is not None and head.flow_round == 0.0
    assert [i.seq for i in drain(queue)] == [4, 3, 1, 2]


def test_departures_of_any_kind_hand_the_head_on() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    for seq, ttft in enumerate((1.0, 2.0, 3.0, 4.0), start=1):
        queue.push(req(seq, ttft=ttft, deadline=10.0 if seq == 2 else math.inf), 0.0, CTX)
    assert queue.remove("r1") is not None  # cancelled head: r2 leads
    assert [i.seq for i in queue.expire(10.0)] == [2]  # expired head: r3 leads
    first = queue.peek(10.0, CTX)
    assert first is not None and first.seq == 3 and queue.key_of("r3") == (0.0, 2.0, 3.0, 3)
    assert [i.seq for i in drain(queue, 10.0)] == [3, 4]


def test_iterating_survives_removals_that_hand_a_head_on() -> None:
    queue = AdmissionQueue(make_order("flow_control"))
    for seq in range(30):
        queue.push(req(seq, tenant="ab"[seq % 2], ttft=1.0 + seq), 0.0, CTX)
    seen = []
    for item in queue.iter_in_order(0.0, CTX, 100):
        seen.append(item.seq)
        if item.seq == 0:
            queue.remove("r0")  # tenant a's head: r2 becomes its head at the next read, not now
    assert seen == list(range(30))
    assert queue.key_of("r2") == (0.0, math.inf, 3.0, 2)
    assert [i.seq for i in drain(queue)] == list(range(1, 30))  # round robin a, b by deadline
    assert queue.key_of("r2") is None


def test_without_stamps_the_order_is_strict_priority_then_edf() -> None:
    order = FlowControl()
    items = [req(0, band=1, ttft=0.1), req(1, ttft=9.0), req(2, tenant="x", ttft=3.0)]
    assert [i.seq for i in sorted(items, key=lambda i: order.key(i, 0.0, CTX)[0])] == [2, 1, 0]
    assert order.key(items[0], 0.0, CTX)[1] == math.inf


def test_with_flow_round_matches_replace() -> None:
    item = replace(req(3, arrival=2.0), batch_deadlines=(4.0, 6.0), prefill_tokens_ahead=9)
    assert with_flow_round(item, 7.0) == replace(item, flow_round=7.0)


def test_the_rounds_forget_a_band_once_it_is_empty() -> None:
    rounds = FlowRounds()
    items = [req(i, tenant=f"t{i % 3}", band=i % 2, ttft=1.0 + i) for i in range(12)]
    stamped = {}
    for item in items:
        got, moved = rounds.admit(item)
        stamped[got.view.request_id] = got
        for rid, flow_round in moved:
            stamped[rid] = with_flow_round(stamped[rid], flow_round)
    assert len(rounds) == 12
    for item in items:
        rounds.leave(stamped[item.view.request_id])
    assert len(rounds) == 0 and rounds._bands == {}
    rounds.leave(items[0])  # unknown: ignored


# -- flow control: properties -----------------------------------------------------------------------


@dataclass(frozen=True)
class Push:
    tenant: int
    band: int
    ttft_ms: int
    timeout_ms: int | None


@dataclass(frozen=True)
class Pop:
    pass


@dataclass(frozen=True)
class Remove:
    index: int


@dataclass(frozen=True)
class Tick:
    ms: int


OPS = st.lists(
    st.one_of(
        st.builds(
            Push,
            tenant=st.integers(0, 3),
            band=st.integers(0, 2),
            ttft_ms=st.integers(1, 5000),
            timeout_ms=st.none() | st.integers(0, 4000),
        ),
        st.just(Pop()),
        st.builds(Remove, index=st.integers(0, 100)),
        st.builds(Tick, ms=st.integers(0, 1000)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_every_pop_is_the_two_level_schedulers_choice(ops: list[Push | Pop | Remove | Tick]) -> None:
    """Any interleaving of arrivals, dispatches, cancellations and expiry: the request popped is
    in the most urgent band queued and is its tenant's earliest deadline there (EDF within a
    tenant), the queue's order is its keys' order, and the rounds track exactly what is queued."""
    queue = AdmissionQueue(make_order("flow_control"))
    order = queue.order
    now_ms, seq = 0, 0
    for op in ops:
        now = now_ms / 1000
        if isinstance(op, Push):
            seq += 1
            deadline = math.inf if op.timeout_ms is None else now + op.timeout_ms / 1000
            item = req(
                seq,
                tenant=f"t{op.tenant}",
                band=op.band,
                arrival=now,
                ttft=op.ttft_ms / 1000,
                deadline=deadline,
            )
            queue.push(item, now, CTX)
        elif isinstance(op, Pop):
            queued = queue.items()
            got = queue.pop(now, CTX)
            if not queued:
                assert got is None
                continue
            assert got is not None
            top = min(i.view.priority for i in queued)
            assert got.view.priority == top
            mine = [i for i in queued if i.view.priority == top and i.view.tenant == got.view.tenant]
            assert (got.ttft_deadline, got.seq) == min((i.ttft_deadline, i.seq) for i in mine)
        elif isinstance(op, Remove):
            queued = sorted(queue.items(), key=lambda i: i.seq)
            if queued:
                assert queue.remove(queued[op.index % len(queued)].view.request_id) is not None
        else:
            now_ms += op.ms
            queue.expire(now_ms / 1000)
        now = now_ms / 1000
        walked = [i.seq for i in queue.iter_in_order(now, CTX, 1000)]
        assert walked == [i.seq for i in sorted(queue.items(), key=lambda i: order.key(i, now, CTX)[0])]
        assert queue._flows is not None and len(queue._flows) == len(queue)
        # one head per (band, tenant) queued, the rest parked
        heads = Counter((i.view.priority, i.view.tenant) for i in queue.items() if i.flow_round != PARKED)
        assert set(heads.values()) <= {1}
        assert set(heads) == {(i.view.priority, i.view.tenant) for i in queue.items()}
    drain(queue, now_ms / 1000)
    assert queue._flows is not None and len(queue._flows) == 0 and queue._flows._bands == {}


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["push", "pop"]), st.integers(0, 4), st.integers(1, 9000)), max_size=150
    )
)
def test_no_tenant_is_served_more_than_twice_between_two_turns_of_a_backlogged_one(
    ops: list[tuple[str, int, int]],
) -> None:
    """Start-time fair queueing, one request per round: while a tenant has requests queued (from
    the arrival that starts its backlog, then between two of its dispatches), no other tenant of
    the band is served more than twice, however deep its backlog or however often it stops and
    starts sending again."""
    queue = AdmissionQueue(make_order("flow_control"))
    since: dict[str, Counter[str]] = {}  # backlogged tenant -> others served since its last turn
    seq = 0
    for op, tenant_no, ttft_ms in ops:
        if op == "push":
            seq += 1
            tenant = f"t{tenant_no}"
            since.setdefault(tenant, Counter())
            queue.push(req(seq, tenant=tenant, arrival=seq / 1000, ttft=ttft_ms / 1000), seq / 1000, CTX)
            continue
        got = queue.pop(seq / 1000, CTX)
        if got is None:
            continue
        tenant = got.view.tenant
        since[tenant] = Counter()
        if not any(i.view.tenant == tenant for i in queue.items()):
            del since[tenant]  # no longer backlogged
        for other, served in since.items():
            if other != tenant:
                served[tenant] += 1
                assert served[tenant] <= 2, (other, tenant)


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_a_drain_serves_every_backlogged_tenant_in_turn(counts: list[int], seed: int) -> None:
    """Everything queued at once: while two tenants both have requests left, their dispatch
    counts never differ by more than one; each tenant's own requests leave by deadline."""
    rng = random.Random(seed)
    queue = AdmissionQueue(make_order("flow_control"))
    seq = 0
    for tenant, count in enumerate(counts):
        for _ in range(count):
            seq += 1
            queue.push(req(seq, tenant=f"t{tenant}", ttft=rng.uniform(0.1, 30.0)), 0.0, CTX)
    served = drain(queue)
    left = Counter(i.view.tenant for i in served)
    done: Counter[str] = Counter()
    last_deadline: dict[str, float] = {}
    for item in served:
        tenant = item.view.tenant
        done[tenant] += 1
        left[tenant] -= 1
        assert item.ttft_deadline >= last_deadline.get(tenant, -math.inf)
        last_deadline[tenant] = item.ttft_deadline
        backlogged = [t for t in left if left[t] > 0 or t == tenant]
        assert max(done[t] for t in backlogged) - min(done[t] for t in backlogged) <= 1


# -- WSPT ---------------------------------------------------------------------------------------------


def wspt_rank(items: list[QueuedRequest], order: Any, ctx: OrderContext = CTX) -> list[int]:
    return [i.seq for i in sorted(items, key=lambda i: order.key(i, 0.0, ctx)[0])]


def test_wspt_ranks_by_weight_over_predicted_service_time() -> None:
    order = make_order("wspt")
    # service: prompt/1000 + output * 0.02 s; weight 2**-priority / ttft
    items = [
        req(0, prompt=2000, output=10, ttft=1.0),  # 2.2 s / 1     -> 2.2
        req(1, prompt=100, output=10, ttft=1.0),  # 0.3 s / 1      -> 0.3
        req(2, prompt=100, output=10, ttft=20.0),  # 0.3 s x 20    -> 6.0
        req(3, prompt=100, output=10, ttft=1.0, band=2),  # 0.3 x 4 -> 1.2
        req(4, prompt=100, output=100, ttft=1.0),  # 2.1 s          -> 2.1
    ]
    assert wspt_rank(items, order) == [1, 3, 4, 0, 2]
    # prefill only (Dynamo's token cost) and no SLO urgency: the long output no longer counts
    plain = make_order("wspt", {"decode_share": 0.0, "urgency": False})
    assert wspt_rank(items, plain) == [1, 2, 4, 3, 0]
    # strict tiers: priority first, WSPT within
    tiers = make_order("wspt", {"strict_priority": True})
    assert wspt_rank(items, tiers) == [1, 4, 0, 2, 3]


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 8000), st.integers(0, 2000), st.integers(-3, 6), st.floats(0.05, 60.0)),
        min_size=1,
        max_size=30,
    ),
    factor=st.floats(1.0, 10.0),
)
def test_wspt_is_smiths_rule(specs: list[tuple[int, int, int, float]], factor: float) -> None:
    """The key's order is descending weight / service (ties by arrival), for any lengths,
    priorities and targets; it never changes by itself."""
    order = Wspt(priority_factor=factor)
    items = [
        req(i, prompt=p, output=o, band=b, ttft=t, arrival=0.001 * i) for i, (p, o, b, t) in enumerate(specs)
    ]

    def ratio(item: QueuedRequest) -> float:
        service = CTX.predicted_prefill_s(item.view.prompt_tokens) + item.view.max_output_tokens * 0.02
        return factor ** (-item.view.priority) / item.ttft_slo / max(service, 1e-12)

    ranked = sorted(items, key=lambda i: order.key(i, 0.0, CTX)[0])
    for a, b in itertools.pairwise(ranked):
        assert ratio(a) >= ratio(b) * (1 - 1e-9)
    for item in items:
        key, valid_until = order.key(item, 0.0, CTX)
        assert valid_until == math.inf and key[-1] == item.seq and order.key(item, 1e6, CTX)[0] == key


def test_wspt_follows_the_context() -> None:
    order = make_order("wspt", {"urgency": False})
    long_prompt = req(0, prompt=4000, output=1)  # prefill-heavy
    long_output = req(1, prompt=10, output=100)  # decode-heavy
    fast_prefill = OrderContext(prefill_tokens_per_s=100_000.0, decode_step_s=0.02)
    slow_prefill = OrderContext(prefill_tokens_per_s=500.0, decode_step_s=0.02)
    assert wspt_rank([long_prompt, long_output], order, fast_prefill) == [0, 1]
    assert wspt_rank([long_prompt, long_output], order, slow_prefill) == [1, 0]
    assert order.context_sensitive and not FlowControl().context_sensitive


@pytest.mark.parametrize(
    ("name", "params", "fragment"),
    [
        ("wspt", {"priority_factor": 0.5}, "priority_factor must be"),
        ("wspt", {"decode_share": -1}, "decode_share must be"),
        ("wspt", {"urgency": "yes"}, "urgency must be"),
        ("wspt", {"strict_priority": 1}, "strict_priority must be"),
        ("wspt", {"weight": 1}, "it accepts: priority_factor=2.0"),
        ("flow_control", {"max_reorder": 3}, "has no parameter 'max_reorder'"),
    ],
)
def test_bad_parameters_name_the_order(name: str, params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolicyConfigError, match=fragment):
        make_order(name, params)


# -- saturation shedding ------------------------------------------------------------------------------


def engines(*loads: int) -> tuple[EngineSnapshot, ...]:
    return tuple(EngineSnapshot(f"e{i}", "m", in_flight=load) for i, load in enumerate(loads))


@pytest.mark.parametrize(
    ("loads", "cap", "queued", "tokens", "expected"),
    [
        # 2 engines x 1000 tokens/s: 4000 queued tokens are 2 s of prefill
        ((4, 4), 4, 10, 4000, False),  # exactly at the limit: not beyond it
        ((4, 4), 4, 10, 4002, True),
        ((4, 3), 4, 10, 8000, False),  # an engine has room: the queue will drain into it
        ((5, 9), 4, 10, 8000, True),  # above the cap counts as full
        ((0, 0), None, 10, 8000, True),  # no cap: the queue alone decides
        ((), 4, 1, 1, True),  # no engine: infinite backlog
    ],
)
def test_saturated(loads: tuple[int, ...], cap: int | None, queued: int, tokens: int, expected: bool) -> None:
    pool = PoolLoad(engines(*loads), cap, queued, tokens)
    assert saturated(pool, CTX, SheddingParams(max_queue_s=2.0)) is expected


def test_queued_prefill_counts_the_fixed_cost_of_each_request() -> None:
    ctx = OrderContext(prefill_tokens_per_s=1000.0, decode_step_s=0.02, prefill_base_s=0.05)
    assert queued_prefill_s(PoolLoad(engines(1, 1), 1, 10, 3000), ctx) == pytest.approx((0.5 + 3.0) / 2)
    assert queued_prefill_s(PoolLoad((), 1, 0, 0), ctx) == math.inf


@pytest.mark.parametrize(
    ("newcomer", "least_urgent", "min_band", "expected"),
    [
        (("new", 0, 9), None, None, "new"),  # nothing queued: the arrival itself
        (("new", 0, 9), ("old", 0, 5), None, "new"),  # same band: the newest is the arrival
        (("new", 2, 9), ("old", 1, 5), None, "new"),  # the arrival is the least urgent
        (("new", 0, 9), ("old", 3, 5), None, "old"),  # a less urgent band queued goes first
        (("new", 0, 9), ("old", 3, 5), 4, None),  # protected: bands below 4 are never shed
        (("new", 0, 9), ("old", 3, 5), 3, "old"),
        (("new", -1, 9), None, 0, None),
    ],
)
def test_shed_victim_is_the_least_urgent_bands_newest(
    newcomer: tuple[str, int, int],
    least_urgent: tuple[str, int, int] | None,
    min_band: int | None,
    expected: str | None,
) -> None:
    victim = shed_victim(
        SheddingParams(min_band=min_band),
        ShedCandidate(*newcomer),
        None if least_urgent is None else ShedCandidate(*least_urgent),
    )
    assert (None if victim is None else victim.request_id) == expected


@pytest.mark.parametrize(
    "kwargs", [{"max_queue_s": -1}, {"max_queue_s": math.inf}, {"max_queue_s": True}, {"min_band": 1.5}]
)
def test_shedding_params_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SheddingParams(**kwargs)
