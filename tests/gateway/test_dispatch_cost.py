"""What one placement costs the dispatch loop, in process: the loop's timer does not spin through
empty steps when the event loop's timers fire early, and the HyperFlexis worker views summed from
the fleet's shadow predict exactly what the running requests one by one do."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.dispatch import core as core_module
from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.dispatch.loop import TIMER_TICK_S, DispatchLoop
from gateway.dispatch.offline import offline_core, offline_fleet
from gateway.dispatch.workers import HyperFlexisWorkers
from gateway.fleet.registry import RunningEntry
from gateway.router import Router
from policies import hyperflexis as hyperflexis_module
from policies.api import EngineState, RequestView
from policies.hyperflexis import (
    HyperFlexisParams,
    RunningLoad,
    RunningRequest,
    WorkerView,
    _Shadow,
    dispatch,
    kv_bound,
    tpot_floor,
)
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL, predict_decode, predict_prefill
from policies.pipeline import compile_profile
from policies.queue_order import QueuedRequest, make_order

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
    floor = tpot_floor(coeffs)  # (what the gateway's views leave out, as the shadow's adds do)
    shadow = _Shadow(WorkerView("w", coeffs, coeffs, load=RunningLoad.of(requests, floor)))
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
    assert shadow.min_tpot == min([r.tpot_slo for r in requests if r.tpot_slo >= floor], default=math.inf)
    assert (shadow.count, shadow.waiting_tokens) == (len(requests), sum(waiting))


_running = st.lists(
    st.tuples(st.integers(1, 2000), st.integers(0, 100), st.sampled_from([0.03, 0.1, 0.5]), st.booleans()),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(_running, st.integers(0, 3000), st.sampled_from([-math.inf, 0.0, 0.5])),
        min_size=1,
        max_size=5,
    ),
    st.lists(
        st.tuples(st.integers(1, 2000), st.floats(-3.0, 0.9), st.sampled_from([0.3, 1.0, 5.0])), max_size=20
    ),
)
def test_parking_the_leading_kv_bound_workers_is_what_the_policy_does_with_them(
    spec: list[tuple[list[tuple[int, int, float, bool]], int, float]],
    queue: list[tuple[int, float, float]],
) -> None:
    """The core parks the workers first in a turn that kv_bound says fit nothing, without the
    policy call: the policy gives them maturity inf and lists them full, and decides the same for
    the others with or without them."""
    items = [
        QueuedRequest(RequestView(f"q{i}", "m", prompt, 100, arrival=arrival), ttft, 0.1, seq=i)
        for i, (prompt, arrival, ttft) in enumerate(queue)
    ]
    items.sort(key=lambda q: (q.ttft_deadline, q.seq))
    min_need = min((q.view.prompt_tokens + q.view.max_output_tokens for q in items), default=0)
    workers = [
        WorkerView(f"w{i}", PREFILL, DECODE, tuple(RunningRequest(*r) for r in running), kv, 8, maturity)
        for i, (running, kv, maturity) in enumerate(spec)
    ]
    workers.sort(key=lambda w: w.maturity)  # the order the core pops them in
    lead = 0
    while lead < len(workers) and kv_bound(workers[lead], min_need):
        lead += 1
    whole = dispatch(items, workers, 1.0, HyperFlexisParams(), 1.0, None, min_need)
    if items:
        for w in workers[:lead]:
            assert whole.maturity[w.engine_id] == math.inf and w.engine_id in whole.full
    if items and lead < len(workers):
        rest = dispatch(items, workers[lead:], 1.0, HyperFlexisParams(), 1.0, None, min_need)
        lead_ids = {w.engine_id for w in workers[:lead]}
        assert rest.assignments == whole.assignments and rest.prefill_s == whole.prefill_s
        assert rest.maturity == {e: t for e, t in whole.maturity.items() if e not in lead_ids}
        assert rest.full == whole.full - lead_ids


def test_a_kv_bound_worker_is_parked_full_without_reading_the_queue_or_a_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy engines, each with less KV free than any queued request needs: steps park the
    mature ones as full without a policy call, and a completion brings one back."""
    fleet = offline_fleet({"a": 4})
    core = offline_core(fleet, dispatcher="hyperflexis", order="slo_tpot", tightest_ttft_s=5.0)
    for engine_id in fleet.records:
        fleet.record_state(engine_id, EngineState(kv_usage=0.0, block_size=16, num_gpu_blocks=25), 0.0)
        fleet.reserve(engine_id, f"{engine_id}-busy", RunningEntry(300, 50, 0.1, 0.0))
    calls: list[int] = []

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(id(fn))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(core_module, "hyperflexis_dispatch", counted(hyperflexis_module.dispatch))
    # (nor a view of one: under saturation half the workers a turn pops are such)
    monkeypatch.setattr(HyperFlexisWorkers, "_view", counted(HyperFlexisWorkers._view))
    view = RequestView("r-1", "a", 200, 50, arrival=0.0)
    assert core.submit(core.ticket(view, 5.0, 0.1, "c", RunningEntry(200, 50, 0.1, 0.0), 0.0), 0.0) is None
    for _ in fleet.records:  # one mature worker per step and queued request
        core.step(0.0)
    assert calls == [] and core.queued() == 1
    assert all(core.workers.maturity[e] == math.inf for e in fleet.records)
    fleet.release("a-2", "a-2-busy")  # its cache frees: it takes the request
    core.step(0.01)
    assert calls.count(id(hyperflexis_module.dispatch)) == 1 and core.queued() == 0
    assert [(rid, getattr(r, "engine_id", None)) for rid, r in core.outbox] == [("r-1", "a-2")]


