"""HyperFlexis dispatcher (Algorithm 1) on literal queues and workers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.api import RequestView
from policies.hyperflexis import (
    Held,
    HyperFlexisParams,
    RunningLoad,
    RunningRequest,
    WorkerView,
    _Candidates,
    _QueuePrefix,
    admission_probability,
    dispatch,
    shortened_maturity,
    tpot_floor,
)
from policies.queue_order import LateLast, OrderContext, QueuedRequest, make_order

_T = TypeVar("_T")

PREFILL = (0.02, 1e-4, 0.0)  # 20 ms + 0.1 ms per prompt token
DECODE = (0.01, 1e-6, 1e-4)  # 10 ms per step + context + batch terms


def req(
    rid: str, prompt: int = 100, arrival: float = 0.0, ttft: float = 1.0, tpot: float = 0.1, out: int = 50
) -> QueuedRequest:
    view = RequestView(
        request_id=rid, model="m", prompt_tokens=prompt, max_output_tokens=out, arrival=arrival
    )
    return QueuedRequest(
        view=view, ttft_slo=ttft, tpot_slo=tpot, seq=int.from_bytes(rid.encode(), "big") % 10_000
    )


def worker(
    wid: str, maturity: float = 0.0, running: tuple[RunningRequest, ...] = (), kv: int = 1 << 30
) -> WorkerView:
    return WorkerView(wid, PREFILL, DECODE, running=running, free_kv_tokens=kv, maturity=maturity)


def test_nothing_to_do() -> None:
    assert dispatch([], [worker("w")], 0.0).assignments == ()
    decision = dispatch([req("a")], [], 0.0)
    assert decision.assignments == () and math.isinf(decision.wake_at)


def test_idle_worker_takes_feasible_requests_and_matures_later() -> None:
    decision = dispatch([req("a"), req("b")], [worker("w")], now=0.0)
    assert [(a.request_id, a.engine_id, a.feasible) for a in decision.assignments] == [
        ("a", "w", True),
        ("b", "w", True),
    ]
    # E_p = 0.02 + 200e-4 = 0.04; E_d over 2 requests = 0.01 + 200e-6 + 2e-4 = 0.0104; relax = 0.1 - E_d.
    # Algorithm 1 gives E_p + (E_p / relax) * E_d = 0.0446, less than one step carrying the prefill
    # chunk and the decodes (E_p + E_d = 0.0504): the worker matures after that step.
    e_p, e_d = 0.04, 0.0104
    assert e_p + e_p / (0.1 - e_d) * e_d < e_p + e_d
    assert decision.maturity["w"] == pytest.approx(e_p + e_d)
    assert math.isinf(decision.wake_at)  # queue drained


def test_immature_worker_waits_and_says_when() -> None:
    decision = dispatch([req("a")], [worker("w", maturity=0.3)], now=0.1)
    assert decision.assignments == () and decision.wake_at == 0.3


def test_token_budget_limits_the_batch() -> None:
    # ttft 0.1, tpot 0.05, idle: budget = (0.1*0.05 - 0 - 0.02*0.05) / (1e-4*0.05) = 800 tokens
    queue = [
        req("a", prompt=500, ttft=0.1, tpot=0.05),
        req("b", prompt=400, ttft=0.1, tpot=0.05),
        req("c", prompt=250, ttft=0.1, tpot=0.05),
    ]
    full = HyperFlexisParams(budget_ttft_share=1.0)
    taken = [a.request_id for a in dispatch(queue, [worker("w")], 0.0, full).assignments]
    assert taken == ["a", "c"]  # b would overflow the budget; c still fits behind it
    half = [a.request_id for a in dispatch(queue, [worker("w")], 0.0).assignments]
    # default: half the TTFT for this batch -> a 300-token budget; the first request of a turn
    # may exceed it (else long prompts would starve), and then nothing else fits
    assert half == ["a"]


def test_lax_requests_are_budgeted_against_the_tightest_ttft_served() -> None:
    lax = [req(f"w{i}", prompt=600, ttft=20.0, tpot=1.0) for i in range(20)]
    full = HyperFlexisParams(budget_ttft_share=1.0, max_hold_s=30.0)
    alone = dispatch(lax, [worker("w")], 0.0, full).assignments
    strict = dispatch(lax, [worker("w")], 0.0, full, tightest_ttft_s=0.1).assignments
    # TTFT 0.1 s, TPOT 1 s: budget = (0.1 - 0.02) / 1e-4 = 800 tokens -> one 600-token prompt
    assert len(alone) == 20 and len(strict) == 1


def test_kv_space_is_respected() -> None:
    queue = [req("big", prompt=900, out=200), req("small", prompt=50, out=50)]
    taken = [a.request_id for a in dispatch(queue, [worker("w", kv=500)], 0.0).assignments]
    assert taken == ["small"]


def test_late_requests_fill_leftover_budget_and_idle_workers() -> None:
    late = req("late", arrival=-5.0, ttft=1.0)  # its deadline passed 4 s ago
    assert [(a.request_id, a.feasible) for a in dispatch([late], [worker("w")], 0.0).assignments] == [
        ("late", False)
    ]
    # a busy worker still has budget: the late request uses it rather than waiting for an idle worker
    busy = worker("w", running=(RunningRequest(100, 5, 0.1, True),))
    assert [(a.request_id, a.feasible) for a in dispatch([late], [busy], 0.0).assignments] == [
        ("late", False)
    ]
    no_late = HyperFlexisParams(late_backfill=False)
    assert dispatch([late], [busy], 0.0, no_late).assignments == ()
    no_backfill = HyperFlexisParams(idle_backfill=False, late_backfill=False)
    assert dispatch([late], [worker("w")], 0.0, no_backfill).assignments == ()


def test_a_long_late_prompt_never_stretches_a_busy_workers_turn() -> None:
    # budget with TTFT 1 s x 0.5 and TPOT 0.1 s is a few thousand tokens; this prompt exceeds it
    long_late = req("long", arrival=-20.0, ttft=1.0, prompt=20_000, out=10)
    busy = worker("w", running=(RunningRequest(100, 5, 0.1, True),))
    assert dispatch([long_late], [busy], 0.0).assignments == ()
    # an idle worker has no turn to protect: it takes it
    assert [a.request_id for a in dispatch([long_late], [worker("w")], 0.0).assignments] == ["long"]


def test_feasible_requests_come_first_and_unlucky_ones_wait_for_a_better_worker() -> None:
    late = req("late", arrival=-5.0, ttft=1.0, prompt=100)
    fresh = req("fresh", arrival=0.0, ttft=1.0, prompt=100)
    # behind a long queued prefill on w1, "tight" cannot make 0.3 s there, but could on an idle worker
    tight = req("tight", arrival=0.0, ttft=0.3, prompt=100)
    long_prefill = RunningRequest(3000, 0, 0.1, False)
    loaded = worker("w1", running=(long_prefill,))
    decision = dispatch([tight, late, fresh], [loaded], 0.0, HyperFlexisParams(budget_ttft_share=1.0))
    # On w1 each candidate's prefill waits for the queued 3000 tokens: E_p = 0.02 + 3100e-4 = 0.33 s.
    #   tight: slack 0.3 - 0.33 = -0.03 s over a spread of 0.1 * 0.3 * (1 + 1/256): p = 0.27 < theta;
    #          alone on an idle worker it would finish at 0.03 s, so it is not late: skipped.
    #   late:  slack -4.33 s: p = 0; its deadline (-4 s) passed, so it is late everywhere.
    #   fresh: slack 0.67 s over a spread of 0.1 * 1.0 * (1 + 1/256): p = 0.999, admitted.
    # Late backfill then spends what fresh left of the 2407-token budget on "late".
    assert [(a.request_id, a.engine_id, a.feasible) for a in decision.assignments] == [
        ("fresh", "w1", True),
        ("late", "w1", False),
    ]


def test_first_mature_worker_takes_all_that_fits_and_each_request_once() -> None:
    queue = [req(f"r{i}", prompt=100) for i in range(6)]
    decision = dispatch(queue, [worker("w1"), worker("w2")], 0.0)
    # w1 (first in maturity order) budgets (0.5 * 0.1 - 0.02 * 0.1) / (1e-4 * 0.1) = 4800 tokens and
    # every request has a second of slack: it takes all six, in queue order, as feasible
    assert [(a.request_id, a.engine_id, a.feasible) for a in decision.assignments] == [
        (f"r{i}", "w1", True) for i in range(6)
    ]
    # w1's turn: E_p = 0.02 + 600e-4 = 0.08 s, E_d (six requests of 100 tokens) = 0.01 + 600e-6 +
    # 6e-4 = 0.0112 s; Algorithm 1 gives 0.08 + 0.08 / (0.1 - 0.0112) * 0.0112 = 0.0901 s, below
    # one step carrying the prefill and the decodes, E_p + E_d = 0.0912 s. w2 is never examined:
    # nothing is left for it, so it keeps its maturity (absent from the decision).
    assert dict(decision.maturity) == {"w1": pytest.approx(0.08 + 0.0112)}
    assert math.isinf(decision.wake_at)


def test_maturity_follows_algorithm_1_when_decoding_amortises_slowly() -> None:
    # tight TPOT: relax = 0.012 - E_d is small, so (E_p / relax) * E_d exceeds one decode step
    decision = dispatch([req("a", tpot=0.012)], [worker("w")], now=0.0)
    e_p, e_d = 0.02 + 100e-4, 0.01 + 100e-6 + 1e-4
    assert decision.maturity["w"] == pytest.approx(e_p + e_p / (0.012 - e_d) * e_d)


@pytest.mark.parametrize("max_hold", [0.7, 3.0])
def test_busy_worker_is_held_for_max_hold_when_relax_is_negative(max_hold: float) -> None:
    # A running request with TPOT 10.2 ms: the engine decodes one sequence in 10.1 ms (so the
    # target is met alone), but not with a second (E_d = 0.01 + 205e-6 + 2e-4 s once "a" joins):
    # eq.(5) gives no budget, but the first request of a turn is taken anyway (a long prompt must
    # not starve). Algorithm 1's relax = 0.0102 - E_d < 0 means "never mature": held max_hold_s.
    slow = worker("w", running=(RunningRequest(100, 5, 0.0102, True),))
    decision = dispatch(
        [req("a", tpot=0.5, ttft=5.0)], [slow], now=2.0, params=HyperFlexisParams(max_hold_s=max_hold)
    )
    assert [(a.request_id, a.feasible) for a in decision.assignments] == [("a", True)]
    assert decision.maturity["w"] == pytest.approx(2.0 + max_hold)


@pytest.mark.parametrize("claimed", [0.0001, 0.001, 0.0025])
@pytest.mark.parametrize("how", ["running", "load", "candidate", "idle"])
def test_a_tpot_the_engine_cannot_meet_even_alone_is_not_planned_for(claimed: float, how: str) -> None:
    """Below a quarter of eq.(2)'s step for one sequence (10.1 ms here: tpot_floor 2.525 ms) no
    hold can meet a TPOT: a stream claiming one (x-slo-tpot-ms: 1) must not leave its engine a
    budget of nothing and a hold of max_hold_s per turn, one request a second; the engine plans
    as if it claimed nothing. An idle engine whose queue claims only such targets is bound by
    their TTFT alone (an infinite TPOT read as no budget at all took one a turn)."""
    assert claimed < tpot_floor(DECODE) < 0.0102
    lax = RunningRequest(100, 5, 0.1, True)
    claiming = RunningRequest(100, 5, claimed, True)
    queue = [req(f"q{i}", tpot=0.1, ttft=5.0) for i in range(8)]

    def turn(tight: bool) -> tuple[list[str], float]:
        running = (lax, claiming) if tight else (lax, lax)
        if how == "running":
            w = worker("w", running=running)
        else:
            w = dataclasses.replace(worker("w"), load=RunningLoad.of(running, tpot_floor(DECODE)))
        items = list(queue)
        if how == "candidate":
            w = worker("w", running=(lax,))
            items = [req("c", tpot=claimed if tight else 0.1, ttft=5.0), *queue]
        if how == "idle":
            w = worker("w")
            items = [req(f"i{i}", tpot=claimed if tight else 1e9, ttft=5.0) for i in range(8)]
        decision = dispatch(items, [w], now=2.0)
        return [a.request_id for a in decision.assignments], decision.maturity["w"]

    taken, maturity = turn(tight=True)
    assert (taken, maturity) == turn(tight=False)
    assert len(taken) > 1 and maturity < 2.0 + HyperFlexisParams().max_hold_s


@pytest.mark.parametrize(("max_hold", "expected"), [(1.0, 1.0), (2.0, 1.05)])
def test_max_hold_caps_a_long_algorithm_1_maturity(max_hold: float, expected: float) -> None:
    # TPOT 10.5 ms against E_d = 0.01 + 100e-6 + 1e-4 = 0.0102 s: relax = 0.3 ms, so amortising
    # E_p = 0.02 + 100e-4 = 0.03 s takes 0.03 / 0.0003 steps: maturity 0.03 + 100 * 0.0102 = 1.05 s
    decision = dispatch(
        [req("a", tpot=0.0105)], [worker("w")], now=0.0, params=HyperFlexisParams(max_hold_s=max_hold)
    )
    assert [a.request_id for a in decision.assignments] == ["a"]
    assert decision.maturity["w"] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("slack", "expected"),
    [(0.0, 0.5), (1.0, 1.0), (-1.0, 0.0)],
)
def test_admission_probability(slack: float, expected: float) -> None:
    p = admission_probability(
        arrival=0.0, ttft_slo=1.0, now=1.0 - slack, expected_prefill_s=0.0, utilization=0.0, slack_scale=0.1
    )
    assert p == pytest.approx(expected, abs=1e-3)


def test_admission_probability_falls_with_utilization_when_slack_is_positive() -> None:
    low = admission_probability(0.0, 1.0, 0.8, 0.0, 0.0, 0.1)
    high = admission_probability(0.0, 1.0, 0.8, 0.0, 1.0, 0.1)
    assert low > high > 0.5


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 120),
    taken=st.sets(st.integers(0, 130), max_size=60),
    limit=st.integers(1, 80),
    chunk=st.integers(1, 30),
)
def test_candidates_read_in_chunks_are_the_first_untaken_in_order(
    n: int, taken: set[int], limit: int, chunk: int
) -> None:
    items = [req(f"r{i}", prompt=10) for i in range(n)]
    skip = {f"r{i}" for i in taken}
    expected = [i.view.request_id for i in items if i.view.request_id not in skip][:limit]
    candidates = _Candidates(_QueuePrefix(iter(items)), skip, limit, chunk)
    assert [i.view.request_id for i in candidates] == expected
    assert bool(candidates) == bool(expected)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(10, 900), st.floats(0.0, 2.0), st.sampled_from([0.3, 0.8, 2.0])),
        min_size=1,
        max_size=40,
    ),
    kvs=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    busy=st.integers(0, 3),
    now=st.floats(0.5, 3.0),
)
def test_the_late_lane_break_changes_no_decision(
    specs: list[tuple[int, float, float]], kvs: list[int], busy: int, now: float
) -> None:
    """On a queue in LateLast order, ending the first pass at the first late request (late_last)
    admits exactly what skipping every late request one by one admits, at the same maturities;
    so does stopping a turn once its KV left is below the least any queued request needs."""
    ctx = OrderContext(prefill_tokens_per_s=1.0 / PREFILL[1], decode_step_s=0.01, prefill_base_s=PREFILL[0])
    order = LateLast(make_order("fcfs"))
    items = [req(f"r{i}", prompt=p, arrival=a, ttft=t) for i, (p, a, t) in enumerate(specs)]
    items.sort(key=lambda it: order.key(it, now, ctx)[0])
    running = tuple(RunningRequest(200, 5, 0.1, prefilled=False) for _ in range(busy))
    workers = [worker(f"w{i}", running=running, kv=kv) for i, kv in enumerate(kvs)]
    params = HyperFlexisParams(max_scan=64)
    plain = dispatch(items, workers, now, params)
    laned = dispatch(items, workers, now, params, late_last=ctx)
    least = min(i.view.prompt_tokens + i.view.max_output_tokens for i in items)
    bounded = dispatch(items, workers, now, params, late_last=ctx, queue_min_need=least)
    for other in (laned, bounded):
        assert other.assignments == plain.assignments
        assert other.maturity == plain.maturity
        assert other.wake_at == plain.wake_at


def test_the_late_lane_break_skips_reading_the_late_part() -> None:
    ctx = OrderContext(prefill_tokens_per_s=1.0 / PREFILL[1], decode_step_s=0.01, prefill_base_s=PREFILL[0])
    late = [req(f"l{i}", prompt=100, arrival=0.0, ttft=0.3) for i in range(500)]
    read: list[str] = []

    def source() -> Iterator[QueuedRequest]:
        for item in late:
            read.append(item.view.request_id)
            yield item

    full = RunningRequest(100, 1, 0.1, prefilled=True)
    busy = worker("w", running=(full,) * 3, kv=10)  # fits nothing: backfill ends after its misses
    decision = dispatch(source(), [busy], 2.0, HyperFlexisParams(max_scan=128), late_last=ctx)
    assert decision.assignments == ()
    assert len(read) < 60  # without the lane the first pass alone reads max_scan = 128
    read.clear()
    dispatch(
        (i for i in late if read.append(i.view.request_id) is None),
        [busy],
        2.0,
        HyperFlexisParams(max_scan=128),
    )
    assert len(read) >= 128


def test_a_turns_prefill_amortises_within_the_longest_hold() -> None:
    """With a lax TTFT, eq.(5) alone would let one turn prefill ~2 s of prompts; the turn must
    fit what max_hold_s can amortise: E_p * TPOT / (TPOT - E_d) <= max_hold_s."""
    lax = [req(f"w{i}", prompt=600, ttft=20.0, tpot=1.0) for i in range(40)]
    decision = dispatch(lax, [worker("w")], 0.0, HyperFlexisParams(budget_ttft_share=1.0, max_hold_s=0.5))
    took = [a.request_id for a in decision.assignments]
    prefill = PREFILL[0] + PREFILL[1] * 600 * len(took)
    assert prefill <= 0.5 < prefill + PREFILL[1] * 600  # as many as fit, not one more
    assert decision.maturity["w"] <= 0.5 + 1e-9


def test_a_hold_shrinks_with_the_prefill_the_engine_really_took() -> None:
    params = HyperFlexisParams(recheck_s=0.01)
    # held 10 -> 10.5 s for a predicted 0.4 s prefill; the prefill was done at 10.04 s (10x faster)
    assert shortened_maturity(10.0, 10.5, 0.4, 10.04, params) == pytest.approx(10.05)
    assert shortened_maturity(10.0, 10.5, 0.4, 10.001, params) == pytest.approx(10.01)  # recheck floor
    assert shortened_maturity(10.0, 10.5, 0.4, 10.45, params) == 10.5  # slower than predicted: no change
    assert shortened_maturity(10.0, 10.5, 0.4, 10.6, params) == 10.5  # already mature
    assert shortened_maturity(10.0, 10.5, 0.0, 10.1, params) == 10.5  # nothing was predicted


def test_a_turn_reports_the_prefill_its_hold_amortises() -> None:
    decision = dispatch([req("a", prompt=300), req("b", prompt=200)], [worker("w")], 0.0)
    assert decision.prefill_s["w"] == pytest.approx(PREFILL[0] + PREFILL[1] * 500)
    assert decision.maturity["w"] > decision.prefill_s["w"]


def test_a_worker_that_waits_for_a_request_to_turn_late_takes_it_at_that_time() -> None:
    """The timer is set for the first instant the request is late (not the boundary, where it is
    not late yet and the worker would otherwise park for good)."""
    item = req("x", prompt=1000, arrival=0.0, ttft=1.0)  # prefill 0.12 s: late from 0.88 s
    busy = worker("w", running=(RunningRequest(100, 1, 0.1, prefilled=False),))
    early = dispatch([item], [busy], 0.87, HyperFlexisParams(theta=0.99))
    assert early.assignments == ()
    at = early.maturity["w"]
    assert 0.87 < at <= 0.8800001
    late = dispatch([item], [dataclasses.replace(busy, maturity=at)], at, HyperFlexisParams(theta=0.99))
    assert [(a.request_id, a.feasible) for a in late.assignments] == [("x", False)]


def test_a_look_with_its_budget_spent_stops_at_the_next_candidate_even_after_a_miss() -> None:
    """A worker joining a turn whose budget is spent takes nothing: its first candidate misses
    the budget and the look stops there, without reading on to a request it could not take for
    another reason (a LoRA adapter loaded elsewhere), which would count it as held back by slack
    instead of full. (A faster scan once dropped the budget's stop when that first candidate
    missed.)"""
    joining = dataclasses.replace(worker("w", running=(RunningRequest(100, 5, 0.1, True),)), joining=10**6)
    lora = dataclasses.replace(req("b"), view=dataclasses.replace(req("b").view, lora="x"))
    decision = dispatch([req("a"), lora], [joining], 0.0, HyperFlexisParams(), adapters_held=frozenset({"x"}))
    assert decision.assignments == ()
    assert decision.full == frozenset({"w"})


def test_mixed_steps_charge_a_turns_prefill_only_what_it_adds_to_a_decode_step() -> None:
    """On an engine that runs prefill chunks inside decode steps (chunked prefill), a step's fixed
    cost is paid once: with ``mixed_steps`` eq.(5) charges a worker with running streams
    a - a_d for a turn's prefill instead of a. The hold still amortises the whole E_p, and on an
    idle worker (no decode step to share) nothing changes."""
    decoding = (RunningRequest(100, 5, 0.1, True),)
    queue = [req(f"r{i}", prompt=100, ttft=1.0, tpot=0.1) for i in range(40)]
    base = HyperFlexisParams(budget_ttft_share=0.25)
    mixed = dataclasses.replace(base, mixed_steps=True)
    a, b, _ = PREFILL
    e_d = DECODE[0] + DECODE[1] * 105 + DECODE[2]  # the running stream's decode step
    horizon = 0.25  # 1.0 s TTFT x 0.25

    def budget(fixed: float) -> int:
        return math.floor((horizon * (0.1 - e_d) - fixed * 0.1) / (b * 0.1) + 1e-9)

    plain = dispatch(queue, [worker("w", running=decoding)], 0.0, base)
    shared = dispatch(queue, [worker("w", running=decoding)], 0.0, mixed)
    assert len(plain.assignments) == budget(a) // 100 == 20
    assert len(shared.assignments) == budget(a - DECODE[0]) // 100 == 21
    e_p = a + b * 2100
    e_d_after = DECODE[0] + DECODE[1] * (105 + 2100) + DECODE[2] * 22
    assert shared.prefill_s["w"] == pytest.approx(e_p)
    assert shared.maturity["w"] == pytest.approx(
        max(e_p + e_p / (0.1 - e_d_after) * e_d_after, e_p + e_d_after)
    )
    # an idle worker's first prefill runs alone and pays the fixed cost itself
    idle_plain = dispatch(queue, [worker("w")], 0.0, base)
    idle_mixed = dispatch(queue, [worker("w")], 0.0, mixed)
    assert idle_mixed.assignments == idle_plain.assignments
    assert idle_mixed.maturity == idle_plain.maturity
    # and so does one whose every request still waits for its prefill (no decode step to share)
    prefilling = (RunningRequest(100, 0, 0.1, False),)
    assert (
        dispatch(queue, [worker("w", running=prefilling)], 0.0, mixed).assignments
        == dispatch(queue, [worker("w", running=prefilling)], 0.0, base).assignments
    )


def test_only_a_request_whose_ttft_is_lost_is_dispatched_late() -> None:
    """Late backfill takes late requests; idle backfill takes the head, late or not (a prompt that
    fits nowhere else): only a head past its TTFT is in the late lane."""
    roomy = dispatch([req("big", prompt=100, out=10_000)], [worker("w", kv=5_000)], 0.0)
    assert [(a.request_id, a.feasible, a.late) for a in roomy.assignments] == [("big", False, False)]
    late = dispatch([req("old", arrival=-5.0)], [worker("w")], 0.0)
    assert [(a.request_id, a.late) for a in late.assignments] == [("old", True)]
    backfill = dispatch(
        [req("a", tpot=0.5), req("old", arrival=-5.0, tpot=0.5)], [worker("w")], 0.0, HyperFlexisParams()
    )
    assert {a.request_id: a.late for a in backfill.assignments} == {"a": False, "old": True}


def test_tpot_segregation_keeps_each_class_on_an_engine_of_its_own() -> None:
    """Where TPOT binds, a lax request's long prefill stalls every tight stream it shares steps
    with: with ``tpot_segregation`` the worker running tight streams leaves it to the engine
    running lax ones (and takes the tight request that one would have taken); without a lax
    engine to leave it to, it is taken as before, and a turn whose candidates are all of its
    worker's class never asks for the classes."""
    tight_streams = tuple(RunningRequest(1000, 100, 0.04, True) for _ in range(10))
    lax_streams = tuple(RunningRequest(1000, 100, 0.25, True) for _ in range(10))
    workers = [worker("tight", running=tight_streams), worker("lax", running=lax_streams)]
    queue = [req("bg", prompt=5000, ttft=10.0, tpot=0.25), req("int", prompt=100, ttft=3.0, tpot=0.04)]
    asked = 0
    big = 1 << 40

    def classes(mapping: dict[str, float], kv: int = big):  # type: ignore[no-untyped-def]
        def read() -> dict[str, tuple[float, int]]:
            nonlocal asked
            asked += 1
            return {e: (c, kv) for e, c in mapping.items()}

        return read

    both = {"tight": 0.04, "lax": 0.25}
    base = HyperFlexisParams(budget_ttft_share=0.25)
    segregated = dataclasses.replace(base, tpot_segregation=True)
    mixed = dispatch(queue, workers, 0.0, base, engine_classes=classes(both))
    assert {(a.request_id, a.engine_id) for a in mixed.assignments} == {("bg", "tight"), ("int", "lax")}
    assert asked == 0  # (only asked with the parameter on)
    apart = dispatch(queue, workers, 0.0, segregated, engine_classes=classes(both))
    assert {(a.request_id, a.engine_id) for a in apart.assignments} == {("bg", "lax"), ("int", "tight")}
    assert asked == 1  # once per call, however many candidates differ
    # no engine of the lax class: the tight worker takes it (it must go somewhere) ...
    alone = dispatch(queue[:1], workers[:1], 0.0, segregated, engine_classes=classes({"tight": 0.04}))
    assert [(a.request_id, a.engine_id) for a in alone.assignments] == [("bg", "tight")]
    # ... nor when the lax engine's whole KV could never hold it
    small = dispatch(queue[:1], workers[:1], 0.0, segregated, engine_classes=classes(both, kv=4000))
    assert [(a.request_id, a.engine_id) for a in small.assignments] == [("bg", "tight")]
    # ... nor to an engine of a third class, which would leave it again: never back and forth
    third = dispatch(
        [req("mid", prompt=5000, ttft=10.0, tpot=0.1)],
        workers[:1],
        0.0,
        segregated,
        engine_classes=classes({"tight": 0.04, "other": 0.5}),
    )
    assert [(a.request_id, a.engine_id) for a in third.assignments] == [("mid", "tight")]
    # an idle engine is a home for a lax request too
    idle = dispatch(
        queue[:1], workers[:1], 0.0, segregated, engine_classes=classes({"tight": 0.04, "idle": math.inf})
    )
    assert idle.assignments == ()
    asked = 0
    same = dispatch(queue[1:], workers[:1], 0.0, segregated, engine_classes=classes(both))
    assert [a.request_id for a in same.assignments] == ["int"] and asked == 0
    with pytest.raises(ValueError, match="segregate_ratio"):
        HyperFlexisParams(segregate_ratio=0.5)


