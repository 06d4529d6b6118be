"""Table-driven tests of every queue order on literal QueuedRequests."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from policies.admission_queue import AdmissionQueue
from policies.api import PolicyConfigError, RequestView
from policies.queue_order import (
    ORDERS,
    KairosUrgency,
    OrderContext,
    QueuedRequest,
    QueueOrder,
    RobustEffectiveDeadline,
    make_order,
    marginal_service_s,
    predicted_service_s,
    robust_effective_deadline,
    ttft_infeasible,
    with_batch,
    with_demotion,
    with_prefill_backlog,
)

CTX = OrderContext(prefill_tokens_per_s=1000.0, decode_step_s=0.02)  # 1000 tokens = 1 s of prefill


def req(
    seq: int,
    *,
    arrival: float = 0.0,
    prompt: int = 100,
    priority: int = 0,
    ttft: float = 10.0,
    backlog: int | None = None,
    batch: tuple[float, ...] = (),
) -> QueuedRequest:
    return QueuedRequest(
        view=RequestView(
            request_id=f"r{seq}",
            model="m",
            prompt_tokens=prompt,
            max_output_tokens=16,
            arrival=arrival,
            priority=priority,
        ),
        ttft_slo=ttft,
        tpot_slo=0.05,
        seq=seq,
        batch_deadlines=batch,
        prefill_tokens_ahead=backlog,
    )


def order_at(order: QueueOrder, items: list[QueuedRequest], now: float, ctx: OrderContext = CTX) -> list[int]:
    """Sequence numbers in dispatch order at ``now``."""
    return [i.seq for i in sorted(items, key=lambda i: order.key(i, now, ctx)[0])]


# (order, params, items, now, expected seq order)
CASES: list[tuple[str, dict[str, Any], list[QueuedRequest], float, list[int]]] = [
    # FCFS: arrival, ties (equal arrival) by seq whatever the insertion order
    ("fcfs", {}, [req(2, arrival=1.0), req(1, arrival=2.0), req(0, arrival=1.0)], 5.0, [0, 2, 1]),
    ("fcfs", {}, [req(0, prompt=5000), req(1, prompt=1)], 0.0, [0, 1]),
    # strict priority: lower value first, then arrival, then seq
    (
        "strict_priority",
        {},
        [req(0, arrival=0.0, priority=2), req(1, arrival=1.0, priority=0), req(2, arrival=0.5, priority=0)],
        3.0,
        [2, 1, 0],
    ),
    (
        "slo_tpot",
        {},
        [replace(req(0), tpot_slo=0.9), replace(req(1, arrival=1.0), tpot_slo=0.5)],
        2.0,
        [1, 0],
    ),
    (
        "slo_tpot",
        {},
        [replace(req(1, arrival=1.0), tpot_slo=0.5), replace(req(0), tpot_slo=0.5)],
        2.0,
        [0, 1],
    ),
    # a lower level never overtakes a higher one, whatever targets the mapping gave them
    (
        "slo_tpot",
        {},
        [replace(req(0, priority=3), tpot_slo=0.3), replace(req(1, arrival=5.0), tpot_slo=0.5)],
        6.0,
        [1, 0],
    ),
    ("strict_priority", {}, [req(1, priority=-1), req(0, priority=1)], 0.0, [1, 0]),
    ("strict_priority", {}, [req(3, priority=1), req(2, priority=1)], 0.0, [2, 3]),
    # SJF with aging (Gimbal Algorithm 2): before theta_age the shortest prompt wins ...
    ("sjf_aging", {}, [req(0, arrival=0.0, prompt=3000), req(1, arrival=1.0, prompt=10)], 4.99, [1, 0]),
    # ... at exactly theta_age (w >= theta) the long one is promoted above every young request
    ("sjf_aging", {}, [req(0, arrival=0.0, prompt=3000), req(1, arrival=1.0, prompt=10)], 5.0, [0, 1]),
    # aged requests keep arrival order among themselves regardless of size
    (
        "sjf_aging",
        {},
        [req(0, arrival=1.0, prompt=10), req(1, arrival=0.0, prompt=3000), req(2, arrival=9.0, prompt=1)],
        9.5,
        [1, 0, 2],
    ),
    # equal prompts while young: arrival, then seq
    ("sjf_aging", {}, [req(1, arrival=0.0), req(0, arrival=0.0), req(2, arrival=-1.0)], 0.0, [2, 0, 1]),
    ("sjf_aging", {"theta_age_s": 0.5}, [req(0, prompt=900), req(1, arrival=0.2, prompt=1)], 0.5, [0, 1]),
    (
        "sjf_aging",
        {"theta_age_s": 0},
        [req(0, arrival=0.0, prompt=900), req(1, arrival=0.0, prompt=1)],
        0.0,
        [0, 1],
    ),
    # S-EDF: feasible requests by earliest deadline
    ("sedf", {}, [req(0, ttft=5.0), req(1, ttft=3.0), req(2, arrival=1.0, ttft=1.5)], 0.0, [2, 1, 0]),
    # request 1's deadline is 2.0 but its prefill takes 1 s: infeasible after t = 1.0, so it goes last
    ("sedf", {}, [req(0, ttft=5.0), req(1, ttft=2.0, prompt=1000)], 1.0, [1, 0]),
    ("sedf", {}, [req(0, ttft=5.0), req(1, ttft=2.0, prompt=1000)], 1.01, [0, 1]),
    # among infeasible requests eq. 3 (-1/deadline) ranks the latest deadline first
    (
        "sedf",
        {},
        [req(0, ttft=1.0, prompt=900), req(1, ttft=2.0, prompt=1900), req(2, ttft=9.0)],
        1.5,
        [2, 1, 0],
    ),
    # equal deadlines: seq
    ("sedf", {}, [req(1, ttft=2.0), req(0, ttft=2.0)], 0.0, [0, 1]),
    # Kairos: at equal slack fraction the shorter request's urgency is amplified by 1/len
    ("kairos", {}, [req(0, prompt=2000, ttft=10.0), req(1, prompt=100, ttft=10.0)], 0.0, [1, 0]),
    # Kairos §3.1 example: a long request that arrived first keeps positive slack under FCFS, short
    # requests queued behind a large backlog are predicted late, so the long one goes first
    (
        "kairos",
        {},
        [req(0, prompt=3000, ttft=5.0, backlog=0), req(1, arrival=0.1, prompt=100, ttft=1.0, backlog=3000)],
        0.1,
        [0, 1],
    ),
    # ... while with no backlog ahead the short one wins
    (
        "kairos",
        {},
        [req(0, prompt=3000, ttft=5.0, backlog=0), req(1, arrival=0.1, prompt=100, ttft=1.0, backlog=0)],
        0.1,
        [1, 0],
    ),
    # late requests (negative slack) come after every feasible one
    ("kairos", {}, [req(0, prompt=100, ttft=0.05), req(1, prompt=5000, ttft=60.0)], 0.0, [1, 0]),
    # RED: a request in no batch is a batch of one, i.e. EDF on its TTFT deadline
    ("red", {}, [req(0, ttft=5.0), req(1, ttft=3.0)], 0.0, [1, 0]),
    # a batch whose one tight outlier (deadline 1) sits with three loose members (deadline 10) has
    # RED 0.25 * 1 + 0.75 * 10 = 7.75, so a lone request with deadline 5 goes first (no Piggyback);
    # EDF would serve the outlier first
    (
        "red",
        {},
        [
            *with_batch([req(0, ttft=1.0), req(1, ttft=10.0), req(2, ttft=10.0), req(3, ttft=10.0)]),
            req(4, ttft=5.0),
        ],
        0.0,
        [4, 0, 1, 2, 3],
    ),
    # a mostly tight batch (deadlines 1, 1, 1 and 10) has RED 0.75 * 1 + 0.25 * 10 = 3.25: its loose
    # member rides with it ahead of a lone request due at 5; EDF would put that member last
    (
        "red",
        {},
        [
            req(4, ttft=5.0),
            *with_batch([req(0, ttft=1.0), req(1, ttft=1.0), req(2, ttft=1.0), req(3, ttft=10.0)]),
        ],
        0.0,
        [0, 1, 2, 3, 4],
    ),
    # the order reads the deadlines each item carries, however they were stamped
    ("red", {}, [req(0, ttft=4.0, batch=(4.0, 9.0)), req(1, ttft=6.0)], 0.0, [1, 0]),
    # Scavenger: a request that can no longer meet its deadline is demoted behind feasible ones
    ("red", {}, [req(0, ttft=1.5, prompt=1000), req(1, ttft=9.0)], 0.6, [1, 0]),
    ("red", {"scavenger": False}, [req(0, ttft=1.5, prompt=1000), req(1, ttft=9.0)], 0.6, [0, 1]),
]


@pytest.mark.parametrize(("name", "params", "items", "now", "expected"), CASES)
def test_order_table(
    name: str, params: dict[str, Any], items: list[QueuedRequest], now: float, expected: list[int]
) -> None:
    assert order_at(make_order(name, params), items, now) == expected


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_every_key_ends_with_seq_and_is_valid_now(name: str) -> None:
    order = make_order(name)
    assert order.name == name
    items = [
        req(i, arrival=0.1 * i, prompt=50 * (i + 1), ttft=0.5 + i % 3, backlog=100 * i) for i in range(12)
    ]
    for now in (0.0, 0.3, 1.0, 2.5, 7.0, 100.0):
        for item in items:
            key, valid_until = order.key(item, now, CTX)
            assert key[-1] == item.seq
            assert valid_until > now
            assert all(isinstance(x, float | int) for x in key)


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_keys_are_piecewise_constant(name: str) -> None:
    """Recomputing anywhere in [t, valid_until) gives the same key (the lazy re-keying relies on it)."""
    order = make_order(name)
    items = [req(i, arrival=0.2 * i, prompt=300 * i + 1, ttft=1.0 + i % 4, backlog=200 * i) for i in range(8)]
    items += with_batch([req(8 + i, arrival=0.1 * i, prompt=500 * i + 1, ttft=0.5 + 3 * i) for i in range(4)])
    for item in items:
        now = 0.0
        changes = 0
        while now < 40.0:
            key, valid_until = order.key(item, now, CTX)
            end = min(valid_until, 40.0)
            for frac in (0.25, 0.5, 0.999):
                assert order.key(item, now + (end - now) * frac, CTX)[0] == key
            if valid_until == math.inf:
                break
            assert order.key(item, valid_until, CTX)[0] != key or name == "kairos"
            now = valid_until
            changes += 1
        # aging, S-EDF and RED change key at most once; Kairos once per geometric step of slack
        # (down to min_step_s) plus once per step of lateness, plus the end of the static phase
        geometric = math.ceil(math.log(40.0 / 0.01) / math.log(1.25))
        assert changes <= (1 if name != "kairos" else 2 * geometric + 3)


def test_empty_and_single_item_orders() -> None:
    for name in ORDERS:
        order = make_order(name)
        assert order_at(order, [], 0.0) == []
        assert order_at(order, [req(7)], 3.0) == [7]


def test_sjf_aging_valid_until_is_promotion_time() -> None:
    order = make_order("sjf_aging", {"theta_age_s": 2.0})
    key, valid_until = order.key(req(0, arrival=1.0, prompt=10), 1.5, CTX)
    assert valid_until == 3.0 and key[0] == 1.0
    key, valid_until = order.key(req(0, arrival=1.0, prompt=10), 3.0, CTX)
    assert valid_until == math.inf and key[0] == 0.0


def test_sedf_flip_and_throughput_dependence() -> None:
    order = make_order("sedf")
    item = req(0, ttft=2.0, prompt=1000)  # deadline 2.0, prefill 1 s: slack 0 at t = 1.0
    key, valid_until = order.key(item, 0.0, CTX)
    assert key[0] == 0.0 and 1.0 < valid_until < 1.0 + 1e-9
    assert order.key(item, 1.0, CTX)[0][0] == 0.0  # slack exactly 0 is still feasible
    assert order.key(item, valid_until, CTX)[0][0] == 1.0
    slow = OrderContext(prefill_tokens_per_s=100.0, decode_step_s=0.02)  # 10 s of prefill: hopeless
    assert order.key(item, 0.0, slow)[0][0] == 1.0


def test_kairos_static_phase_until_fcfs_start() -> None:
    order = make_order("kairos")
    ctx = OrderContext(prefill_tokens_per_s=1000.0, decode_step_s=0.02, prefill_engines=2)
    item = req(0, arrival=1.0, prompt=500, ttft=5.0, backlog=4000)  # FCFS start 1 + 4000/2000 = 3.0
    key, valid_until = order.key(item, 1.0, ctx)
    assert valid_until == 3.0
    slack = (1.0 + 5.0 - 0.5) - 3.0  # latest start 5.5 minus FCFS start
    assert key == (0.0, -slack / (5.0 * 500), 1.0, 0)
    assert order.key(item, 2.9, ctx)[0] == key


def test_kairos_moving_phase_precision() -> None:
    """Past the FCFS start the key is within a factor (1 + rel_precision) of the exact urgency."""
    order = KairosUrgency(rel_precision=0.1, min_step_s=0.001)
    item = req(0, prompt=1000, ttft=3.0)  # latest start 2.0
    weight = 3.0 * 1000
    for now in (0.0, 0.5, 1.0, 1.9, 1.999, 2.0, 2.5, 10.0):
        key, valid_until = order.key(item, now, CTX)
        slack = 2.0 - now
        if slack > 0:
            assert key[0] == 0.0
            approx = -key[1] * weight
            assert slack <= approx <= max(slack * 1.1, 0.001) + 1e-12
        else:
            assert key[0] == 1.0
            approx = key[1] * weight
            assert approx <= -slack and (-slack < 0.001 or approx >= -slack / 1.1 - 1e-12)
        assert valid_until > now


def test_robust_effective_deadline() -> None:
    assert robust_effective_deadline([4.0]) == 4.0
    assert robust_effective_deadline([10.0, 1.0, 10.0, 10.0]) == pytest.approx(0.25 * 1.0 + 0.75 * 10.0)
    assert robust_effective_deadline([1.0, 2.0]) == pytest.approx(1.5)
    assert robust_effective_deadline([3.0, 3.0, 3.0]) == pytest.approx(3.0)
    # the split is at the largest gap: {1, 1.5} tight, {9, 9.2} loose, f = 1/2
    assert robust_effective_deadline([1.0, 1.5, 9.0, 9.2]) == pytest.approx(0.5 * 1.0 + 0.5 * 9.0)
    with pytest.raises(ValueError):
        robust_effective_deadline([])


def test_with_batch_stamps_every_member_with_the_whole_batch() -> None:
    assert with_batch([]) == []
    stamped = with_batch([req(0, ttft=1.0), req(1, arrival=0.5, ttft=2.0)])
    assert [i.batch_deadlines for i in stamped] == [(1.0, 2.5)] * 2
    assert [i.effective_deadline for i in stamped] == [pytest.approx(0.5 * 1.0 + 0.5 * 2.5)] * 2
    assert [i.seq for i in stamped] == [0, 1]
    # no batch: the request's own deadline
    assert req(2, arrival=1.0, ttft=3.0).effective_deadline == 4.0


def test_the_stamping_copies_match_replace() -> None:
    item = replace(req(3, arrival=2.0, batch=(4.0, 6.0)), queue_deadline=9.0, flow_round=2.0, demoted=True)
    assert with_prefill_backlog(item, 77) == replace(item, prefill_tokens_ahead=77)
    assert with_demotion(item, False) == replace(item, demoted=False)
    assert with_demotion(with_prefill_backlog(item, 5), True) == replace(item, prefill_tokens_ahead=5)


def edf(items: list[QueuedRequest]) -> list[int]:
    return [i.seq for i in sorted(items, key=lambda i: (i.ttft_deadline, i.seq))]


def test_red_is_edf_for_requests_in_no_batch() -> None:
    """Without batch deadlines RED has nothing to add: the same order as EDF (scavenger off)."""
    items = [req(i, arrival=0.37 * i % 2.0, ttft=0.5 + (7 * i) % 5) for i in range(20)]
    assert order_at(make_order("red", {"scavenger": False}), items, 0.0) == edf(items)


def test_red_key_ranks_by_the_batch_not_the_member() -> None:
    # a tight outlier (deadline 1) in a batch of four loose members (deadline 10): f = 1/5
    members = with_batch([req(0, ttft=1.0), *(req(i, ttft=10.0) for i in range(1, 5))])
    order = RobustEffectiveDeadline(scavenger=False)
    red = 0.2 * 1.0 + 0.8 * 10.0
    keys = [order.key(m, 0.0, CTX)[0] for m in members]
    assert [k[1] for k in keys] == pytest.approx([red] * len(members))  # one RED for the batch
    assert [(k[0], k[2], k[3]) for k in keys] == [(0.0, m.ttft_deadline, m.seq) for m in members]
    lone = [req(5, ttft=4.0), req(6, ttft=9.0)]
    # EDF: the outlier, then the lone requests, then the loose members
    assert edf([*members, *lone]) == [0, 5, 6, 1, 2, 3, 4]
    # RED 8.2: both lone requests go first; the batch stays together, tightest member first
    assert order_at(order, [*members, *lone], 0.0) == [5, 0, 1, 2, 3, 4, 6]


def test_red_demotes_an_infeasible_member_but_not_its_batch() -> None:
    # member 0 (deadline 1.5, 1 s of prefill) cannot start after t = 0.5; its peers can
    members = with_batch([req(0, ttft=1.5, prompt=1000), req(1, ttft=2.0), req(2, ttft=2.0)])
    lone = req(3, ttft=9.0)
    order = make_order("red")
    assert order_at(order, [*members, lone], 0.4) == [0, 1, 2, 3]
    assert order_at(order, [*members, lone], 0.6) == [1, 2, 3, 0]


def test_a_member_joining_re_queues_its_batch() -> None:
    """The protocol the gateway follows: restamp the queued members and the newcomer, re-queue."""
    queue = AdmissionQueue(make_order("red"))
    first = with_batch([req(0, ttft=1.0)])[0]
    lone = req(1, ttft=3.0)
    queue.push(first, 0.0, CTX)
    queue.push(lone, 0.0, CTX)
    assert queue.peek(0.0, CTX) == first  # a batch of one so far: deadline 1 beats 3
    # three loose members join: RED becomes 0.25 * 1 + 0.75 * 8 = 6.25, behind the lone request
    joined = with_batch([first, req(2, ttft=8.0), req(3, ttft=8.0), req(4, ttft=8.0)])
    queue.remove(first.view.request_id)
    for item in joined:
        queue.push(item, 0.0, CTX)
    popped = [queue.pop(0.0, CTX) for _ in range(len(queue))]
    assert [i.seq for i in popped if i is not None] == [1, 0, 2, 3, 4]


@pytest.mark.parametrize(
    ("name", "params", "fragment"),
    [
        (
            "lifo",
            None,
            "known queue orders: fcfs, flow_control, kairos, red, sedf, sjf_aging, slo_tpot, strict_priority, wspt",
        ),
        ("sjf_aging", {"theta": 5}, "'sjf_aging' has no parameter 'theta'; it accepts: theta_age_s=5.0"),
        ("sjf_aging", {"theta_age_s": -1}, "theta_age_s must be"),
        ("sjf_aging", {"theta_age_s": "5"}, "theta_age_s must be"),
        ("sjf_aging", {"theta_age_s": True}, "theta_age_s must be"),
        ("sjf_aging", {"theta_age_s": math.nan}, "theta_age_s must be"),
        ("fcfs", {"x": 1}, "it accepts: no parameters"),
        ("kairos", {"rel_precision": 0}, "rel_precision must be"),
        ("kairos", {"min_step_s": -0.1}, "it accepts: rel_precision=0.25, min_step_s=0.01"),
        ("red", {"scavenger": "yes"}, "scavenger must be true or false"),
        ("strict_priority", {"aging_s": 0}, "aging_s must be"),
        ("strict_priority", {"aging_s": 1e-310}, "aging_s must be"),
        ("strict_priority", {"aging_s": True}, "aging_s must be"),
        ("slo_tpot", {"aging_s": math.inf}, "aging_s must be"),
        ("slo_tpot", {"aging_s": "10"}, "aging_s must be"),
    ],
)
def test_make_order_errors(name: str, params: dict[str, Any] | None, fragment: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        make_order(name, params)
    assert fragment in str(info.value)
    assert repr(name) in str(info.value)


def test_make_order_accepts_params() -> None:
    order = make_order("sjf_aging", {"theta_age_s": 2})
    assert order.key(req(0, prompt=9), 2.0, CTX)[0][0] == 0.0
    kairos = make_order("kairos", {"rel_precision": 0.5, "min_step_s": 0.05})
    assert isinstance(kairos, KairosUrgency) and kairos.rel_precision == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_tokens_per_s": 0.0, "decode_step_s": 0.01},
        {"prefill_tokens_per_s": math.inf, "decode_step_s": 0.01},
        {"prefill_tokens_per_s": 1.0, "decode_step_s": -0.01},
        {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.01, "prefill_base_s": -1.0},
        {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.01, "prefill_engines": 0},
        {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.01, "decode_seq_s": -1e-4},
        {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.01, "decode_context_s": math.nan},
    ],
)
def test_order_context_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        OrderContext(**kwargs)


def test_ttft_deadline_and_prediction() -> None:
    assert req(0, arrival=2.0, ttft=1.5).ttft_deadline == 3.5
    ctx = OrderContext(prefill_tokens_per_s=2000.0, decode_step_s=0.0, prefill_base_s=0.1)
    assert ctx.predicted_prefill_s(1000) == pytest.approx(0.6)


@pytest.mark.parametrize(
    ("now", "prompt", "infeasible"),
    [
        (0.0, 100, False),  # 0.1 s of prefill, 10 s of budget
        (9.9, 100, False),  # dispatched now it finishes exactly at the deadline
        (9.91, 100, True),  # its deadline has not passed, but its prefill cannot fit any more
        (2.0, 9000, True),  # 9 s of prefill from t=2 ends after the 10 s deadline
        (0.5, 9000, False),
    ],
)
def test_ttft_infeasible_counts_the_predicted_prefill(now: float, prompt: int, infeasible: bool) -> None:
    assert ttft_infeasible(req(1, prompt=prompt, ttft=10.0), now, CTX) is infeasible


def test_a_requests_engine_time_is_its_prefill_and_its_share_of_the_steps_it_decodes_in() -> None:
    """eq.(2)'s fixed step cost is the batch's, not the request's: a long answer adds c' + b' *
    context per token, a long prompt its whole prefill."""
    ctx = OrderContext(
        prefill_tokens_per_s=10_000.0,
        decode_step_s=0.012,
        prefill_base_s=0.025,
        decode_seq_s=1e-4,
        decode_context_s=4e-8,
    )
    long_prompt = RequestView("p", "m", prompt_tokens=2000, max_output_tokens=20)
    long_answer = RequestView("a", "m", prompt_tokens=50, max_output_tokens=200)
    assert marginal_service_s(long_prompt, ctx) == pytest.approx(0.225 + 20 * (1e-4 + 4e-8 * 2010))
    assert marginal_service_s(long_answer, ctx) == pytest.approx(0.03 + 200 * (1e-4 + 4e-8 * 150))
    assert marginal_service_s(long_prompt, ctx) > marginal_service_s(long_answer, ctx)
    # a whole step per output token says the opposite
    assert predicted_service_s(long_prompt, ctx) < predicted_service_s(long_answer, ctx)


@pytest.mark.parametrize("name", ["strict_priority", "slo_tpot"])
def test_aging_raises_a_waiting_request_one_level_per_period_down_to_level_0(name: str) -> None:
    """Strict levels starve the lower ones while the higher keep coming: with ``aging_s`` a
    request waits at one level more urgent per period, re-keyed exactly when it rises, never
    past level 0 (a negative level stays)."""
    order = make_order(name, {"aging_s": 10.0})
    low = req(1, arrival=100.0, priority=3)
    steps = [
        (100.0, 3.0, 110.0),
        (109.999, 3.0, 110.0),
        (110.0, 2.0, 120.0),
        (125.0, 1.0, 130.0),
        (130.0, 0.0, math.inf),
        (1000.0, 0.0, math.inf),
    ]
    for now, level, until in steps:
        key, valid_until = order.key(low, now, CTX)
        assert (key[0], valid_until) == (level, until), now
    # a level far above what a wait undoes; and past its level's time no division at all (with
    # a period too short for the profile check, the wait / period overflowed floor())
    assert order.key(req(4, arrival=0.0, priority=10**9), 3600.0, CTX)[0][0] == 10**9 - 360
    from policies.queue_order import _aged_level

    assert _aged_level(3, 0.0, 1.0, 1e-310) == (0.0, math.inf)
    for priority in (0, -2):
        key, valid_until = order.key(req(2, arrival=0.0, priority=priority), 500.0, CTX)
        assert (key[0], valid_until) == (float(priority), math.inf)
    # off (the default): strict, static
    assert make_order(name).key(low, 1000.0, CTX) == (make_order(name).key(low, 100.0, CTX)[0], math.inf)
    # aged to level 0, the older request goes before the level-0 ones that came after it
    fresh = req(3, arrival=140.0, priority=0)
    assert order_at(order, [fresh, low], 140.0) == [1, 3]
    assert order_at(make_order(name), [fresh, low], 140.0) == [3, 1]


def test_an_aging_request_overtakes_newer_higher_levels_in_the_admission_queue() -> None:
    """The queue re-keys a request at the moment it rises (the order says when): at 2.5 periods a
    level-2 request is at level 0 and first, ahead of the level-0 arrivals that came after it,
    and behind those that came before it."""
    queue = AdmissionQueue(make_order("strict_priority", {"aging_s": 1.0}))
    queue.push(req(0, arrival=0.0, priority=0), 0.0, CTX)
    queue.push(req(1, arrival=0.1, priority=2), 0.1, CTX)
    for seq in range(2, 8):
        queue.push(req(seq, arrival=0.2 * seq, priority=0), 0.2 * seq, CTX)
    assert [i.seq for i in queue.head(0.9, CTX, 10)] == [0, 2, 3, 4, 5, 6, 7, 1]
    assert [i.seq for i in queue.head(1.5, CTX, 10)] == [0, 2, 3, 4, 5, 6, 7, 1]  # (level 1)
    assert [i.seq for i in queue.head(2.1, CTX, 10)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [queue.pop(2.2, CTX).seq for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
