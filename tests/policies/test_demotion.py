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
from policies.demotion import Band, BandRates, Row, longest_to_demote
from policies.hyperflexis import HyperFlexisParams
from policies.queue_order import LateLast, OrderContext, QueuedRequest, make_order

CHAT: Band = (0.0, 2.0, 0.5)
MATH: Band = (0.0, 0.7, 0.2)


def row(rid: str, last_start: float, service_s: float, band: Band = CHAT, seq: int | None = None) -> Row:
    return (band, last_start, service_s, int(rid[1:]) if seq is None else seq, rid)


def test_a_band_that_keeps_up_demotes_nothing() -> None:
    rows = [row("r1", 5.0, 1.0), row("r2", 5.0, 1.0), row("r3", 6.0, 2.0)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == set()


def test_an_overloaded_band_gives_up_its_longest_request_not_the_one_that_turns_late() -> None:
    # at 1 service-second per second, r1 (due first) runs 0-2; r2 would start at 2, past its last
    # start 1.6: giving up r1 (the longest so far) lets r2 start at once
    rows = [row("r1", 0.0, 2.0), row("r2", 1.6, 0.5)]
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0}) == {"r1"}


def test_bands_drain_separately_and_a_band_without_a_measured_rate_demotes_nothing() -> None:
    rows = [row("r1", 0.0, 2.0), row("r2", 1.6, 0.5), row("r3", 0.0, 2.0, MATH), row("r4", 1.6, 0.5, MATH)]
    # MATH drains 10x faster: both its requests start in time
    assert longest_to_demote(rows, 0.0, {CHAT: 1.0, MATH: 10.0}) == {"r1"}
    assert longest_to_demote(rows, 0.0, {MATH: 1.0}) == {"r3"}
    assert longest_to_demote(rows, 0.0, {CHAT: 0.0, MATH: -1.0}) == set()


def test_late_requests_are_left_to_the_queue_and_the_rate_share_plans_with_a_margin() -> None:
    rows = [row("r1", 2.0, 1.0), row("r2", 2.0, 1.0), row("late", 0.5, 9.0, seq=0)]
    # "late" turned late before now (its last start 0.5 < 1): not demoted, and it takes no drain
    assert longest_to_demote(rows, 1.0, {CHAT: 1.0}) == set()
    # at half the measured rate r2 would start at 3 > 2
    assert len(longest_to_demote(rows, 1.0, {CHAT: 1.0}, rate_share=0.5)) == 1


def _most_on_time(jobs: list[tuple[float, float]], rate: float) -> int:
    """Brute force: the largest subset whose members, run back to back in order of due time,
    each start by their last start (what Moore-Hodgson maximises)."""
    best = 0
    for size in range(len(jobs), 0, -1):
        for subset in itertools.combinations(jobs, size):
            finish = 0.0
            ok = True
            for last_start, service in sorted(subset, key=lambda j: j[0] + j[1] / rate):
                if finish > last_start + 1e-12:
                    ok = False
                    break
                finish += service / rate
            if ok:
                return size
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=4.0, allow_nan=False),
            st.floats(min_value=0.01, max_value=3.0, allow_nan=False),
        ),
        min_size=1,
        max_size=7,
    ),
    st.floats(min_value=0.5, max_value=3.0),
)
def test_demotion_keeps_as_many_requests_on_time_as_any_choice_could(
    jobs: list[tuple[float, float]], rate: float
) -> None:
    rows = [row(f"r{i}", last_start, service) for i, (last_start, service) in enumerate(jobs)]
    demoted = longest_to_demote(rows, 0.0, {CHAT: rate})
    kept = [(ls, s) for i, (ls, s) in enumerate(jobs) if f"r{i}" not in demoted]
    # what is kept is on time as planned...
    finish = 0.0
    for last_start, service in sorted(kept, key=lambda j: j[0] + j[1] / rate):
        assert finish <= last_start + 1e-9
        finish += service / rate
    # ...and no other choice keeps more
    assert len(kept) == _most_on_time(jobs, rate)


def test_band_rates_measure_only_intervals_in_which_the_band_waited() -> None:
    rates = BandRates(time_constant_s=1.0)
    rates.close(0.0, [CHAT])
    rates.dispatched(CHAT, 3.0)
    rates.dispatched(MATH, 100.0)  # MATH was not waiting: its dispatches say nothing of its drain
    rates.close(1.0, [CHAT])
    assert rates.rates == {CHAT: pytest.approx(3.0)}
    rates.dispatched(CHAT, 1.0)
    rates.close(2.0, [])  # a 1 service-s/s interval, averaged in with weight 1 - e^-1
    assert rates.rates[CHAT] == pytest.approx(3.0 + (1 - math.exp(-1.0)) * (1.0 - 3.0))
    held = rates.rates[CHAT]
    rates.dispatched(CHAT, 50.0)  # not waiting since the last close: not counted
    rates.close(3.0, [])
    assert rates.rates[CHAT] == held
    with pytest.raises(ValueError):
        BandRates(time_constant_s=0.0)


def _item(rid: str, seq: int, ttft: float = 2.0, tpot: float = 0.5) -> QueuedRequest:
    view = RequestView(request_id=rid, model="m", prompt_tokens=100, max_output_tokens=50, arrival=0.0)
    return QueuedRequest(view=view, ttft_slo=ttft, tpot_slo=tpot, seq=seq)


def test_the_queue_serves_demoted_requests_after_every_request_still_on_time_and_before_late_ones() -> None:
    ctx = OrderContext(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
    queue = AdmissionQueue(LateLast(make_order("slo_tpot")))
    queue.push(_item("late", 1, ttft=0.001), 0.0, ctx)
    for seq, rid in enumerate(["a", "b", "c"], start=2):
        queue.push(_item(rid, seq), 0.0, ctx)
    queue.set_demoted(["a", "gone"], True, 0.1, ctx)  # an id no longer queued is skipped
    assert [i.view.request_id for i in queue.iter_in_order(0.1, ctx, 10)] == ["b", "c", "a", "late"]
    assert queue.get("a") is not None and queue.get("a").demoted  # type: ignore[union-attr]
    queue.set_demoted(["a"], False, 0.2, ctx)
    assert [i.view.request_id for i in queue.iter_in_order(0.2, ctx, 10)] == ["a", "b", "c", "late"]
    assert [queue.pop(0.2, ctx).view.request_id for _ in range(4)] == ["a", "b", "c", "late"]  # type: ignore[union-attr]


def test_demotion_needs_the_queue_that_keeps_late_requests_behind() -> None:
    with pytest.raises(ValueError, match="demote_longest"):
        HyperFlexisParams(theta=0.3, demote_longest=True)
    with pytest.raises(ValueError, match="demote_rate_share"):
        HyperFlexisParams(demote_rate_share=0.0)
    assert HyperFlexisParams(demote_longest=True).demote_longest
