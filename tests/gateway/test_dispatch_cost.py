"""What one placement costs the dispatch loop, in process: the loop's timer does not spin through
empty steps when the event loop's timers fire early, and the HyperFlexis worker views summed from
the fleet's shadow give the same decisions as the running requests one by one."""

from __future__ import annotations

import asyncio
import random

import uvloop

from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.dispatch.loop import TIMER_TICK_S, DispatchLoop
from gateway.dispatch.offline import offline_fleet
from gateway.router import Router
from policies.pipeline import compile_profile
from policies.queue_order import make_order


def _loop() -> DispatchLoop:
    fleet = offline_fleet({"a": 1})
    pipeline = compile_profile({"scorers": [{"name": "least_load"}]})
    return DispatchLoop(
        DispatchCore(
            fleet,
            Router(fleet, pipeline),
            make_order("fcfs", {}),
            lambda _: ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
            lambda _: ClassLimits(),
            max_engine_load=1,
        )
    )


async def test_a_timer_that_fires_before_its_time_waits_for_it_without_a_step() -> None:
    loop = _loop()  # not started: the task's event shows when a step would run
    at = loop.clock() + 0.004
    loop._arm(at)
    assert loop._timer is not None
    loop._timer.cancel()
    loop._fire()  # as libuv does: ms granularity, a delay rounded to the nearest ms
    assert not loop._event.is_set() and loop._timer is not None and loop._timer_at == at
    await asyncio.sleep(0.02)
    assert loop._event.is_set() and loop._timer is None and loop.clock() >= at


def test_under_uvloop_a_sub_millisecond_timer_is_one_step_not_a_spin() -> None:
    """uvloop runs a delay under half a millisecond as call_soon: before, the step re-armed for the
    rest and the loop spun through empty steps until the time came."""

    async def run() -> tuple[int, int]:
        loop = _loop()
        fires = 0
        fire = loop._fire

        def counted() -> None:
            nonlocal fires
            fires += 1
            fire()

        loop._fire = counted  # type: ignore[method-assign]
        rounds = 20
        for _ in range(rounds):
            at = loop.clock() + random.uniform(0.0002, 0.0015)
            loop._event.clear()
            loop._arm(at)
            await loop._event.wait()
            assert loop.clock() >= at
        return fires, rounds

    fires, rounds = uvloop.run(run())
    # each timer fires once or twice (once more, a tick later, when it came early), never a spin
    assert fires <= 3 * rounds
    assert TIMER_TICK_S == 0.001
