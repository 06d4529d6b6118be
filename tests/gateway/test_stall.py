"""A stalled engine (healthy by its health route, producing nothing for the work it holds) leaves
rotation until it makes progress or holds nothing; a stall moves work between a model's engines
and never refuses it. Peer gateways' users: "one stalled backend hangs requests"."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import httpx
import pytest

from gateway import metrics
from gateway.dispatch.offline import fleet_of, offline_fleet
from gateway.fleet.monitor import FleetMonitor
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.serving.disaggregated import DisaggregatedFlow
from gateway.settings import EngineConfig
from policies.api import EngineState, EngineTiming, Role
from policies.stall import is_stalled, may_try_elsewhere
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, never_answer, one_event_then_stall

AFTER = 15.0


def test_is_stalled() -> None:
    assert not is_stalled(None, 0.0, 100.0, AFTER)  # holds nothing
    assert not is_stalled(10.0, 0.0, 24.9, AFTER)
    assert is_stalled(10.0, 0.0, 25.0, AFTER)
    assert not is_stalled(10.0, 20.0, 34.9, AFTER)  # progress since its oldest request
    assert is_stalled(10.0, 20.0, 35.0, AFTER)
    assert not is_stalled(10.0, 0.0, 1e9, 0.0)  # off


def _hold(fleet: Fleet, engine: str, rid: str, sent: float) -> RunningEntry:
    entry = RunningEntry(100, 10, 0.1, sent)
    fleet.reserve(engine, rid, entry)
    return entry


def _routable(fleet: Fleet) -> list[str]:
    return [s.engine_id for s in fleet.candidates(MODEL)]


def test_an_engine_holding_work_without_progress_leaves_rotation_until_it_shows_some() -> None:
    fleet = offline_fleet({MODEL: 3})
    _hold(fleet, "m-0", "r1", sent=10.0)
    assert not fleet.check_stall("m-0", 24.0, AFTER)
    assert fleet.check_stall("m-0", 25.5, AFTER)
    record = fleet.records["m-0"]
    assert record.stalled and not fleet.in_front(record) and fleet.has_healthy(MODEL)
    assert _routable(fleet) == ["m-1", "m-2"]
    fleet.mark_prefilled("m-0", "r1")  # its first token: progress
    assert fleet.check_stall("m-0", 26.0, AFTER) and not record.stalled
    assert _routable(fleet) == ["m-0", "m-1", "m-2"]
    # streamed events are progress too (as of the check that sees them); without more, it is
    # stalled again AFTER later
    fleet.add_generated(record, record.running["r1"], 1)
    assert not fleet.check_stall("m-0", 40.0, AFTER)
    assert not fleet.check_stall("m-0", 54.9, AFTER)
    assert fleet.check_stall("m-0", 55.0, AFTER) and record.stalled
    # holding nothing (its request timed out, or the client left), it is back
    fleet.release("m-0", "r1")
    assert fleet.check_stall("m-0", 55.5, AFTER) and not record.stalled


def test_the_engine_s_own_work_counters_are_progress() -> None:
    """A non-streamed answer shows nothing until it ends: the engine's counters say it works."""
    fleet = offline_fleet({MODEL: 2})
    _hold(fleet, "m-0", "r1", sent=0.5)
    for second in range(1, 40):
        timing = EngineTiming(steps=float(second), generation_tokens=float(10 * second))
        fleet.record_state("m-0", EngineState(num_running=1, timing=timing), float(second))
        assert not fleet.check_stall("m-0", float(second), AFTER)
    assert not fleet.records["m-0"].stalled
    frozen = EngineTiming(steps=39.0, generation_tokens=390.0)  # and then they stop
    for second in range(40, 56):
        fleet.record_state("m-0", EngineState(num_running=1, timing=frozen), float(second))
        fleet.check_stall("m-0", float(second), AFTER)
    assert fleet.records["m-0"].stalled