def _hyperflexis_core(order: str, through_queue: bool) -> DispatchCore:
    fleet = offline_fleet({"a": 3})
    for engine_id in fleet.records:
        fleet.record_state(engine_id, EngineState(kv_usage=0.0, block_size=16, num_gpu_blocks=60), 0.0)
    core = offline_core(
        fleet,
        dispatcher="hyperflexis",
        order=order,
        tightest_ttft_s=0.5,
        limits=ClassLimits(max_queued=50, queue_timeout_s=2.0),
    )
    core._flow_order = through_queue  # forces every arrival through the queue, as before
    return core


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["slo_tpot", "fcfs", "sedf", "kairos"]),
    st.lists(
        st.tuples(
            st.sampled_from(["arrive", "arrive", "arrive", "first", "finish", "step"]),
            st.integers(1, 900),
            st.sampled_from([0.3, 1.0, 5.0]),
            st.floats(0.0, 0.05),
        ),
        max_size=80,
    ),
)
def test_an_arrival_to_an_empty_queue_is_decided_as_if_it_had_been_queued(
    order: str, events: list[tuple[str, int, float, float]]
) -> None:
    """The turn that reads an arrival from its ticket (empty queue) decides what the turn over
    the queue holding it did: same engines, refusals, workers' maturities, at every event."""
    cores = [_hyperflexis_core(order, through_queue) for through_queue in (False, True)]
    traces: list[list[tuple[Any, ...]]] = [[], []]
    for core, trace in zip(cores, traces, strict=True):
        now, n = 0.0, 0
        placed: list[tuple[str, str]] = []
        for kind, tokens, ttft, dt in events:
            now += dt
            if kind == "arrive":
                n += 1
                view = RequestView(f"r-{n}", "a", tokens, 100, arrival=now)
                entry = RunningEntry(tokens, 100, 0.1, now)
                try:
                    record = core.submit(core.ticket(view, ttft, 0.1, "c", entry, now), now)
                except GatewayError as exc:
                    trace.append(("refused", view.request_id, exc.code))
                    continue
                if record is not None:
                    placed.append((view.request_id, record.engine_id))
                    trace.append(("at once", view.request_id, record.engine_id))
            elif kind == "first" and placed:
                rid, engine_id = placed[tokens % len(placed)]
                core.fleet.mark_prefilled(engine_id, rid)
            elif kind == "finish" and placed:
                rid, engine_id = placed.pop(tokens % len(placed))
                core.fleet.release(engine_id, rid)
            else:
                core.step(now)
            for rid, result in core.outbox:
                if isinstance(result, GatewayError):
                    trace.append(("refused", rid, result.code))
                else:
                    placed.append((rid, result.engine_id))
                    trace.append(("queued, then", rid, result.engine_id))
            core.outbox.clear()
            trace.append(("state", core.queued(), sorted(core.workers.maturity.items())))
    assert traces[0] == traces[1]
    # and the fast path was taken at all
    assert any(t[0] == "at once" for t in traces[0]) or not any(e[0] == "arrive" for e in events)