def test_tpot_segregation_leaves_a_tight_request_to_an_engine_of_its_class_only_where_tpot_binds() -> None:
    """A worker running mostly lax streams leaves a tight request to an engine running mostly
    tight ones when its own decode step is at least half the tight TPOT (its long prefills would
    stall the request's stream); where its steps are far within that TPOT it takes it."""
    lax_streams = tuple(RunningRequest(1000, 100, 0.25, True) for _ in range(10))
    queue = [req("int", prompt=100, ttft=3.0, tpot=0.04)]
    mapping = {"lax": (0.25, 1 << 40), "tight": (0.04, 1 << 40)}
    params = HyperFlexisParams(budget_ttft_share=0.25, tpot_segregation=True)
    # decode step over 10 streams of 1,100 tokens: 0.01 + 0.011 + 0.001 = 22 ms >= 20 ms
    slow = dispatch(queue, [worker("lax", running=lax_streams)], 0.0, params, engine_classes=lambda: mapping)
    assert slow.assignments == ()
    fast = dataclasses.replace(worker("lax", running=lax_streams), decode_coeffs=(0.005, 1e-7, 1e-4))
    taken = dispatch(queue, [fast], 0.0, params, engine_classes=lambda: mapping)
    assert [(a.request_id, a.engine_id) for a in taken.assignments] == [("int", "lax")]


