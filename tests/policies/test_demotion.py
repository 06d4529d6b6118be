"""Moore-Hodgson demotion per SLO band (policies.demotion), the drain rates it plans with, and how
the admission queue ranks what it demotes."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission_queue import AdmissionQueue
from policies.api import RequestView
from policies.demotion import Band, BandRates, Row, demote_in_bands, longest_to_demote
from policies.hyperflexis import HyperFlexisParams
from policies.queue_order import LateLast, OrderContext, QueuedRequest, make_order

CHAT: Band = (0, 2.0, 0.5)
MATH: Band = (0, 0.7, 0.2)


def row(rid: str, last_start: float, service_s: float, band: Band = CHAT, rank: float | None = None) -> Row:
    """A request served in the order of ``rank`` (default: its number) within its band."""
    seq = int(rid[1:]) if rid[1:].isdigit() else 0
    return (band, (float(seq) if rank is None else rank, float(seq)), last_start, service_s, rid)


def test_a_band_that_keeps_up_demotes_nothing() -> None:
    rows = [row("r1", 5.0, 1.0), row("r2", 5.0, 1.0), row("r3", 6.0, 2.0)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == set()


def test_an_overloaded_band_gives_up_its_longest_request_not_the_one_that_turns_late() -> None:
    # at 1 service-second per second, r1 runs 0-2; r2 would start at 2, past its last start
    # 1.6: giving up r1 (the longest so far) lets r2 start at once
    rows = [row("r1", 0.0, 2.0), row("r2", 1.6, 0.5)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == {"r1"}


def test_the_newcomer_is_given_up_when_giving_up_the_longest_would_not_save_it() -> None:
    # served in rank order: r1 (long, due late) first. r2 would start at 3 > 0.1; giving up r1
    # (3 s) would let it start at 0 <= 0.1, so r1 goes. r3 would then start at 0.1 > 0.05, and
    # giving up r2 (0.1 s, longer than r3's 0.01) would let it start at 0: r2 goes too
    rows = [row("r1", 5.0, 3.0), row("r2", 0.1, 0.1), row("r3", 0.05, 0.01)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == {"r1", "r2"}
    # the same when the one to give up is no longer than the newcomer: the newcomer goes
    rows = [row("r1", 5.0, 0.1), row("r2", 0.05, 0.1)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == {"r2"}


def test_rows_grouped_by_band_decide_the_same_and_requests_no_longer_queued_take_no_drain() -> None:
    rows = [row("r1", 0.0, 2.0), row("r2", 1.6, 0.5), row("m3", 0.1, 3.0, MATH), row("m4", 0.5, 0.2, MATH)]
    rates = {CHAT: 1.0, MATH: 1.0}
    grouped: dict[Band, list] = {}
    for band, *member in reversed(rows):  # (in any order: each band is sorted by rank)
        grouped.setdefault(band, []).append(tuple(member))
    assert demote_in_bands(grouped, 0.0, rates) == longest_to_demote(rows, 0.0, rates) == {"r1", "m3"}
    # r1 and m3 left the queue while the plan read it: nothing ahead of r2 and m4 any more
    assert demote_in_bands(grouped, 0.0, rates, queued={"r2", "m4"}) == set()
    # and what is late at the plan's end (r1) is left out, as longest_to_demote leaves it
    assert demote_in_bands(grouped, 0.05, rates, queued={"r1", "r2", "m3", "m4"}) == {"m3"}


def test_a_band_is_walked_in_the_order_the_queue_serves_it() -> None:
    # a (long) is served before b: b cannot start by 2.1 behind it, so one of them goes; in
    # order of last start alone, b would be walked first and nothing given up
    rows = [row("ra", 2.0, 3.0, rank=1.0), row("rb", 2.1, 0.1, rank=2.0)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == {"ra"}


def test_bands_drain_separately_and_a_band_without_a_measured_rate_demotes_nothing() -> None:
    rows = [row("r1", 0.0, 2.0), row("r2", 1.6, 0.5), row("r3", 0.0, 2.0, MATH), row("r4", 1.6, 0.5, MATH)]
    # MATH drains 10x faster: both its requests start in time
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0, MATH: 10.0}) == {"r1"}
    assert longest_to_demote(rows, 0.0, {MATH: 1.0}) == {"r3"}
    assert longest_to_demote(rows, 0.0, {CHAT: 0.0, MATH: -1.0}) == set()


def test_late_requests_are_left_to_the_queue_and_the_rate_share_plans_with_a_margin() -> None:
    rows = [row("r1", 2.0, 1.0), row("r2", 2.0, 1.0), row("late", 0.5, 9.0, rank=0.0)]
    # "late" turned late before now (its last start 0.5 < 1): not demoted, and it takes no drain
    assert longest_to_demote(rows, 1.0, {CHAT: 1.0}) == set()
    # at half the measured rate r2 would start at 3 > 2
    assert longest_to_demote(rows, 1.0, {CHAT: 1.0}, rate_share=0.5) == {"r2"}


def _most_on_time(jobs: list[tuple[float, float]], now: float, rate: float) -> int:
    """Brute force: the largest subset whose members, run back to back from ``now`` in order of
    due time, each start by their last start (what Moore-Hodgson maximises)."""
    for size in range(len(jobs), 0, -1):
        for subset in itertools.combinations(jobs, size):
            start = now
            for last_start, service in sorted(subset, key=lambda j: j[0] + j[1] / rate):
                if start > last_start + 1e-9:
                    break
                start += service / rate
            else:
                return size
    return 0


JOBS = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=4.0, allow_nan=False),
        st.floats(min_value=0.01, max_value=3.0, allow_nan=False),
    ),
    min_size=1,
    max_size=7,
)


@settings(max_examples=150, deadline=None)
@given(JOBS, st.floats(min_value=0.5, max_value=3.0), st.floats(min_value=0.0, max_value=1.0))
def test_in_order_of_due_time_it_keeps_as_many_on_time_as_any_choice_could(
    jobs: list[tuple[float, float]], rate: float, now: float
) -> None:
    rows = [
        row(f"r{i}", last_start, service, rank=last_start + service / rate)
        for i, (last_start, service) in enumerate(jobs)
    ]
    demoted = longest_to_demote(rows, now, {CHAT: rate})
    on_time = [(ls, s) for ls, s in jobs if ls >= now]
    kept = [(ls, s) for i, (ls, s) in enumerate(jobs) if f"r{i}" not in demoted and ls >= now]
    assert len(kept) == _most_on_time(on_time, now, rate)


@settings(max_examples=150, deadline=None)
@given(JOBS, st.floats(min_value=0.5, max_value=3.0), st.permutations(range(7)))
def test_in_any_serving_order_what_is_kept_starts_in_time(
    jobs: list[tuple[float, float]], rate: float, ranks: list[int]
) -> None:
    rows = [row(f"r{i}", ls, s, rank=float(ranks[i])) for i, (ls, s) in enumerate(jobs)]
    demoted = longest_to_demote(rows, 0.0, {CHAT: rate})
    start = 0.0
    for _, _, last_start, service, rid in sorted(rows, key=lambda r: r[1]):
        if rid not in demoted:
            assert start <= last_start + 1e-9
            start += service / rate


def test_band_rates_measure_only_intervals_in_which_the_band_waited() -> None:
    rates = BandRates(time_constant_s=100.0)
    rates.close(0.0, [CHAT])
    rates.dispatched(CHAT, 3.0)
    rates.dispatched(MATH, 100.0)  # MATH was not waiting: its dispatches say nothing of its drain
    rates.close(1.0, [CHAT])
    assert rates.rates == {CHAT: pytest.approx(3.0)}
    # a running mean over the first intervals: an empty first interval (dispatch comes in bursts)
    # does not hold the rate near zero for a time constant
    rates.dispatched(CHAT, 1.0)
    rates.close(2.0, [])
    assert rates.rates[CHAT] == pytest.approx(2.0)
    held = rates.rates[CHAT]
    rates.dispatched(CHAT, 50.0)  # not waiting since the last close: not counted
    rates.close(3.0, [])
    assert rates.rates[CHAT] == held
    with pytest.raises(ValueError):
        BandRates(time_constant_s=0.0)


def test_band_rates_become_an_exponential_average_and_forget_bands_that_stopped_waiting() -> None:
    rates = BandRates(time_constant_s=1.0)
    rates.close(0.0, [CHAT, MATH])
    for t in range(1, 21):
        rates.dispatched(CHAT, 2.0)
        rates.close(float(t), [CHAT, MATH] if t < 4 else [CHAT])
    assert rates.rates[CHAT] == pytest.approx(2.0)
    # past the first intervals each one moves the rate by 1 - e^-1 of the way
    rates.dispatched(CHAT, 0.0)
    rates.close(21.0, [CHAT])
    assert rates.rates[CHAT] == pytest.approx(2.0 * math.exp(-1.0))
    # MATH last waited from 3: kept for FORGET_AFTER time constants, then forgotten
    assert MATH in rates.rates
    rates.close(3.0 + BandRates.FORGET_AFTER + 0.5, [CHAT])
    assert MATH not in rates.rates and CHAT in rates.rates


def _item(rid: str, seq: int, priority: int = 0, ttft: float = 2.0, tpot: float = 0.5) -> QueuedRequest:
    view = RequestView(
        request_id=rid, model="m", prompt_tokens=100, max_output_tokens=50, arrival=0.0, priority=priority
    )
    return QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=tpot, seq=seq)


def test_the_queue_serves_demoted_requests_after_the_rest_of_their_level_and_late_ones_last() -> None:
    ctx = OrderContext(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
    queue = AdmissionQueue(LateLast(make_order("slo_tpot")))
    queue.push(_item("late", 1, ttft=0.001), 0.0, ctx)
    for seq, rid in enumerate(["a", "b", "c"], start=2):
        queue.push(_item(rid, seq), 0.0, ctx)
    queue.push(_item("p1", 9, priority=1), 0.0, ctx)
    list(queue.head(0.1, ctx, 10))  # (a cached head must follow the re-keying as well)
    queue.set_demoted(["a", "gone"], True, 0.1, ctx)  # an id no longer queued is skipped
    order = ["b", "c", "a", "p1", "late"]  # a demoted level-0 request still goes before level 1
    assert [i.view.request_id for i in queue.iter_in_order(0.1, ctx, 10)] == order
    assert [i.view.request_id for i in queue.head(0.1, ctx, 10)] == order
    assert queue.get("a") is not None and queue.get("a").demoted  # type: ignore[union-attr]
    queue.set_demoted(["a"], False, 0.2, ctx)
    order = ["a", "b", "c", "p1", "late"]
    assert [i.view.request_id for i in queue.head(0.2, ctx, 10)] == order
    assert [queue.pop(0.2, ctx).view.request_id for _ in range(5)] == order  # type: ignore[union-attr]


def test_a_gap_longer_than_the_callers_planning_is_no_drain_sample() -> None:
    rates = BandRates(time_constant_s=5.0)
    rates.close(0.0, [CHAT])
    rates.dispatched(CHAT, 2.0)
    rates.close(1.0, [CHAT], max_span=2.0)
    assert rates.rates[CHAT] == pytest.approx(2.0)
    # the queue emptied and planning stopped for a minute: the next plan's interval says nothing
    # of the drain (averaged in, it would have pulled the rate to 2 / 61)
    rates.dispatched(CHAT, 2.0)
    rates.close(61.0, [CHAT], max_span=2.0)
    assert rates.rates[CHAT] == pytest.approx(2.0)


def test_demotion_needs_a_queue_order_that_ranks_by_it() -> None:
    with pytest.raises(ValueError, match="demote_longest needs theta"):
        HyperFlexisParams(theta=0.3, demote_longest=True)
    with pytest.raises(ValueError, match="demote_rate_share"):
        HyperFlexisParams(demote_rate_share=0.0)
    assert make_order("slo_tpot").uses_demotion  # type: ignore[attr-defined]
    assert not getattr(make_order("wspt"), "uses_demotion", False)


def test_a_profile_that_demotes_with_an_order_that_ignores_it_is_refused() -> None:
    from gateway.dispatch.profile import dispatcher_config
    from policies.api import PolicyConfigError

    hf = {"name": "hyperflexis", "params": {"demote_longest": True}}
    with pytest.raises(PolicyConfigError, match="demote_longest needs a queue order"):
        dispatcher_config({"dispatcher": hf, "queue_order": {"name": "wspt"}})
    config = dispatcher_config({"dispatcher": hf})  # (slo_tpot by default)
    assert config.hyperflexis is not None and config.hyperflexis.demote_longest