def test_a_stall_never_leaves_a_model_without_an_engine() -> None:
    fleet = offline_fleet({MODEL: 3})
    for i in range(3):
        _hold(fleet, f"m-{i}", f"r{i}", sent=0.5)
    assert fleet.check_stall("m-0", 20.0, AFTER) and fleet.check_stall("m-1", 20.0, AFTER)
    assert not fleet.check_stall("m-2", 20.0, AFTER)  # the last one in rotation takes the work
    assert _routable(fleet) == ["m-2"]
    # the last one ejected: the stalled engines are all the model has, and come back
    fleet.record_health("m-2", False, eject_after=1, readmit_after=1)
    assert not fleet.records["m-0"].stalled and not fleet.records["m-1"].stalled
    assert fleet.has_healthy(MODEL) and _routable(fleet) == ["m-0", "m-1"]


def test_an_engine_with_nothing_to_do_is_not_stalled() -> None:
    """Its request waits on the gateway's side (a client reading slowly holds the stream's last
    events): the engine's own report says it runs nothing."""
    fleet = offline_fleet({MODEL: 2})
    _hold(fleet, "m-0", "r1", sent=0.5)
    for second in range(1, 40):
        fleet.record_state("m-0", EngineState(num_running=0, num_waiting=0), float(second))
        assert not fleet.check_stall("m-0", float(second), AFTER)
    # the same engine saying it runs the request, its counters still: stalled
    timing = EngineTiming(steps=5.0, generation_tokens=50.0)
    for second in range(40, 56):
        fleet.record_state("m-0", EngineState(num_running=1, timing=timing), float(second))
        fleet.check_stall("m-0", float(second), AFTER)
    assert fleet.records["m-0"].stalled


def test_a_non_streamed_request_on_an_engine_without_a_step_counter_is_no_sign() -> None:
    """Such an engine shows nothing of a non-streamed request until it ends: no false alarm."""
    fleet = offline_fleet({MODEL: 2})
    _hold(fleet, "m-0", "r1", sent=0.5).stream = False
    assert not fleet.check_stall("m-0", 60.0, AFTER)
    _hold(fleet, "m-0", "r2", sent=1.0)  # a stream, though, would have shown its events
    assert fleet.check_stall("m-0", 60.0, AFTER) and fleet.records["m-0"].stalled


def test_a_non_streamed_request_is_no_sign_while_the_engine_s_scrapes_fail() -> None:
    """Its only sign of progress is the step counter the scrapes read: a busy engine whose
    /metrics times out for the stall window showed none, and left rotation."""
    fleet = offline_fleet({MODEL: 2})
    timing = EngineTiming(steps=5.0, generation_tokens=50.0)
    fleet.record_state("m-0", EngineState(num_running=1, timing=timing), 1.0)
    _hold(fleet, "m-0", "r1", sent=1.0).stream = False
    assert not fleet.check_stall("m-0", 30.0, AFTER)  # (no scrape since 1.0: nothing is known)
    fleet.record_state("m-0", EngineState(num_running=1, timing=timing), 31.0)
    assert fleet.check_stall("m-0", 31.0, AFTER)  # a fresh reading whose counter did not move


def test_free_kv_of_an_engine_whose_scrapes_fail_counts_what_gateways_placed_only() -> None:
    """Its last reading (a busy moment: 90 % used) kept it parked as full in every placement for
    as long as its /metrics timed out."""
    fleet = offline_fleet({MODEL: 1})  # (stale after 3 s)
    fleet.record_state("m-0", EngineState(kv_usage=0.9, block_size=16, num_gpu_blocks=100), 1.0)
    _hold(fleet, "m-0", "r1", sent=1.0)  # 110 tokens, placed since the reading
    record = fleet.records["m-0"]
    assert record.free_kv_tokens() == 1600 - 1440 - 110
    changes: list[str] = []
    fleet.listeners.append(lambda engine_id, what: changes.append(what))
    fleet.scrape_failed("m-0", 3.5)  # (not stale yet)
    assert record.free_kv_tokens() == 1600 - 1440 - 110 and changes == []
    fleet.scrape_failed("m-0", 4.5)
    assert record.free_kv_tokens() == 1600 - 110 and changes == ["state"]  # (a look for the freed KV)
    fleet.scrape_failed("m-0", 5.5)
    assert changes == ["state"]
    fleet.record_state("m-0", EngineState(kv_usage=0.5, block_size=16, num_gpu_blocks=100), 6.0)
    assert record.free_kv_tokens() == 1600 - 800 and not record.state_stale