def test_tpot_segregation_holds_a_request_for_its_class_only_until_its_ttft() -> None:
    """An engine of its class full for long must not hold a request until its queue timeout:
    past ``segregate_max_wait`` of its TTFT any worker takes it. A LoRA request goes where its
    adapter is, classes or not."""
    tight_streams = tuple(RunningRequest(1000, 100, 0.04, True) for _ in range(10))
    mapping = {"tight": (0.04, 1 << 40), "lax": (0.25, 1 << 40)}
    params = HyperFlexisParams(budget_ttft_share=0.25, tpot_segregation=True, late_backfill=False)
    bg = req("bg", prompt=5000, ttft=10.0, tpot=0.25, arrival=0.0)
    left = dispatch(
        [bg], [worker("tight", running=tight_streams)], 1.0, params, engine_classes=lambda: mapping
    )
    assert left.assignments == ()
    half = dataclasses.replace(params, segregate_max_wait=0.5)
    tight = worker("tight", running=tight_streams)
    assert dispatch([bg], [tight], 4.9, half, engine_classes=lambda: mapping).assignments == ()
    taken = dispatch([bg], [tight], 5.0, half, engine_classes=lambda: mapping)
    assert [a.engine_id for a in taken.assignments] == ["tight"]
    lora_view = dataclasses.replace(bg.view, lora="adapter-x")
    lora = dataclasses.replace(bg, view=lora_view)
    with_adapter = dataclasses.replace(
        worker("tight", running=tight_streams), adapters=frozenset({"adapter-x"})
    )
    placed = dispatch(
        [lora],
        [with_adapter],
        1.0,
        params,
        adapters_held=frozenset({"adapter-x"}),
        engine_classes=lambda: mapping,
    )
    assert [a.engine_id for a in placed.assignments] == ["tight"]
    with pytest.raises(ValueError, match="segregate_max_wait"):
        HyperFlexisParams(segregate_max_wait=-1.0)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.integers(10, 900),
            st.floats(0.0, 2.0),
            st.sampled_from([0.3, 0.8, 2.0]),
            st.sampled_from([0.02, 0.1]),
        ),
        max_size=12,
    ),
    loads=st.lists(
        st.tuples(st.integers(0, 3000), st.integers(0, 3), st.floats(-0.5, 2.5)), min_size=1, max_size=4
    ),
    now=st.floats(0.5, 3.0),
    segregate=st.booleans(),
)
def test_dispatch_reads_its_workers_only_and_decides_alike_on_a_read_or_lazy_queue(
    specs: list[tuple[int, float, float, float]],
    loads: list[tuple[int, int, float]],
    now: float,
    segregate: bool,
) -> None:
    """WorkerView is not frozen (a frozen one cost 2.6x as much to make, one per worker per turn):
    dispatch must never write to one. A queue given as a list is known whole at once (an
    arrival's turn), and a call ends as soon as everything in it is taken; the decisions are those
    of the same queue read lazily."""
    items = [req(f"r{i}", prompt=p, arrival=a, ttft=t, tpot=tp) for i, (p, a, t, tp) in enumerate(specs)]
    workers = [
        worker(
            f"w{i}",
            maturity=m,
            running=tuple(RunningRequest(200, 5, 0.1, prefilled=False) for _ in range(busy)),
            kv=kv,
        )
        for i, (kv, busy, m) in enumerate(loads)
    ]
    before = [dataclasses.replace(w) for w in workers]
    params = HyperFlexisParams(max_scan=64, tpot_segregation=segregate)
    # engines of both TPOT classes (and one not looking in this call), so segregation decides
    classes = {w.engine_id: (0.1 if i % 2 else 0.02, 1 << 20) for i, w in enumerate(workers)}
    classes["elsewhere"] = (0.02, 1 << 20)
    read = dispatch(items, workers, now, params, engine_classes=lambda: classes)
    lazy = dispatch(iter(items), workers, now, params, engine_classes=lambda: classes)
    assert workers == before
    assert read.assignments == lazy.assignments
    assert read.maturity == lazy.maturity
    assert read.wake_at == lazy.wake_at
    assert read.full == lazy.full