def test_an_arrival_placed_at_once_is_counted_as_a_zero_wait_and_never_queued() -> None:
    core = _hyperflexis_core("slo_tpot", through_queue=False)

    def waits() -> tuple[float | None, float | None]:
        labels = {"slo_class": "c-at-once"}
        return (
            metrics.REGISTRY.get_sample_value("slogate_queue_wait_seconds_count", labels),
            metrics.REGISTRY.get_sample_value("slogate_queue_wait_seconds_bucket", {**labels, "le": "0.005"}),
        )

    view = RequestView("r-1", "a", 100, 50, arrival=0.0)
    record = core.submit(core.ticket(view, 1.0, 0.1, "c-at-once", RunningEntry(100, 50, 0.1, 0.0), 0.0), 0.0)
    assert record is not None and "r-1" in record.running
    assert core.queued() == 0 and len(core.queues["a"]._order) == 0  # never went through the queue
    assert core.queued_per_class[("a", "c-at-once")] == 0
    assert waits() == (1.0, 1.0)


def test_a_pipeline_placement_at_once_is_a_zero_wait_too() -> None:
    """HyperFlexis counted its placements at once as a wait of 0 and the pipeline dispatcher did
    not count them: the same series meant two things, and its percentiles changed with the
    routing profile at the same load."""
    fleet = offline_fleet({"a": 1})
    core = DispatchCore(
        fleet,
        Router(fleet, compile_profile({"scorers": [{"name": "least_load"}]})),
        make_order("fcfs", {}),
        lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE),
        lambda _: ClassLimits(),
    )
    labels = {"slo_class": "c-pipeline-at-once"}
    view = RequestView("r-1", "a", 100, 50, arrival=0.0)
    ticket = core.ticket(view, 1.0, 0.1, "c-pipeline-at-once", RunningEntry(100, 50, 0.1, 0.0), 0.0)
    assert core.submit(ticket, 0.0) is not None
    assert metrics.REGISTRY.get_sample_value("slogate_queue_wait_seconds_count", labels) == 1.0
    assert metrics.REGISTRY.get_sample_value("slogate_queue_wait_seconds_sum", labels) == 0.0


def test_deferred_metrics_read_as_if_observed_directly() -> None:
    """Histogram observations and gauge moves made through deferred children are in the registry's
    next collection: the same buckets, count, sum and level as direct updates give."""
    direct_h, direct_g = metrics.POLICY_CALL.labels("test:direct"), metrics.QUEUE_DEPTH.labels("test-direct")
    late_h = metrics.deferred(metrics.POLICY_CALL, "test:deferred")
    late_g = metrics.deferred(metrics.QUEUE_DEPTH, "test-deferred")
    values = [0.0, 1e-6, 3e-6, 5e-6, 2e-5, 0.02, 0.025, 0.03, 7.0, -1.0, 0.5e-6]
    for v in values:
        direct_h.observe(v)
        late_h.observe(v)
    for step in (1, 1, -1, 1, -1, -1, 1):
        (direct_g.inc if step > 0 else direct_g.dec)()
        (late_g.inc if step > 0 else late_g.dec)()

    def samples(plugin: str, cls: str) -> dict[tuple[str, str], float]:
        got = {}
        for family in metrics.REGISTRY.collect():
            for s in family.samples:
                if s.labels.get("plugin") == plugin or s.labels.get("slo_class") == cls:
                    got[(s.name, s.labels.get("le", ""))] = s.value
        return got

    assert samples("test:deferred", "test-deferred") == samples("test:direct", "test-direct")
    assert samples("test:deferred", "test-deferred")[("slogate_policy_call_seconds_count", "")] == len(values)
    late_h.observe(1e-4)  # and again after a collection
    assert samples("test:deferred", "-")[("slogate_policy_call_seconds_count", "")] == len(values) + 1
