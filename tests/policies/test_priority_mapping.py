"""HyperFlexis Algorithm 2 on literal windows: eq.(6) indexes, spike correction, clamps, contention."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from policies.priority_mapping import (
    PriorityBounds,
    PriorityMappingConfig,
    PriorityMappingState,
    assign,
    initial_state,
    observe_completion,
    priority_index,
    set_pending,
)

WIDE = PriorityBounds(0.001, 100.0, 0.001, 100.0)

# priority.yaml's levels: Table 1 4-task targets ±25%
PAPER_LEVELS = (
    PriorityBounds(0.525, 0.875, 0.375, 0.625),
    PriorityBounds(0.75, 1.25, 0.525, 0.875),
    PriorityBounds(1.5, 2.5, 0.675, 1.125),
    PriorityBounds(15.0, 25.0, 0.75, 1.25),
)


def state_with(
    levels: tuple[PriorityBounds, ...], window: int, rows: list[tuple[int, float, float, float]]
) -> PriorityMappingState:
    """rows: (priority, ttft_s, tpot_s, queue_time_s), oldest first."""
    state = initial_state(PriorityMappingConfig(levels, window))
    for priority, ttft, tpot, queue in rows:
        state = observe_completion(state, priority, ttft, tpot, queue)
    return state


@pytest.mark.parametrize(
    ("priority", "counts", "expected"),
    [
        (0, (4, 4, 4), 0 + 1),  # floor(1/4 * 4)
        (1, (4, 4, 4), 4 + 2),  # floor(2/4 * 4)
        (2, (4, 4, 4), 8 + 3),  # floor(3/4 * 4)
        (0, (3, 0, 0), 0),  # floor(3/4) = 0
        (1, (2, 7, 1), 2 + 3),  # floor(2/4 * 7) = floor(3.5)
        (2, (5, 0, 0), 5),  # nothing of its own: just past the higher priorities
        (0, (10,), 5),  # N = 1: the median
        (3, (1, 2, 3, 10), 6 + 8),  # floor(4/5 * 10)
    ],
)
def test_eq6_index(priority: int, counts: tuple[int, ...], expected: int) -> None:
    assert priority_index(priority, counts) == expected


# 12 completions, 4 per priority, no queueing; sorted TTFT window:
# [0.2, 0.25, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9, 1.1, 1.2, 1.5, 2.0]
# sorted TPOT window:
# [0.02, 0.025, 0.03, 0.04, 0.06, 0.07, 0.08, 0.09, 0.11, 0.12, 0.15, 0.2]
TWELVE = [
    (0, 0.2, 0.02, 0.0),
    (1, 0.6, 0.06, 0.0),
    (2, 1.5, 0.15, 0.0),
    (0, 0.3, 0.03, 0.0),
    (1, 0.8, 0.08, 0.0),
    (2, 1.2, 0.12, 0.0),
    (0, 0.25, 0.025, 0.0),
    (1, 0.7, 0.07, 0.0),
    (2, 2.0, 0.2, 0.0),
    (0, 0.4, 0.04, 0.0),
    (1, 0.9, 0.09, 0.0),
    (2, 1.1, 0.11, 0.0),
]


@pytest.mark.parametrize(
    ("priority", "index", "ttft", "tpot"),
    [(0, 1, 0.25, 0.025), (1, 6, 0.8, 0.08), (2, 11, 2.0, 0.2)],
)
def test_assign_reads_the_eq6_quantile(priority: int, index: int, ttft: float, tpot: float) -> None:
    state = state_with((WIDE,) * 3, 100, TWELVE)
    assert state.counts == (4, 4, 4)
    mapped, _ = assign(state, priority)
    assert (mapped.index, mapped.ttft_s, mapped.tpot_s) == (index, ttft, tpot)
    assert mapped.queue_correction_s == 0.0  # first assignment at this priority


def test_index_past_the_window_is_clamped_to_the_slowest() -> None:
    state = state_with((WIDE,) * 3, 100, [(0, 0.1, 0.01, 0.0), (0, 0.3, 0.03, 0.0), (1, 0.2, 0.02, 0.0)])
    mapped, _ = assign(state, 2)  # base = 3 = window size, C_2 = 0
    assert (mapped.index, mapped.ttft_s, mapped.tpot_s) == (2, 0.3, 0.03)


def test_window_drops_the_oldest_beyond_w() -> None:
    state = state_with(
        (WIDE,) * 2, 3, [(0, 5.0, 0.5, 0.0), (1, 1.0, 0.1, 0.0), (0, 2.0, 0.2, 0.0), (1, 3.0, 0.3, 0.0)]
    )
    assert state.size == 3
    assert state.counts == (1, 2)  # the first (priority 0) completion fell out
    assert [r[0] for r in state.ttft_records] == [1.0, 2.0, 3.0]
    assert [r[0] for r in state.tpot_records] == [0.1, 0.2, 0.3]


def test_sorted_windows_match_brute_force() -> None:
    rng = random.Random(3)
    window = 50
    rows = [(rng.randrange(4), rng.uniform(0, 3), rng.uniform(0, 0.3), rng.uniform(0, 1)) for _ in range(400)]
    state = initial_state(PriorityMappingConfig((WIDE,) * 4, window))
    for i, (p, ttft, tpot, q) in enumerate(rows):
        state = observe_completion(state, p, ttft, tpot, q)
        recent = rows[max(0, i + 1 - window) : i + 1]
        assert [r[:2] for r in state.ttft_records] == sorted((r[1], r[3]) for r in recent)
        assert [r[0] for r in state.tpot_records] == sorted(r[2] for r in recent)
        assert state.counts == tuple(sum(1 for r in recent if r[0] == k) for k in range(4))


def test_observe_returns_a_new_state_and_leaves_the_old_one() -> None:
    before = state_with((WIDE,), 10, [(0, 1.0, 0.1, 0.0)])
    after = observe_completion(before, 0, 2.0, 0.2, 0.0)
    assert before.size == 1 and after.size == 2


def test_queue_spike_correction_follows_algorithm_2() -> None:
    # N = 1: index = floor(C_0 / 2)
    state = state_with((WIDE,), 100, [(0, 1.0, 0.1, 0.4)])
    first, state = assign(state, 0)
    assert (first.ttft_s, first.queue_correction_s) == (1.0, 0.0)  # no previous queue time
    assert state.last_queue_time == (0.4,)

    # a completion that queued 0.5 s longer becomes the reference: its TTFT is deflated by 0.5
    state = observe_completion(state, 0, 1.5, 0.1, 0.9)
    spiked, state = assign(state, 0)
    assert spiked.index == 1
    assert spiked.queue_correction_s == pytest.approx(0.5)
    assert spiked.ttft_s == pytest.approx(1.0)
    assert state.last_queue_time == (0.9,)

    # the same reference again: no further correction (the spike is now the baseline)
    again, state = assign(state, 0)
    assert (again.ttft_s, again.queue_correction_s) == (1.5, 0.0)

    # a reference that queued less than the last one raises the TTFT (literal Algorithm 2)
    state = observe_completion(state, 0, 0.2, 0.1, 0.0)
    state = observe_completion(state, 0, 0.3, 0.1, 0.1)
    dip, state = assign(state, 0)  # sorted [0.2, 0.3, 1.0, 1.5] -> index 2: (1.0, q 0.4)
    assert dip.queue_correction_s == pytest.approx(0.4 - 0.9)
    assert dip.ttft_s == pytest.approx(1.5)


def test_last_queue_time_is_per_priority() -> None:
    state = state_with((WIDE,) * 2, 100, [(0, 1.0, 0.1, 0.3), (1, 2.0, 0.2, 0.7)])
    _, state = assign(state, 1)
    assert state.last_queue_time == (None, 0.7)


@pytest.mark.parametrize(
    ("window_ttft", "window_tpot", "pending", "ttft", "tpot", "contended"),
    [
        # inside P2's range: unchanged
        (2.0, 0.9, {}, 2.0, 0.9, False),
        # above the maximum: clamped to it, contended or not
        (40.0, 3.0, {}, 2.5, 1.125, False),
        (40.0, 3.0, {0: 1}, 2.5, 1.125, True),
        # below P2's own floor, a higher priority waits: the strict floor holds
        (0.1, 0.1, {1: 2}, 1.5, 0.675, True),
        # below the floor with no higher priority waiting: relaxed to P0's floor
        (0.1, 0.1, {}, 0.525, 0.375, False),
        # between P0's floor and P2's floor, uncontended: kept as measured
        (0.9, 0.5, {}, 0.9, 0.5, False),
        # only the same or lower priorities wait: not contention
        (0.9, 0.5, {2: 5, 3: 9}, 0.9, 0.5, False),
    ],
)
def test_clamps_and_contention_rule(
    window_ttft: float,
    window_tpot: float,
    pending: dict[int, int],
    ttft: float,
    tpot: float,
    contended: bool,
) -> None:
    state = state_with(PAPER_LEVELS, 100, [(2, window_ttft, window_tpot, 0.0)])
    state = set_pending(state, pending)
    mapped, _ = assign(state, 2)
    assert (mapped.ttft_s, mapped.tpot_s) == pytest.approx((ttft, tpot))
    assert mapped.contended is contended


def test_fig6_underloaded_low_priority_gets_tight_targets_then_relaxes_under_contention() -> None:
    # first 20 s of Fig. 6: only P3 runs, the fleet is idle and answers in 0.3 s
    state = state_with(PAPER_LEVELS, 500, [(3, 0.3, 0.05, 0.0)] * 20)
    alone, state = assign(state, 3)
    assert (alone.ttft_s, alone.tpot_s) == (0.525, 0.375)  # tighter than P3's own [15, 25]
    # P0 traffic arrives and queues: P3 is held to its strict range again
    state = set_pending(state, [3, 0, 0, 40])
    contended, _ = assign(state, 3)
    assert (contended.ttft_s, contended.tpot_s) == (15.0, 0.75)


def test_a_backlog_holds_a_lone_priority_to_its_own_floor() -> None:
    # P3 alone, answered in 0.3 s, but requests wait for an engine: the fleet is not underloaded
    state = state_with(PAPER_LEVELS, 500, [(3, 0.3, 0.05, 0.0)] * 20)
    relaxed, _ = assign(state, 3)
    assert (relaxed.ttft_s, relaxed.tpot_s, relaxed.contended) == (0.525, 0.375, False)
    held, _ = assign(state, 3, backlog=True)
    assert (held.ttft_s, held.tpot_s, held.contended) == (15.0, 0.75, True)
    # the upper bound and a window above the floor are untouched by it
    slow = state_with(PAPER_LEVELS, 500, [(3, 40.0, 2.0, 0.0)] * 20)
    assert assign(slow, 3, backlog=True)[0].ttft_s == assign(slow, 3)[0].ttft_s == 25.0


def test_highest_priority_is_never_contended() -> None:
    state = set_pending(state_with(PAPER_LEVELS, 10, [(0, 0.1, 0.1, 0.0)]), [7, 7, 7, 7])
    mapped, _ = assign(state, 0)
    assert (mapped.ttft_s, mapped.tpot_s, mapped.contended) == (0.525, 0.375, False)


@pytest.mark.parametrize(
    ("priority", "ttft", "tpot"),
    [(0, 0.7, 0.5), (1, 1.0, 0.7), (2, 2.0, 0.9), (3, 20.0, 1.0)],
)
def test_empty_window_gives_the_range_midpoint(priority: int, ttft: float, tpot: float) -> None:
    state = initial_state(PriorityMappingConfig(PAPER_LEVELS, 500))
    mapped, after = assign(state, priority)
    assert mapped.index is None
    assert (mapped.ttft_s, mapped.tpot_s) == pytest.approx((ttft, tpot))  # Table 1
    assert after is state


def test_set_pending_accepts_sequences_and_mappings() -> None:
    state = initial_state(PriorityMappingConfig(PAPER_LEVELS, 10))
    assert set_pending(state, [1, 2]).pending == (1, 2, 0, 0)
    assert set_pending(state, {3: 4}).pending == (0, 0, 0, 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: assign(s, 4),
        lambda s: assign(s, -1),
        lambda s: observe_completion(s, 4, 1.0, 0.1, 0.0),
        lambda s: observe_completion(s, 0, -1.0, 0.1, 0.0),
        lambda s: observe_completion(s, 0, 1.0, float("nan"), 0.0),
        lambda s: observe_completion(s, 0, 1.0, 0.1, float("inf")),
        lambda s: set_pending(s, {9: 1}),
        lambda s: set_pending(s, [0, -1]),
    ],
)
def test_bad_arguments_raise(call: Callable[[PriorityMappingState], object]) -> None:
    state = initial_state(PriorityMappingConfig(PAPER_LEVELS, 10))
    with pytest.raises(ValueError):
        call(state)


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        PriorityBounds(2.0, 1.0, 0.1, 0.2)
    with pytest.raises(ValueError, match="window"):
        PriorityMappingConfig((WIDE,), 0)
    with pytest.raises(ValueError, match="at least one"):
        PriorityMappingConfig((), 10)
