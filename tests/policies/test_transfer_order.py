"""KV-transfer order: MFS's reverse multi-level queue (MLU promotion, geometric thresholds,
monotonic, top level kept for explicit deadlines) against FIFO."""

from __future__ import annotations

import math

import pytest

from policies.transfer_order import (
    Fifo,
    LinkParams,
    Rmlq,
    TransferQueue,
    TransferRequest,
    make_transfer_order,
    mlu,
    thresholds,
)

#: 1,000 KV tokens per second: a 100-token transfer takes 0.1 s of the whole link
LINK = LinkParams(tokens_per_s=1000.0)
RMLQ = Rmlq(LINK, levels=4)  # thresholds 0.125, 0.03125, 0.0078125


def t(rid: str, tokens: int = 100, deadline: float | None = None) -> TransferRequest:
    return TransferRequest(rid, tokens, deadline)


def test_thresholds_are_geometric() -> None:
    assert thresholds(4) == pytest.approx((0.125, 0.03125, 0.0078125))
    assert thresholds(2, e=2.0, u=1.0) == pytest.approx((0.5,))


@pytest.mark.parametrize(
    ("tokens", "deadline", "now", "link", "expected"),
    [
        (100, 10.0, 0.0, LINK, 0.01),
        (100, 10.0, 9.0, LINK, 0.1),
        (100, 10.0, 0.0, LinkParams(1000.0, load=0.5), 0.02),  # half the link is taken
        (100, 10.0, 10.0, LINK, math.inf),  # due now
        (100, 10.0, 11.0, LINK, math.inf),  # late
        (0, 10.0, 0.0, LINK, 0.0),
    ],
)
def test_mlu(tokens: int, deadline: float, now: float, link: LinkParams, expected: float) -> None:
    assert mlu(tokens, deadline, now, link) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("request_", "now", "level"),
    [
        (t("none", deadline=None), 0.0, 3),  # no deadline: deferred for good
        (t("loose", 100, deadline=100.0), 0.0, 3),  # MLU 0.001 < Q3
        (t("q3", 100, deadline=10.0), 0.0, 2),  # MLU 0.01 in [Q3, Q2)
        (t("q2", 100, deadline=2.0), 0.0, 1),  # MLU 0.05 in [Q2, Q1)
        (t("q1", 100, deadline=0.5), 0.0, 0),  # MLU 0.2 >= Q1
        (t("late", 100, deadline=0.5), 1.0, 0),  # past its deadline
    ],
)
def test_level_for(request_: TransferRequest, now: float, level: int) -> None:
    assert RMLQ.level_for(request_, now) == level


def test_starts_deferred_and_is_promoted_as_its_deadline_nears() -> None:
    queue = RMLQ.push(TransferQueue(), t("a", 100, deadline=100.0), now=0.0)
    assert [e.level for e in queue.entries] == [3]
    levels = []
    for now in (0.0, 90.0, 98.0, 99.5):  # MLU 0.001, 0.01, 0.05, 0.2
        queue = RMLQ.promote(queue, now)
        levels.append(queue.entries[0].level)
    assert levels == [3, 2, 1, 0]


def test_promotion_is_monotonic() -> None:
    """A busier link raises the MLU; when it frees again the transfer keeps its level."""
    busy = Rmlq(LinkParams(1000.0, load=0.9))
    queue = busy.push(TransferQueue(), t("a", 100, deadline=10.0), now=0.0)  # MLU 0.1: level 1
    assert queue.entries[0].level == 1
    calm = Rmlq(LinkParams(1000.0, load=0.0))
    assert calm.level_for(queue.entries[0].request, 0.0) == 2
    assert calm.promote(queue, 0.0).entries[0].level == 1


def test_urgent_overtakes_loose_fifo_does_not() -> None:
    rmlq: TransferQueue = TransferQueue()
    fifo: TransferQueue = TransferQueue()
    for req in (t("loose", 600, deadline=20.0), t("urgent", 100, deadline=0.4)):
        rmlq = RMLQ.push(rmlq, req, 0.0)
        fifo = Fifo().push(fifo, req, 0.0)
    first, _ = RMLQ.pop(rmlq, 0.0)
    assert first is not None and first.request.request_id == "urgent"
    first, _ = Fifo().pop(fifo, 0.0)
    assert first is not None and first.request.request_id == "loose"


def test_same_level_keeps_arrival_order() -> None:
    queue = TransferQueue()
    for rid in ("a", "b", "c"):
        queue = RMLQ.push(queue, t(rid, 100, deadline=0.5), 0.0)  # all level 0
    order = []
    while queue.entries:
        entry, queue = RMLQ.pop(queue, 0.0)
        assert entry is not None
        order.append(entry.request.request_id)
    assert order == ["a", "b", "c"]


def test_top_level_is_kept_for_explicit_deadlines() -> None:
    """A transfer without a deadline is never promoted, however long it waits: one with a
    deadline that came later overtakes it once promoted, but not while both are deferred."""
    queue = RMLQ.push(TransferQueue(), t("no-deadline", 10), 0.0)
    queue = RMLQ.push(queue, t("loose", 100, deadline=1000.0), 500.0)
    entry, _ = RMLQ.pop(queue, 900.0)  # both in the lowest level: first come
    assert entry is not None and entry.request.request_id == "no-deadline"
    entry, queue = RMLQ.pop(queue, 999.5)  # loose: MLU 0.2, top level
    assert entry is not None and entry.request.request_id == "loose"
    assert queue.entries[0].level == RMLQ.lowest
    entry, queue = RMLQ.pop(queue, 900.0)
    assert entry is not None and entry.request.request_id == "no-deadline" and len(queue) == 0


def test_loose_transfer_is_not_starved_once_due() -> None:
    """A deferred transfer promoted by time overtakes urgent newcomers of lower levels."""
    queue = RMLQ.push(TransferQueue(), t("old", 100, deadline=10.0), 0.0)  # level 2
    queue = RMLQ.push(queue, t("new", 100, deadline=19.5), 9.0)  # MLU 0.0095: level 2, later seq
    entry, _ = RMLQ.pop(queue, 9.8)  # old: MLU 0.5 -> level 0
    assert entry is not None and entry.request.request_id == "old"


def test_empty_queue() -> None:
    for order in (RMLQ, Fifo()):
        entry, queue = order.pop(TransferQueue(), 0.0)
        assert entry is None and len(queue) == 0


def test_pure_queue_values() -> None:
    before = RMLQ.push(TransferQueue(), t("a", 100, deadline=1.0), 0.0)
    snapshot = before
    RMLQ.pop(before, 0.0)
    RMLQ.push(before, t("b"), 0.0)
    assert before == snapshot and len(before) == 1


def test_make_transfer_order() -> None:
    assert isinstance(make_transfer_order("rmlq", LINK), Rmlq)
    assert isinstance(make_transfer_order("fifo", LINK), Fifo)
    with pytest.raises(ValueError, match="unknown transfer order"):
        make_transfer_order("edf", LINK)
    with pytest.raises(ValueError):
        Rmlq(LINK, levels=1)