def test_a_request_late_on_its_whole_prompt_but_on_time_on_its_uncached_part_is_taken() -> None:
    """The late lane's break judged by the whole prompt: with 95 % of it cached on the worker,
    a request on time on what is left to prefill was skipped by every busy worker (and late
    backfill, which saw it as feasible, skipped it too)."""

    ctx = OrderContext(prefill_tokens_per_s=1.0 / PREFILL[1], decode_step_s=0.01, prefill_base_s=PREFILL[0])
    # 10,000 tokens: 1.02 s to prefill whole against a 0.5 s TTFT; 500 uncached: 0.07 s
    item = req("r", prompt=10_000, ttft=0.5)
    busy = worker("w", running=(RunningRequest(100, 5, 0.1, prefilled=True),))
    params = HyperFlexisParams(prefix_preference=True, max_hold_s=2.0)
    for lane in (None, ctx):
        decision = dispatch([item], [busy], 0.0, params, 10.0, lane, cached=lambda rid: Held({"w": 0.95}, {}))
        assert [(a.request_id, a.feasible, a.cached_tokens) for a in decision.assignments] == [
            ("r", True, 9_500)
        ]


def test_the_shortcut_reads_nan_and_inf_as_the_whole_turn_does() -> None:
    """A NaN maturity or clock is not mature for the turn; a NaN lateness (an infinite prefill
    term times an empty prompt) is left to the whole turn, whose two backfills read it apart."""
    decode = (0.01, 1e-6, 1e-4)
    item = QueuedRequest(view=RequestView("r", "m", 100, 50, arrival=0.0), ttft_slo=1.0, tpot_slo=0.1, seq=1)
    params = HyperFlexisParams()
    for maturity, now in ((math.nan, 0.5), (0.0, math.nan), (math.inf, math.inf)):
        w = WorkerView("w", (0.01, 1e-4, 0.0), decode, maturity=maturity)
        _decided_alike(item, w, now, params, math.inf, None, 0)
    empty = QueuedRequest(view=RequestView("r", "m", 0, 50, arrival=0.0), ttft_slo=1.0, tpot_slo=0.1, seq=1)
    lane = OrderContext(prefill_tokens_per_s=1e4, decode_step_s=0.01, prefill_base_s=0.01)
    for c in (math.inf, math.nan):
        w = WorkerView("w", (0.01, 1e-4, c), decode, maturity=0.0)
        for late_last in (lane, None):
            _decided_alike(empty, w, 0.995, params, math.inf, late_last, 0)