def test_the_only_engine_with_an_adapter_is_never_marked() -> None:
    """Out of rotation, its adapter's requests would be refused (503), not moved."""
    fleet = offline_fleet({MODEL: 3})
    fleet.set_adapters("m-0", frozenset({"sql-lora"}))
    _hold(fleet, "m-0", "r1", sent=0.5)
    assert not fleet.check_stall("m-0", 60.0, AFTER) and fleet.adapter_in_rotation("sql-lora")
    fleet.set_adapters("m-1", frozenset({"sql-lora"}))  # another engine has it too
    assert fleet.check_stall("m-0", 61.0, AFTER) and fleet.adapter_in_rotation("sql-lora")


@pytest.mark.parametrize("leaves", ["unloads it", "is ejected", "drains"])
def test_a_stalled_engine_comes_back_when_it_becomes_the_only_one_with_an_adapter(leaves: str) -> None:
    """Marked while another engine had its adapter too; that one then unloads it or leaves
    rotation: the adapter's requests have no engine but the stalled one."""
    fleet = offline_fleet({MODEL: 3})
    for engine in ("m-0", "m-1"):
        fleet.set_adapters(engine, frozenset({"sql-lora"}))
    _hold(fleet, "m-0", "r1", sent=0.5)
    assert fleet.check_stall("m-0", 60.0, AFTER) and fleet.records["m-0"].stalled
    if leaves == "unloads it":
        fleet.set_adapters("m-1", frozenset())
    elif leaves == "is ejected":
        fleet.record_health("m-1", False, eject_after=1, readmit_after=1)
    else:
        fleet.set_draining("m-1", True)
    assert not fleet.records["m-0"].stalled and fleet.adapter_in_rotation("sql-lora")
    assert "m-0" in _routable(fleet)
    assert not fleet.check_stall("m-0", 61.0, AFTER)  # (nor marked again while it is the only one)


def test_a_stalled_engine_that_was_ejected_is_back_if_it_returns_alone() -> None:
    """(Held before the rule above too, by another path: kept so the rule, which passes over
    ejected engines, does not lose it.)"""
    fleet = offline_fleet({MODEL: 2})
    _hold(fleet, "m-0", "r1", sent=0.5)
    assert fleet.check_stall("m-0", 20.0, AFTER)
    fleet.record_health("m-0", False, eject_after=1, readmit_after=1)
    fleet.record_health("m-1", False, eject_after=1, readmit_after=1)
    fleet.record_health("m-0", True, eject_after=1, readmit_after=1)  # the only one to return
    assert not fleet.records["m-0"].stalled and _routable(fleet) == ["m-0"]


def test_the_stalled_gauge_follows_a_return_without_a_check_of_its_own() -> None:
    fleet = offline_fleet({MODEL: 2})
    monitor = FleetMonitor(fleet, 1.0, 2, 1, stall_after_s=AFTER)
    _hold(fleet, "m-0", "r1", sent=0.5)
    with patch.object(time, "monotonic", return_value=30.0):
        monitor._check_stall(fleet.records["m-0"])
    assert fleet.records["m-0"].stalled and _gauge("m-0") == 1.0
    fleet.record_health("m-1", False, eject_after=1, readmit_after=1)  # the other one leaves
    assert not fleet.records["m-0"].stalled
    with patch.object(time, "monotonic", return_value=31.0):
        monitor._check_stall(fleet.records["m-0"])  # the last one: not marked again
    assert _gauge("m-0") == 0.0


def _gauge(engine: str) -> float:
    value = metrics.REGISTRY.get_sample_value("slogate_engine_stalled", {"engine": engine})
    return -1.0 if value is None else value


def _pd_fleet() -> Fleet:
    """One prefill engine and three decode engines of MODEL (fleet order p, d0, d1, d2)."""
    configs = [
        EngineConfig(url="http://127.0.0.1:10000", kind="sim", model=MODEL, name="p", role=Role.PREFILL)
    ]  # type: ignore[arg-type]
    configs += [
        EngineConfig(
            url=f"http://127.0.0.1:{10_001 + i}", kind="sim", model=MODEL, name=f"d{i}", role=Role.DECODE
        )  # type: ignore[arg-type]
        for i in range(3)
    ]
    return fleet_of(configs, 3.0)


