"""Requests pinned to one engine (:attr:`RequestView.engine`: a Responses API request continuing a
response that engine stored) in the dispatch core and loop: placed only there, queued while it is
full without holding back what other engines could take, moved there when a HyperFlexis worker
of another engine took it, and refused when that engine has left."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.api.errors import GatewayError
from gateway.dispatch.core import ClassLimits, DispatchCore, Ticket
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.offline import offline_core, offline_fleet
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.router import Router
from policies.api import RequestView
from policies.hyperflexis import HyperFlexisParams
from policies.pipeline import compile_profile
from policies.queue_order import make_order
from tests.gateway.test_dispatch_core import ticket


def pinned(rid: str, engine: str, now: float = 0.0) -> Ticket:
    plain = ticket(rid, now=now)
    view = dataclasses.replace(plain.item.view, engine=engine)
    return Ticket(dataclasses.replace(plain.item, view=view), "c", plain.entry, now)


def test_a_pinned_request_goes_only_to_its_engine() -> None:
    fleet = offline_fleet({"a": 3})
    core = offline_core(fleet)
    for i in range(4):  # (least load alone would spread them over the three)
        placed = core.submit(pinned(f"r-{i}", "a-2"), 0.0)
        assert placed is not None and placed.engine_id == "a-2"
    assert {e: r.in_flight for e, r in fleet.records.items()} == {"a-0": 0, "a-1": 0, "a-2": 4}


def test_a_pinned_head_waiting_for_its_full_engine_does_not_hold_back_the_others() -> None:
    fleet = offline_fleet({"a": 3})
    core = offline_core(fleet, max_engine_load=1)
    first = core.submit(pinned("r-0", "a-0"), 0.0)
    assert first is not None and first.engine_id == "a-0"
    assert core.submit(pinned("r-1", "a-0"), 0.0) is None  # a-0 is full: it waits at the head
    placed = [core.submit(ticket(f"r-{i}"), 0.0) for i in (2, 3)]
    core.step(0.0)
    engines = {rid: record.engine_id for rid, record in core.outbox if isinstance(record, EngineRecord)}
    engines.update({f"r-{i}": p.engine_id for i, p in zip((2, 3), placed, strict=True) if p is not None})
    assert sorted(engines[r] for r in ("r-2", "r-3")) == ["a-1", "a-2"]
    assert core.queued() == 1
    core.outbox.clear()
    fleet.release("a-0", "r-0")
    core.step(0.1)
    assert [(rid, r.engine_id) for rid, r in core.outbox if isinstance(r, EngineRecord)] == [("r-1", "a-0")]


def test_a_queued_request_pinned_to_an_engine_that_leaves_is_refused_at_once() -> None:
    fleet = offline_fleet({"a": 2})
    core = offline_core(fleet, max_engine_load=1)
    assert core.submit(pinned("r-0", "a-0"), 0.0) is not None
    assert core.submit(pinned("r-1", "a-0"), 0.0) is None  # waits for a-0
    assert core.submit(ticket("r-2"), 0.0) is None
    core.step(0.0)  # (r-2 goes to a-1 past the pinned head)
    assert core.submit(ticket("r-3"), 0.0) is None  # waits for any engine
    core.outbox.clear()
    fleet.eject("a-0", "gone")
    refused = [(rid, r) for rid, r in core.outbox if isinstance(r, GatewayError)]
    assert [(rid, r.status, r.code) for rid, r in refused] == [("r-1", 503, "engine_unavailable")]
    assert core.queued() == 1  # the unpinned one still waits for a-1


def _hyperflexis_loop(engines: int, max_engine_load: int | None = None) -> DispatchLoop:
    fleet = offline_fleet({"a": engines})
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    return DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            make_order("slo_tpot", {}),
            lambda _: ((0.025, 1e-4, 0.0), (0.012, 4e-8, 1e-4)),
            lambda _: ClassLimits(queue_timeout_s=5.0),
            hyperflexis=HyperFlexisParams(),
            max_engine_load=max_engine_load,
        )
    )


def _view(rid: str, engine: str | None) -> RequestView:
    return RequestView(request_id=rid, model="a", prompt_tokens=50, max_output_tokens=10, engine=engine)


async def test_hyperflexis_places_a_pinned_request_on_its_engine_whichever_worker_took_it() -> None:
    loop = _hyperflexis_loop(4)
    loop.start()
    try:
        for i in range(6):
            placed = await loop.place(_view(f"r-{i}", "a-3"), 1.0, 0.1, "c", RunningEntry(50, 10, 0.1, 0.0))
            assert placed.engine_id == "a-3"
        assert {e: r.in_flight for e, r in loop.fleet.records.items()} == {
            "a-0": 0,
            "a-1": 0,
            "a-2": 0,
            "a-3": 6,
        }
    finally:
        await loop.stop()


async def test_hyperflexis_keeps_a_pinned_engine_within_its_limit_while_the_others_idle() -> None:
    """Only the pinned engine's own worker takes its pinned requests, within what it may hold:
    the rest wait for it (moved there by another engine's worker, they ran over its limit)."""
    loop = _hyperflexis_loop(4, max_engine_load=2)
    loop.start()
    try:
        entry = lambda: RunningEntry(50, 10, 0.1, 0.0)  # noqa: E731
        tasks = [
            asyncio.create_task(loop.place(_view(f"r-{i}", "a-3"), 5.0, 0.1, "c", entry())) for i in range(4)
        ]
        await asyncio.sleep(0.3)
        placed = [t.result() for t in tasks if t.done()]
        assert [r.engine_id for r in placed] == ["a-3", "a-3"]
        assert {e: r.in_flight for e, r in loop.fleet.records.items()} == {
            "a-0": 0,
            "a-1": 0,
            "a-2": 0,
            "a-3": 2,
        }
        done = next(rid for rid in loop.fleet.records["a-3"].running)
        loop.release("a-3", done)
        await asyncio.sleep(0.3)
        assert sum(t.done() for t in tasks) == 3 and loop.fleet.records["a-3"].in_flight == 2
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await loop.stop()


async def test_a_request_pinned_to_an_engine_that_left_is_refused() -> None:
    loop = _hyperflexis_loop(2)
    loop.start()
    try:
        loop.fleet.eject("a-1", "gone")
        with pytest.raises(GatewayError) as refused:
            await loop.place(_view("r-0", "a-1"), 1.0, 0.1, "c", RunningEntry(50, 10, 0.1, 0.0))
        assert refused.value.status == 503
        assert all(r.in_flight == 0 for r in loop.fleet.records.values())
    finally:
        await loop.stop()