@settings(max_examples=2500, deadline=None)
@given(
    prompt=st.integers(0, 3000),
    out=st.integers(0, 2000),
    arrival=st.floats(0.0, 2.0),
    ttft=st.sampled_from([0.01, 0.05, 0.3, 1.0, 5.0, 30.0, math.inf]),
    tpot=st.sampled_from([0.005, 0.02, 0.1, 1.0]),
    now=st.floats(0.0, 3.0),
    # (mostly mature, with room: the cases the shortcut takes; the rest it must leave alike)
    ago=st.floats(-0.5, 2.0),
    kv=st.sampled_from([-10, 0, 300, 6000, 1 << 20]),
    seqs=st.sampled_from([0, 1, 2, 4, 256]),
    running=st.lists(
        st.tuples(
            st.integers(0, 2000), st.integers(0, 300), st.sampled_from([0.005, 0.02, 0.1]), st.booleans()
        ),
        max_size=3,
    ),
    prefill=st.tuples(
        st.floats(0.0, 0.05), st.sampled_from([0.0, 1e-5, 1e-4, 3e-4]), st.sampled_from([0.0, 1e-8, -1e-9])
    ),
    decode=st.tuples(st.floats(0.0, 0.03), st.floats(0.0, 1e-5), st.floats(0.0, 1e-3)),
    theta=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]),
    idle_backfill=st.booleans(),
    mixed=st.booleans(),
    segregation=st.booleans(),
    tpot_plan=st.sampled_from([1.0, 0.9]),
    tightest=st.sampled_from([0.05, 2.0, math.inf]),
    min_need=st.sampled_from([0, 100, 5000]),
    lane=st.sampled_from([None, "same", "slower", "faster"]),
    lora=st.sampled_from([None, "x"]),
    held=st.sampled_from([frozenset(), frozenset({"x"})]),
    joining=st.sampled_from([None, 0, 100, 4000]),
    late_backfill=st.booleans(),
    scan_after=st.sampled_from([0, 16]),
    as_load=st.booleans(),
)
def test_one_arrival_for_one_worker_is_decided_as_the_whole_algorithm_decides(
    prompt: int,
    out: int,
    arrival: float,
    ttft: float,
    tpot: float,
    now: float,
    ago: float,
    kv: int,
    seqs: int,
    running: list[tuple[int, int, float, bool]],
    prefill: tuple[float, float, float],
    decode: tuple[float, float, float],
    theta: float,
    idle_backfill: bool,
    mixed: bool,
    segregation: bool,
    tpot_plan: float,
    tightest: float,
    min_need: int,
    lane: str | None,
    lora: str | None,
    held: frozenset[str],
    joining: int | None,
    late_backfill: bool,
    scan_after: int,
    as_load: bool,
) -> None:
    """The shortcut for an arrival to an empty queue with one worker (every request at low load:
    an idle engine, or one whose hold it joins) must decide exactly what dispatch's whole turn
    does: same assignment, flags, maturity, prefill time and budget, or leave the case to it."""

    view = RequestView("r", "m", prompt, out, arrival=arrival, lora=lora)
    item = QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=tpot, seq=1)
    shadows = tuple(RunningRequest(p, g, t, done) for p, g, t, done in running)
    w = WorkerView(
        "w",
        prefill,
        decode,
        running=() if as_load else shadows,
        load=RunningLoad.of(shadows) if as_load else None,
        free_kv_tokens=kv,
        max_num_seqs=seqs,
        maturity=now - ago,
        joining=joining,
    )
    late_last = None
    if lane is not None and prefill[1] > 0:
        scale = {"same": 1.0, "slower": 0.5, "faster": 2.0}[lane]
        late_last = OrderContext(
            prefill_tokens_per_s=scale / prefill[1], decode_step_s=0.01, prefill_base_s=prefill[0] * scale
        )
    params = HyperFlexisParams(
        theta=theta,
        idle_backfill=idle_backfill,
        mixed_steps=mixed,
        tpot_plan=tpot_plan,
        tpot_segregation=segregation,
        late_backfill=late_backfill,
        scan_after_admit=scan_after,
    )
    _decided_alike(item, w, now, params, tightest, late_last, min_need, held)


