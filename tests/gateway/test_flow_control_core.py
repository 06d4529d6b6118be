"""The dispatch core's saturation-shedding hook (llm-d-style flow control) and the routing-profile
keys of the strong baselines: the least urgent band's newest request is refused with a 429 when
the pool is saturated, through the core's one refusal path, and a property test over random
events in which every counter, ticket and index entry returns to zero."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.errors import GatewayError
from gateway.dispatch.build import (
    RoutingProfile,
    build_core,
    engine_scheduling_warnings,
    profile_engine_scheduling,
    with_profile_engines,
)
from gateway.dispatch.core import ClassLimits, DispatchCore, Ticket
from gateway.dispatch.offline import fleet_of, offline_core, offline_fleet
from gateway.dispatch.profile import dispatcher_config
from gateway.dispatch.slo_service import SloService
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from gateway.settings import DEFAULT_PROFILES_DIR, EngineConfig, Settings
from policies.api import PolicyConfigError, RequestView
from policies.flow_control import SheddingParams
from policies.pipeline import compile_profile
from policies.queue_order import FlowControl, QueuedRequest, Wspt

# the offline core's latency prior: 0.025 s + 100 tokens at 10,000 tokens/s = 0.035 s of
# prefill per queued 100-token request per engine


def ticket(
    seq: int,
    *,
    band: int = 0,
    tenant: str = "default",
    model: str = "a",
    now: float = 0.0,
    timeout: float = 30.0,
) -> Ticket:
    view = RequestView(
        request_id=f"r-{seq}",
        model=model,
        prompt_tokens=100,
        max_output_tokens=10,
        arrival=now,
        tenant=tenant,
        priority=band,
    )
    item = QueuedRequest(view=view, ttft_slo=1.0, tpot_slo=0.1, seq=seq, queue_deadline=now + timeout)
    return Ticket(item, "c", RunningEntry(100, 10, 0.1, now), now)


def shedding_core(fleet: Fleet, max_queue_s: float = 0.1, min_band: int | None = None) -> DispatchCore:
    return offline_core(
        fleet,
        order="flow_control",
        max_engine_load=1,
        shedding=SheddingParams(max_queue_s=max_queue_s, min_band=min_band),
        limits=ClassLimits(max_queued=1000),
    )


def test_a_saturated_pool_sheds_the_arrival_when_it_is_in_the_least_urgent_band() -> None:
    fleet = offline_fleet({"a": 1})
    core = shedding_core(fleet)  # 0.1 s: the fourth queued request is beyond it
    assert core.submit(ticket(0), 0.0) is not None  # the engine's one seat
    for seq in range(1, 3):
        assert core.submit(ticket(seq), 0.0) is None
    with pytest.raises(GatewayError) as shed:
        core.submit(ticket(3), 0.0)
    assert (shed.value.status, shed.value.code) == (429, "pool_saturated")
    assert core.queued() == 2 and core.queued_per_class == {("a", "c"): 2} and "r-3" not in core.tickets
    assert core.outbox == []


def test_a_more_urgent_arrival_sheds_the_least_urgent_bands_newest_instead() -> None:
    fleet = offline_fleet({"a": 1})
    core = shedding_core(fleet)
    core.submit(ticket(0), 0.0)
    core.submit(ticket(1, band=2), 0.0)
    core.submit(ticket(2, band=2), 0.0)
    core.submit(ticket(3, band=1), 0.0)  # 3 queued x 0.035 s: beyond 0.1 s, a band-2 request goes
    assert [(rid, getattr(e, "code", None)) for rid, e in core.outbox] == [("r-2", "pool_saturated")]
    assert sorted(core.tickets) == ["r-1", "r-3"] and core.queued_per_class == {("a", "c"): 2}
    core.submit(ticket(4, band=0), 0.0)
    assert [rid for rid, _ in core.outbox] == ["r-2", "r-1"]
    with pytest.raises(GatewayError):
        core.submit(ticket(5, band=1), 0.0)  # now the arrival is in the least urgent band queued
    assert sorted(core.tickets) == ["r-3", "r-4"]
    # the engine frees its seat: the queue drains in band order
    fleet.release("a-0", "r-0")
    core.step(0.1)
    assert [rid for rid, r in core.outbox if isinstance(r, EngineRecord)] == ["r-4"]


def test_no_shedding_while_the_queue_is_short_or_an_engine_has_room() -> None:
    fleet = offline_fleet({"a": 2})
    core = shedding_core(fleet)
    for seq in range(5):
        core.submit(ticket(seq), 0.0)
    # both seats taken, 3 queued: 3 x 0.035 s of prefill over 2 engines, within 0.1 s
    assert core.queued() == 3 and core.outbox == []
    fleet.eject("a-1", "down")  # one engine left: 4 x 0.035 s is beyond 0.1 s
    with pytest.raises(GatewayError):
        core.submit(ticket(5), 0.0)
    fleet.release("a-0", "r-0")  # a seat is free (the loop has not run yet): the queue will drain
    assert core.submit(ticket(6), 0.0) is None and core.queued() == 4
    core.step(0.0)
    with pytest.raises(GatewayError):
        core.submit(ticket(7), 0.0)


def test_the_newest_first_index_stays_in_proportion_to_the_queue() -> None:
    fleet = offline_fleet({"a": 1})
    core = shedding_core(fleet, max_queue_s=1e6)
    core.submit(ticket(0), 0.0)
    for seq in range(1, 1001):
        core.submit(ticket(seq, band=seq % 2), 0.0)
    for seq in range(1, 991):
        core.cancel(f"r-{seq}", 0.0)
    for seq in range(1001, 1011):
        core.submit(ticket(seq, band=seq % 2), 0.0)
    assert core.queued() == 20
    assert sum(len(h) for h in core._band_newest["a"].values()) <= 2 * (64 + 2 * 20)


def test_a_protected_band_is_never_shed() -> None:
    fleet = offline_fleet({"a": 1})
    core = shedding_core(fleet, min_band=1)
    for seq in range(6):
        core.submit(ticket(seq), 0.0)  # band 0 only: protected, they all queue
    assert core.queued() == 5 and core.outbox == []
    with pytest.raises(GatewayError):
        core.submit(ticket(6, band=1), 0.0)


def test_without_shedding_the_core_keeps_no_index() -> None:
    fleet = offline_fleet({"a": 1})
    core = offline_core(fleet, order="flow_control", max_engine_load=1)
    for seq in range(50):
        core.submit(ticket(seq, band=seq % 3), 0.0)
    assert core.queued() == 49 and core._band_newest == {}


# -- property: nothing leaks ------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["arrive"] * 6 + ["step", "finish", "disconnect", "tick", "eject", "readmit"]),
        st.integers(0, 1000),
    ),
    max_size=150,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS,
    max_load=st.sampled_from([1, 2]),
    max_queue_s=st.sampled_from([0.0, 0.03, 0.1]),
    order=st.sampled_from(["flow_control", "wspt", "fcfs"]),
)
def test_shedding_never_leaks_a_ticket_a_count_or_a_reservation(
    ops: list[tuple[str, int]], max_load: int, max_queue_s: float, order: str
) -> None:
    fleet = offline_fleet({"a": 3, "b": 2})
    core = offline_core(
        fleet,
        order=order,
        max_engine_load=max_load,
        limits=ClassLimits(max_queued=12, queue_timeout_s=2.0),
        shedding=SheddingParams(max_queue_s=max_queue_s),
    )
    now = 0.0
    seq = 0
    placed: dict[str, str] = {}
    refused: dict[str, str] = {}
    engines = list(fleet.records)

    def deliver() -> None:
        for rid, result in core.outbox:
            assert rid not in placed and rid not in refused  # one answer per request
            if isinstance(result, EngineRecord):
                placed[rid] = result.engine_id
            else:
                refused[rid] = result.code
        core.outbox.clear()

    for op, arg in ops:
        if op == "arrive":
            seq += 1
            band, tenant, model = (arg // 2) % 3, f"t{(arg // 6) % 4}", "ab"[arg % 2]
            t = ticket(seq, band=band, tenant=tenant, model=model, now=now, timeout=2.0)
            t.slo_class = "c" if arg % 5 else "d"
            try:
                record = core.submit(t, now)
            except GatewayError as exc:
                refused[t.request_id] = exc.code
                record = None
            if record is not None:
                placed[t.request_id] = record.engine_id
        elif op == "step":
            core.step(now)
        elif op in ("finish", "disconnect") and placed and arg % 2:
            rid = sorted(placed)[arg % len(placed)]
            fleet.release(placed.pop(rid), rid)
        elif op == "disconnect" and core.tickets:
            core.cancel(sorted(core.tickets)[arg % len(core.tickets)], now)
        elif op == "tick":
            now += arg / 500.0
            core.step(now)
        elif op == "eject":
            fleet.eject(engines[arg % len(engines)], "gone")
        elif op == "readmit":
            fleet.record_health(engines[arg % len(engines)], True, 1, 1)
        deliver()
        for engine_id, record in fleet.records.items():
            assert (
                record.in_flight == len(record.running) == sum(1 for e in placed.values() if e == engine_id)
            )
            assert record.in_flight <= max_load
        assert sum(core.queued_per_class.values()) == len(core.tickets) == core.queued("a") + core.queued("b")
        assert set(core.tickets).isdisjoint(placed) and set(core.tickets).isdisjoint(refused)
        for model, bands in core._band_newest.items():
            live = {rid for heap in bands.values() for _, rid in heap if rid in core.tickets}
            assert live == {rid for rid, t in core.tickets.items() if t.item.view.model == model}

    for engine_id in engines:
        fleet.record_health(engine_id, True, 1, 1)
    for _ in range(400):
        for rid, engine_id in list(placed.items()):
            fleet.release(engine_id, rid)
            del placed[rid]
        now += 0.01
        core.step(now)
        deliver()
        if not core.tickets and not placed:
            break
    assert core.tickets == {} and placed == {}
    assert all(v == 0 for v in core.queued_per_class.values())
    assert all(r.in_flight == 0 and not r.running and r.running_tokens == 0 for r in fleet.records.values())
    assert set(refused.values()) <= {
        "pool_saturated",
        "queue_full",
        "queue_timeout",
        "slo_infeasible",
        "no_healthy_engine",
    }
    assert all(len(queue) == 0 for queue in core.queues.values())


# -- the routing profiles ---------------------------------------------------------------------------


def profile(name: str) -> RoutingProfile:
    return RoutingProfile.load(DEFAULT_PROFILES_DIR / "routing" / f"{name}.yaml")


def test_the_shipped_baseline_profiles() -> None:
    deadline = profile("least-load-deadline").dispatcher
    assert deadline.deadline_engines and deadline.max_engine_load is None and deadline.shedding is None
    assert isinstance(deadline.order, type(profile("least-load").dispatcher.order))
    flow = profile("flow-control").dispatcher
    assert isinstance(flow.order, FlowControl) and flow.hyperflexis is None
    assert flow.max_engine_load == 256 and flow.shedding == SheddingParams(max_queue_s=10.0)
    assert not flow.deadline_engines
    wspt = profile("wspt").dispatcher
    assert isinstance(wspt.order, Wspt) and wspt.max_engine_load == 256 and wspt.shedding is None
    for name in ("least-load", "round-robin", "hyperflexis"):
        plain = profile(name).dispatcher
        assert (
            plain.engine_scheduling == "default" and plain.shedding is None and plain.max_engine_load is None
        )


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"engine_scheduling": "edf"}, "engine_scheduling' must be one of default, deadline"),
        ({"shedding": {"max_queue": 1}}, "shedding has no parameter ['max_queue']"),
        ({"shedding": {"max_queue_s": -1}}, "max_queue_s must be"),
        ({"shedding": [1]}, "'shedding' must be a mapping"),
        ({"dispatcher": {"name": "pipeline", "params": {"max_engine_load": 0}}}, "max_engine_load must be"),
        ({"dispatcher": {"name": "pipeline", "params": {"theta": 1}}}, "takes only max_engine_load"),
        ({"dispatcher": {"name": "hyperflexis", "params": {"nope": 1}}}, "'max_engine_load'"),
        # beside params, not in them: the queue ran without its cap, unsaid
        ({"dispatcher": {"name": "pipeline", "max_engine_load": 256}}, "unknown keys ['max_engine_load']"),
    ],
)
def test_bad_profile_keys_say_what_is_accepted(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        dispatcher_config({"scorers": [{"name": "least_load"}], **extra})
    assert fragment in str(info.value)


def test_the_pipeline_accepts_the_new_keys_and_errors_name_the_file(tmp_path: Path) -> None:
    compile_profile({"engine_scheduling": "deadline", "shedding": {}, "scorers": [{"name": "least_load"}]})
    config = dispatcher_config({"dispatcher": {"name": "hyperflexis", "params": {"max_engine_load": 4}}})
    assert config.max_engine_load == 4 and config.hyperflexis is not None
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine_scheduling: sometimes\nscorers: [{name: least_load}]\n")
    with pytest.raises(PolicyConfigError, match=r"bad\.yaml"):
        RoutingProfile.load(bad)


def settings_with(routing: str, **engine: Any) -> Settings:
    engines = [
        EngineConfig(url=f"http://127.0.0.1:{9000 + i}", kind="vllm", model="m", name=f"e{i}", **engine)  # type: ignore[arg-type]
        for i in range(2)
    ]
    return Settings(engines=engines, routing_profile=routing)


def test_the_gateway_warns_when_engines_do_not_schedule_by_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = settings_with("least-load-deadline")
    fleet = fleet_of(plain.engines, 3.0)
    with caplog.at_level(logging.WARNING, logger="slogate.dispatch"):
        build_core(plain, fleet, SloService(plain), profile("least-load-deadline"))
    [warning] = [r.getMessage() for r in caplog.records]
    assert (
        "engine_scheduling: deadline" in warning and "e0, e1" in warning and "priority_scheduling" in warning
    )
    caplog.clear()
    ready = settings_with("least-load-deadline", priority_scheduling=True)
    with caplog.at_level(logging.WARNING, logger="slogate.dispatch"):
        build_core(ready, fleet_of(ready.engines, 3.0), SloService(ready), profile("least-load-deadline"))
    assert caplog.records == []
    # a profile that expects nothing of the engines never warns about them
    assert engine_scheduling_warnings(profile("least-load"), fleet, None) == []


def test_shedding_without_a_gateway_queue_is_a_warning_and_the_settings_cap_wins() -> None:
    settings = settings_with("flow-control")
    fleet = fleet_of(settings.engines, 3.0)
    flow = profile("flow-control")
    assert engine_scheduling_warnings(flow, fleet, 256) == []
    [warning] = engine_scheduling_warnings(flow, fleet, None)
    assert "max_engine_load" in warning
    core = build_core(settings, fleet, SloService(settings), flow)
    assert core.max_engine_load == 256 and core.shedding is not None
    capped = settings.model_copy(update={"max_engine_load": 7})
    assert build_core(capped, fleet_of(capped.engines, 3.0), SloService(capped), flow).max_engine_load == 7


def test_drivers_that_start_engines_start_them_as_the_profile_expects() -> None:
    plain = settings_with("least-load-deadline")
    assert profile_engine_scheduling(plain)
    started = with_profile_engines(plain)
    assert all(e.priority_scheduling for e in started.engines) and not any(
        e.priority_scheduling for e in plain.engines
    )
    other = settings_with("flow-control")
    assert not profile_engine_scheduling(other) and with_profile_engines(other) is other


def test_the_band_index_holds_only_priorities_still_queued() -> None:
    fleet = offline_fleet({"a": 1})
    core = shedding_core(fleet, max_queue_s=1e9)  # never saturated: only the bookkeeping runs
    assert core.submit(ticket(0), 0.0) is not None  # the engine's one seat
    for seq in range(1, 200):  # each queued with its own priority, then cancelled
        assert core.submit(ticket(seq, band=seq), 0.0) is None
        assert core.cancel(f"r-{seq}", 0.0)
    assert core.submit(ticket(500, band=3), 0.0) is None
    assert list(core._band_newest["a"]) == [3] and core._band_live == {("a", 3): 1}


def test_the_shipped_hyperflexis_profiles_keep_tpot_classes_apart_on_mixing_engines() -> None:
    for name in ("hyperflexis", "hyperflexis-wspt"):
        params = profile(name).dispatcher.hyperflexis
        assert params is not None
        assert params.tpot_segregation and params.segregate_ratio == 2.0 and params.mixed_steps