def _decoding(fleet: Fleet) -> list[str]:
    return [s.engine_id for s in fleet.decode_pool(MODEL)]


def test_a_stalled_decode_engine_leaves_the_decode_pool_and_the_last_one_stays() -> None:
    fleet = _pd_fleet()
    for name in ("d0", "d1", "d2"):
        _hold(fleet, name, f"r-{name}", sent=0.5)
    assert fleet.check_stall("d0", 20.0, AFTER) and fleet.check_stall("d1", 20.0, AFTER)
    assert not fleet.check_stall("d2", 20.0, AFTER)  # the last decode engine takes the decodes
    assert _decoding(fleet) == ["d2"] and fleet.has_healthy(MODEL)  # (the prefill pool as it was)
    # a decode engine's first token and events are progress, as a front engine's
    fleet.mark_prefilled("d0", "r-d0")
    assert fleet.check_stall("d0", 21.0, AFTER) and _decoding(fleet) == ["d0", "d2"]
    # the other decode engines leave: the stalled one is all the pool has, and comes back
    fleet.record_health("d0", False, eject_after=1, readmit_after=1)
    fleet.record_health("d2", False, eject_after=1, readmit_after=1)
    assert not fleet.records["d1"].stalled and _decoding(fleet) == ["d1"]
    # nor does the front pool's last engine leaving bring back a stalled decode engine
    fleet.record_health("d2", True, eject_after=1, readmit_after=1)
    assert fleet.check_stall("d1", 40.0, AFTER) and _decoding(fleet) == ["d2"]
    fleet.record_health("p", False, eject_after=1, readmit_after=1)
    assert fleet.records["d1"].stalled and _decoding(fleet) == ["d2"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_non_streamed_decode_on_an_engine_without_a_step_counter_is_no_sign(stream: bool) -> None:
    """The decode stage's reservation says whether its request streams (a non-streamed one shows
    nothing until it ends, and this engine has no step counter)."""
    fleet = _pd_fleet()
    request = SimpleNamespace(prompt_tokens=100, max_tokens=10, stream=stream)
    call = SimpleNamespace(request=request, target=SimpleNamespace(tpot_s=0.1), rid="r1")
    flow = SimpleNamespace(fleet=fleet)
    entry = DisaggregatedFlow._reserve(flow, call, fleet.records["d0"], remote_kv=True)  # type: ignore[arg-type]
    entry.dispatched_at = 0.5
    assert fleet.check_stall("d0", 60.0, AFTER) is stream
    assert _decoding(fleet) == (["d1", "d2"] if stream else ["d0", "d1", "d2"])


def test_a_decode_sent_with_its_prefill_is_timed_from_the_prefills_answer() -> None:
    """Bootstrap P/D sends the decode alongside the prefill: the decode engine can do nothing for
    it before the prefill's KV is there, however long that prefill takes elsewhere."""
    fleet = _pd_fleet()
    entry = _hold(fleet, "d0", "r1", sent=0.5)
    entry.ready_at = math.inf  # (the prefill still runs)
    assert not fleet.check_stall("d0", 60.0, AFTER)
    entry.ready_at = 50.0  # (it answered then)
    assert not fleet.check_stall("d0", 64.9, AFTER)
    assert fleet.check_stall("d0", 65.0, AFTER) and _decoding(fleet) == ["d1", "d2"]


# -- live: a stub that never answers beside a simulated engine ------------------------------------


@pytest.fixture(scope="module")
def sim() -> Iterator[ChildProcess]:
    with spawn_sim_engine(*SIM_ARGS, name="b-sim") as engine:
        yield engine


def _stalls(metrics: str) -> float:
    """The stall count of the stub (the registry is the process's: earlier tests count too)."""
    found = re.search(r'^slogate_engine_stalls_total\{engine="a-hang"\} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _dispatches(gw: RunningGateway, engine: str) -> float:
    """Requests the gateway has sent to ``engine`` (its attempts, retried ones included)."""
    text = httpx.get(gw.url + "/metrics").text
    found = re.search(rf'^slogate_dispatches_total{{engine="{engine}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _until_held(
    hang: StubEngine, post: Callable[[], None], threads: list[threading.Thread], held: int
) -> int:
    """``post`` in a thread of its own, one at a time, until the stub holds ``held`` requests (the
    others go to the other engine and are answered); returns how many were started."""
    started = 0
    deadline = time.monotonic() + 10
    while len(hang.received) < held and time.monotonic() < deadline:
        threads.append(threading.Thread(target=post))
        threads[-1].start()
        started += 1
        threads[-1].join(0.5)
    assert len(hang.received) == held
    return started


def _engines(gw: RunningGateway) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in httpx.get(gw.url + "/admin/engines").json()["engines"]}


@pytest.mark.parametrize("profile", ["round-robin", "least-load", "hyperflexis"])
def test_new_work_goes_around_a_stalled_engine(sim: ChildProcess, profile: str) -> None:
    """One stream hangs after its first event on an engine that passes its health checks (not
    cut: without migration nothing resumes it); once that engine is found stalled, every new
    request goes to the other (round robin sent it every second request, each to wait out its
    limits), and it is back in rotation when it holds nothing."""
    settings: dict[str, Any] = {
        "routing_profile": profile,
        "monitor_interval_s": 0.1,
        "stall_after_s": 0.5,
        "idle_timeout_s": 4.0,
        "dispatch_attempts": 1,
    }
    with (
        StubEngine(one_event_then_stall) as hang,
        run_gateway(engines=[hang.entry("a-hang"), engine_entry(sim)], **settings) as gw,
    ):
        url = gw.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answers: list[httpx.Response] = []

        def post() -> None:  # (streamed: the stub has no work counters to show a non-streamed one's progress)
            answers.append(httpx.post(url, json={**body, "stream": True}, timeout=30))

        threads: list[threading.Thread] = []
        stalls_before = _stalls(httpx.get(gw.url + "/metrics").text)
        try:
            # one request at a time until the stub holds one (the others the engine answers)
            _until_held(hang, post, threads, 1)
            assert wait_until(lambda: _engines(gw)["a-hang"]["stalled"], timeout=10)
            assert _engines(gw)["a-hang"]["healthy"]  # (its health checks pass all along)
            answered = len(answers)
            with ThreadPoolExecutor(8) as pool:  # at once: by load alone, some went to the stub
                statuses = list(
                    pool.map(lambda _: httpx.post(url, json=body, timeout=30).status_code, range(8))
                )
            assert statuses == [200] * 8 and len(hang.received) == 1
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'slogate_engine_stalled{engine="a-hang"} 1.0' in metrics
            assert _stalls(metrics) == stalls_before + 1
        finally:
            for thread in threads:
                thread.join(30)
        # the held stream ended by its own limit (an error event after its first); holding
        # nothing, its engine is back in rotation
        assert len(answers) == answered + 1 and answers[-1].status_code == 200
        assert "stalled between events" in answers[-1].text, answers[-1].text
        assert wait_until(lambda: not _engines(gw)["a-hang"]["stalled"], timeout=5)
        assert 'slogate_engine_stalled{engine="a-hang"} 0.0' in httpx.get(gw.url + "/metrics").text


@pytest.mark.parametrize("profile", ["round-robin", "hyperflexis"])
def test_a_stream_waiting_for_its_headers_on_a_stalled_engine_is_answered_at_once(
    sim: ChildProcess, profile: str
) -> None:
    """A stream waiting for an engine's headers when the engine is found stalled is tried
    elsewhere at once (here with no attempt left: a 504, not after its 20 s headers limit); the
    engine, holding nothing then, is out of rotation for an ejection's time (it would otherwise be
    back at the next check while still hung), and new work goes around it."""
    settings: dict[str, Any] = {
        "routing_profile": profile,
        "monitor_interval_s": 0.1,
        "stall_after_s": 0.5,
        "headers_timeout_s": 20.0,
        "dispatch_attempts": 1,
        "outlier_ejection_s": 5.0,
    }
    with (
        StubEngine(never_answer) as hang,
        run_gateway(engines=[hang.entry("a-hang"), engine_entry(sim)], **settings) as gw,
    ):
        url = gw.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answers: list[httpx.Response] = []

        def post() -> None:
            answers.append(httpx.post(url, json={**body, "stream": True}, timeout=30))

        threads: list[threading.Thread] = []
        try:
            _until_held(hang, post, threads, 1)
            held_at, answered = time.monotonic(), len(answers)
            assert wait_until(lambda: len(answers) == answered + 1, timeout=10)
            assert time.monotonic() - held_at < 10.0  # (the headers limit is 20 s)
            assert answers[-1].status_code == 504, answers[-1].text
            assert "stalled before it answered" in answers[-1].text
            assert _engines(gw)["a-hang"]["ejected"] and _engines(gw)["a-hang"]["healthy"]
            with ThreadPoolExecutor(8) as pool:
                statuses = list(
                    pool.map(lambda _: httpx.post(url, json=body, timeout=30).status_code, range(8))
                )
            assert statuses == [200] * 8 and len(hang.received) == 1
        finally:
            for thread in threads:
                thread.join(30)
        assert wait_until(lambda: not _engines(gw)["a-hang"]["ejected"], timeout=15)


def test_a_plain_request_on_an_engine_without_step_counters_is_not_cut_for_a_stall(sim: ChildProcess) -> None:
    """A non-streamed request on an engine that publishes no step counter shows nothing until it
    ends, so it is no sign of a stall, and may be running: when a stream there makes the engine
    stalled, the stream is tried elsewhere and the plain request keeps its own limit."""
    settings: dict[str, Any] = {
        "routing_profile": "round-robin",
        "monitor_interval_s": 0.1,
        "stall_after_s": 0.5,
        "request_timeout_s": 5.0,
        "headers_timeout_s": 20.0,
    }
    with (
        StubEngine(never_answer) as hang,
        run_gateway(engines=[hang.entry("a-hang"), engine_entry(sim)], **settings) as gw,
    ):
        url = gw.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        plain: list[tuple[float, httpx.Response]] = []
        streams: list[httpx.Response] = []

        def post_plain() -> None:
            answer = httpx.post(url, json=body, timeout=30)
            plain.append((time.monotonic(), answer))

        def post_stream() -> None:
            streams.append(httpx.post(url, json={**body, "stream": True}, timeout=30))

        threads: list[threading.Thread] = []
        sent: dict[Callable[[], None], int] = {}
        try:
            for target, held in ((post_plain, 1), (post_stream, 2)):
                sent[target] = _until_held(hang, target, threads, held)
            stream_held_at = time.monotonic()
            # the stream held there: tried on the sim once the stub is found stalled
            assert wait_until(lambda: len(streams) == sent[post_stream], timeout=10)
            assert time.monotonic() - stream_held_at < 5.0
            assert all(r.status_code == 200 and r.text.rstrip().endswith("[DONE]") for r in streams)
            assert all('"error"' not in r.text for r in streams)
            assert len(plain) == sent[post_plain] - 1  # (the held one still waits)
            assert all(r.status_code == 200 for _, r in plain)
        finally:
            for thread in threads:
                thread.join(30)
        # the plain one held by the stub waited out its own limit (5 s from its arrival)
        assert len(plain) == sent[post_plain]
        ended, answer = plain[-1]
        assert answer.status_code == 504 and "in time" in answer.text, answer.text
        assert ended - stream_held_at > 1.0


@pytest.mark.parametrize("attempts", [2, 1])
def test_new_decodes_go_around_a_stalled_decode_engine(attempts: int) -> None:
    """P/D: a decode engine that hangs (healthy, its steps stopped) holds one stream (a short
    prompt, served whole on a decode engine); once it is found stalled that stream, which has
    had no event, is served by the other decode engine at once, every new decode goes there too
    while the hung one is out of rotation for an ejection's time, and it is back after that. With
    one attempt, the held stream (its headers sent, no event) ends at once with an error event."""
    with (
        spawn_sim_engine(*SIM_ARGS, "--role", "prefill", name="sp") as prefill,
        spawn_sim_engine(*SIM_ARGS, "--role", "decode", name="sd0") as d0,
        spawn_sim_engine(*SIM_ARGS, "--role", "decode", name="sd1") as d1,
        run_gateway(
            engines=[
                engine_entry(prefill, role="prefill"),
                engine_entry(d0, role="decode"),
                engine_entry(d1, role="decode"),
            ],
            monitor_interval_s=0.1,
            stall_after_s=0.5,
            outlier_ejection_s=3.0,
            first_token_timeout_s=60.0,
            dispatch_attempts=attempts,
        ) as gw,
    ):
        httpx.post(d0.url + "/sim/fault", json={"mode": "hang"}).raise_for_status()
        url = gw.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answers: list[httpx.Response] = []

        def post() -> None:
            answers.append(httpx.post(url, json={**body, "stream": True}, timeout=60))

        threads: list[threading.Thread] = []
        try:
            # one at a time, each answered before the next, until one went to the hung engine
            # first (ties go to the first decode engine in fleet order: most likely the first)
            deadline = time.monotonic() + 20
            before = _dispatches(gw, "sd0")  # (the registry is the process's: earlier tests count)
            sent_at = time.monotonic()
            while _dispatches(gw, "sd0") == before and time.monotonic() < deadline:
                threads.append(threading.Thread(target=post))
                sent_at = time.monotonic()
                threads[-1].start()
                threads[-1].join(20)
            assert _dispatches(gw, "sd0") == before + 1
            assert time.monotonic() - sent_at < 20.0  # (its first-token limit is 60 s)
            held = answers.pop()
            assert held.status_code == 200 and held.text.rstrip().endswith("data: [DONE]"), held.text
            if attempts == 1:
                assert "stalled before it answered" in held.text, held.text
            else:
                assert '"error"' not in held.text
            assert _engines(gw)["sd0"]["ejected"] and _engines(gw)["sd0"]["healthy"]
            assert _engines(gw)["sd0"]["in_flight"] == 0
            dispatched = _dispatches(gw, "sd0")
            with ThreadPoolExecutor(8) as pool:
                served = list(
                    pool.map(
                        lambda _: httpx.post(url, json=body, timeout=30).headers.get("x-slogate-engine"),
                        range(8),
                    )
                )
            assert served == ["sd1"] * 8, served
            assert _dispatches(gw, "sd0") == dispatched  # (none went there first)
            httpx.post(d0.url + "/sim/fault", json={"clear": True}).raise_for_status()
            assert wait_until(lambda: not _engines(gw)["sd0"]["ejected"], timeout=10)
            assert not _engines(gw)["sd0"]["stalled"]
        finally:
            for thread in threads:
                thread.join(30)
        # (any stream before the held one was served whole)
        assert all(a.status_code == 200 and a.text.rstrip().endswith("data: [DONE]") for a in answers)


def test_what_a_stalled_engine_gives_up_to_other_engines() -> None:
    """A request waiting on an engine just marked stalled goes elsewhere unless it cannot (pinned)
    or may itself be what looks like the stall."""
    go = {
        "stream": True,
        "engine_counts_steps": False,
        "pinned": False,
        "cut_before": False,
        "predicted_prefill_s": 1.0,
        "after_s": AFTER,
    }
    assert may_try_elsewhere(**go)  # type: ignore[arg-type]
    assert may_try_elsewhere(**{**go, "stream": False, "engine_counts_steps": True})  # type: ignore[arg-type]
    # a plain request on an engine that counts no steps shows nothing until it ends
    assert not may_try_elsewhere(**{**go, "stream": False})  # type: ignore[arg-type]
    assert not may_try_elsewhere(**{**go, "pinned": True})  # type: ignore[arg-type]  # (nowhere else)
    assert not may_try_elsewhere(**{**go, "cut_before": True})  # type: ignore[arg-type]
    # a prompt whose prefill alone takes the stall's time looks stalled wherever it goes
    assert not may_try_elsewhere(**{**go, "predicted_prefill_s": AFTER})  # type: ignore[arg-type]
    assert may_try_elsewhere(**{**go, "predicted_prefill_s": AFTER * 0.99})  # type: ignore[arg-type]