def _without(module: object, flag: str, decide: Callable[[], _T]) -> _T:
    """``decide()`` with the module's shortcut ``flag`` off (set back on whatever happens): the
    whole algorithm's answer, to compare the shortcut's with."""
    setattr(module, flag, False)
    try:
        return decide()
    finally:
        setattr(module, flag, True)


def _decided_alike(
    item: QueuedRequest,
    w: WorkerView,
    now: float,
    params: HyperFlexisParams,
    tightest: float,
    late_last: OrderContext | None,
    min_need: int,
    held: frozenset[str] = frozenset(),
) -> object:
    """dispatch's decision with and without the one-worker shortcut, which must be the same."""
    from policies import hyperflexis

    classes = {"w": (0.1, 1 << 20), "other": (0.005, 1 << 20)}
    args = ((item,), [w], now, params, tightest, late_last, min_need, None, None, held, lambda: classes)

    def decided() -> object:
        try:
            return dispatch(*args)
        except ValueError as error:  # (a negative predicted prefill: both refuse it alike)
            return repr(error)

    short = decided()
    whole = _without(hyperflexis, "ALONE_SHORTCUT", decided)
    assert repr(short) == repr(whole)  # (repr: a NaN in both is the same decision)
    return short


@settings(max_examples=1500, deadline=None)
@given(
    prompt=st.integers(1, 3000),
    # (a share of the TTFT target: near its end the admission probability decides)
    waited=st.floats(0.0, 1.1),
    ttft=st.sampled_from([1.0, 5.0, 30.0]),
    tpot=st.sampled_from([0.02, 0.1]),
    running=st.lists(
        st.tuples(st.integers(10, 3000), st.integers(0, 300), st.booleans()), min_size=1, max_size=6
    ),
    prefill=st.tuples(
        st.floats(0.005, 0.05), st.sampled_from([1e-5, 1e-4, 3e-4]), st.sampled_from([0.0, 1e-8])
    ),
    decode=st.tuples(st.floats(0.005, 0.03), st.floats(0.0, 1e-6), st.floats(0.0, 3e-4)),
    theta=st.floats(0.0, 1.0),
    mixed=st.booleans(),
    tightest=st.sampled_from([0.5, 2.0, 30.0]),
    joining=st.sampled_from([None, 0, 100, 2000]),
    seqs=st.sampled_from([4, 8, 256]),
)
def test_one_arrival_joining_a_busy_worker_is_decided_as_the_whole_algorithm_decides(
    prompt: int,
    waited: float,
    ttft: float,
    tpot: float,
    running: list[tuple[int, int, bool]],
    prefill: tuple[float, float, float],
    decode: tuple[float, float, float],
    theta: float,
    mixed: bool,
    tightest: float,
    joining: int | None,
    seqs: int,
) -> None:
    """The busy worker's cases the shortcut takes (one TPOT class, room, time left): budget,
    admission probability and hold as the whole turn computes them."""
    now = 10.0
    view = RequestView("r", "m", prompt, 100, arrival=now - waited * ttft)
    item = QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=tpot, seq=1)
    w = WorkerView(
        "w",
        prefill,
        decode,
        running=tuple(RunningRequest(p, g, tpot, done) for p, g, done in running),
        free_kv_tokens=1 << 20,
        max_num_seqs=seqs,
        maturity=now,
        joining=joining,
    )
    params = HyperFlexisParams(theta=theta, mixed_steps=mixed, tpot_segregation=True)
    _decided_alike(item, w, now, params, tightest, None, 0)


