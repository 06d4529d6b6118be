"""What one placement costs the dispatch loop, in process: the loop's timer does not spin through
empty steps when the event loop's timers fire early, and the HyperFlexis worker views summed from
the fleet's shadow predict exactly what the running requests one by one do."""

from __future__ import annotations

import asyncio
import math
import random

import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.dispatch.loop import TIMER_TICK_S, DispatchLoop
from gateway.dispatch.offline import offline_fleet
from gateway.dispatch.workers import HyperFlexisWorkers
from gateway.fleet.registry import RunningEntry
from gateway.router import Router
from policies.hyperflexis import RunningLoad, RunningRequest, WorkerView, _Shadow
from policies.latency_fit import predict_decode, predict_prefill
from policies.pipeline import compile_profile
from policies.queue_order import make_order

PREFILL = (0.02, 1e-4, 1e-8)
DECODE = (0.01, 1e-6, 1e-4)


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


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["reserve", "reserve", "prefilled", "tokens", "release"]),
            st.integers(0, 11),
            st.integers(1, 400),
            st.sampled_from([0.02, 0.05, 0.1, 0.2]),
            st.booleans(),
        ),
        max_size=60,
    )
)
def test_a_workers_summed_view_is_its_running_requests_summed(
    ops: list[tuple[str, int, int, float, bool]],
) -> None:
    """Whatever came, streamed and went, the view's sums are the running requests' own."""
    fleet = offline_fleet({"a": 2})
    workers = HyperFlexisWorkers(fleet, lambda _: (PREFILL, DECODE), None)
    for op, n, tokens, tpot, prefilled in ops:
        engine_id, rid = f"a-{n % 2}", f"r-{n}"
        record = fleet.records[engine_id]
        if op == "reserve" and all(rid not in r.running for r in fleet.records.values()):
            fleet.reserve(engine_id, rid, RunningEntry(tokens, 50, tpot, 0.0, prefilled=prefilled))
        elif op == "prefilled":
            fleet.mark_prefilled(engine_id, rid)
        elif op == "tokens" and rid in record.running:
            fleet.add_generated(record, record.running[rid], tokens % 7)
        elif op == "release":
            fleet.release(engine_id, rid)
        for record in fleet.records.values():
            one_by_one = RunningLoad.of(
                RunningRequest(e.prompt_tokens, e.generated, e.tpot_slo, e.prefilled)
                for e in record.running.values()
            )
            assert workers._view(record, 0.0).load == one_by_one


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 5000),
            st.integers(0, 500),
            st.sampled_from([0.005, 0.03, 0.1, 0.5, math.inf]),
            st.booleans(),
        ),
        max_size=12,
    ),
    st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.02, 0.1, 1.0])), max_size=4),
    st.tuples(st.floats(0.0, 0.1), st.floats(0.0, 1e-3), st.floats(0.0, 1e-6)),
)
def test_summed_running_requests_predict_what_the_requests_one_by_one_do(
    running: list[tuple[int, int, float, bool]],
    taken: list[tuple[int, float]],
    coeffs: tuple[float, float, float],
) -> None:
    """Eq.(1) over the waiting prompts, eq.(2) over the batch and the tightest TPOT, from the sums
    a turn keeps (with what it takes added), are bit for bit the ones over the request list."""
    requests = [RunningRequest(*r) for r in running]
    shadow = _Shadow(WorkerView("w", coeffs, coeffs, load=RunningLoad.of(requests)))
    for prompt, tpot in taken:
        shadow.add(prompt, tpot)
        requests.append(RunningRequest(prompt, 0, tpot, False))
    waiting = [r.prompt_tokens for r in requests if not r.prefilled]
    assert shadow.prefill(coeffs) == (predict_prefill(coeffs, waiting) if waiting else 0.0)
    decode = (
        predict_decode(coeffs, sum(r.prompt_tokens + r.generated for r in requests), len(requests))
        if requests
        else 0.0
    )
    assert shadow.decode_step(coeffs) == decode
    assert shadow.min_tpot == min([r.tpot_slo for r in requests], default=math.inf)
    assert (shadow.count, shadow.waiting_tokens) == (len(requests), sum(waiting))