def test_the_shortcut_takes_the_common_cases_of_low_load() -> None:
    """An idle engine, and one whose hold the arrival joins, are decided without a whole turn
    (the cases every request meets at low load; the property tests above hold them exact)."""
    from policies.hyperflexis import _alone

    now = 10.0
    item = QueuedRequest(
        view=RequestView("r", "m", 500, 100, arrival=now - 0.05), ttft_slo=5.0, tpot_slo=0.1, seq=1
    )
    params = HyperFlexisParams(theta=0.5, mixed_steps=True, tpot_segregation=True)
    idle = WorkerView("w", PREFILL, DECODE, maturity=now)
    running = tuple(RunningRequest(300, 10, 0.1, True) for _ in range(5))
    joined = WorkerView("w", PREFILL, DECODE, running=running, maturity=now, joining=100)
    for w in (idle, joined):
        decision = _alone(item, w, now, params, 2.0, None, 0, None, frozenset())
        assert decision is not None and decision == _decided_alike(item, w, now, params, 2.0, None, 0)
        assert [(a.request_id, a.feasible) for a in decision.assignments] == [("r", True)]


@settings(max_examples=600, deadline=None)
@given(
    queue=st.lists(
        st.tuples(
            st.integers(0, 600),  # prompt
            st.sampled_from([0, 50, 400]),  # output bound
            st.floats(0.0, 1.5),  # waited, as a share of its TTFT target
            st.sampled_from([0.02, 0.1, 0.5]),  # TPOT target
        ),
        min_size=1,
        max_size=60,
    ),
    workers=st.lists(
        st.tuples(
            st.sampled_from([0, 150, 400, 900, 1 << 20]),  # free KV
            st.sampled_from([1, 2, 8, 256]),  # seats
            st.lists(
                st.tuples(st.integers(10, 600), st.sampled_from([0.02, 0.1, 0.5]), st.booleans()), max_size=4
            ),
        ),
        min_size=1,
        max_size=3,
    ),
    theta=st.sampled_from([0.0, 0.5, 0.9]),
    segregation=st.booleans(),
    lane=st.booleans(),
    scan_after=st.sampled_from([0, 1, 4, 16]),
    min_need=st.sampled_from([0, 100, 300]),
    tightest=st.sampled_from([0.2, 5.0, math.inf]),
)
def test_the_tight_scan_decides_as_the_full_tests(
    queue: list[tuple[int, int, float, float]],
    workers: list[tuple[int, int, list[tuple[int, float, bool]]]],
    theta: float,
    segregation: bool,
    lane: bool,
    scan_after: int,
    min_need: int,
    tightest: float,
) -> None:
    """The tight loop that skips capacity misses must leave every decision as the full tests
    make it: assignments, maturity, the workers it calls full, wake time, prefill and budget."""
    from policies import hyperflexis

    now = 100.0
    ttft = 1.0
    items = [
        QueuedRequest(
            view=RequestView(f"r{i}", "m", prompt, out, arrival=now - waited * ttft),
            ttft_slo=ttft,
            tpot_slo=tpot,
            seq=i,
        )
        for i, (prompt, out, waited, tpot) in enumerate(queue)
    ]
    prefill = (0.01, 2e-4, 1e-8)
    views = [
        WorkerView(
            f"w{i}",
            prefill,
            (0.01, 1e-6, 1e-4),
            running=tuple(RunningRequest(p, 5, t, done) for p, t, done in running),
            free_kv_tokens=kv,
            max_num_seqs=seats,
            maturity=now - 0.01 * i,
        )
        for i, (kv, seats, running) in enumerate(workers)
    ]
    params = HyperFlexisParams(theta=theta, tpot_segregation=segregation, scan_after_admit=scan_after)
    late_last = (
        OrderContext(prefill_tokens_per_s=1 / 2e-4, decode_step_s=0.01, prefill_base_s=0.01) if lane else None
    )
    classes = {"w0": (0.1, 1 << 20), "w1": (0.02, 1 << 20), "other": (0.5, 1 << 20)}

    def decided() -> str:
        return repr(
            dispatch(
                list(items),
                views,
                now,
                params,
                tightest,
                late_last,
                min_need,
                None,
                None,
                frozenset(),
                lambda: classes,
            )
        )

    tight = decided()
    full = _without(hyperflexis, "TIGHT_SCAN", decided)
    assert tight == full
