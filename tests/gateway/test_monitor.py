"""The fleet monitor against real HTTP engines: a slow or failing scrape is stale state, not a dead
engine; only failed health checks eject, and successes re-admit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway import metrics
from gateway.engines import adapter_for
from gateway.fleet.monitor import FleetMonitor
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.settings import EngineConfig
from policies.api import estimated_load
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.support.threaded_app import ThreadedApp

ENGINE_KEY = "sk-engine-upstream-secret"
MetricsMode = Literal["ok", "hang", "error", "endless"]


class FakeEngine(ThreadedApp):
    """A vLLM-shaped engine whose /health and /metrics can be told to fail, hang or recover.

    Runs its own event loop in a thread (like conftest's BrokenEngine), so it keeps answering
    whatever the test's loop is doing; the test flips the public attributes to change behaviour.
    Hanging handlers wait on an event that stop() sets, so shutdown never waits on them.
    """

    thread_name = "fake-engine"

    def __init__(self) -> None:
        super().__init__()
        self.health_status = 200
        self.health_hangs = False
        self.metrics_mode: MetricsMode = "ok"
        self.running = 3
        #: the model list's names (None: no model list, a 404)
        self.models: list[str] | None = None
        #: the model list answers this status instead (an engine whose API needs another key)
        self.models_status = 200
        self.sleeping = False
        #: the metrics lack the running and waiting gauges (an engine with its stats off)
        self.no_load_gauges = False
        #: more lines for /metrics
        self.extra_metrics = ""
        self.health_hits = 0
        self.metrics_hits = 0
        self._release = asyncio.Event()

    async def before_cleanup(self) -> None:
        self._release.set()

    async def build(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            self.health_hits += 1
            if self.health_hangs:
                await self._release.wait()
            return web.Response(status=self.health_status, text="")

        async def prom(request: web.Request) -> web.StreamResponse:
            self.metrics_hits += 1
            if self.metrics_mode == "endless":  # chunked, no length: a stream without end
                response = web.StreamResponse()
                await response.prepare(request)
                line = b"# " + b"x" * 65_000 + b"\n"
                with contextlib.suppress(ConnectionError):
                    while not self._release.is_set():
                        await response.write(line)
                return response
            if self.metrics_mode == "hang":
                await self._release.wait()
            if self.metrics_mode == "error":
                return web.Response(status=500, text="busy")
            text = f"vllm:num_requests_running {self.running}\nvllm:num_requests_waiting 1\n"
            if self.no_load_gauges:
                text = "vllm:kv_cache_usage_perc 0.5\n"
            state = "weights_offloaded" if self.sleeping else "awake"
            text += f'vllm:engine_sleep_state{{sleep_state="{state}"}} 1\n'
            return web.Response(text=text + self.extra_metrics)

        async def models(_: web.Request) -> web.Response:
            if self.models_status != 200:
                return web.json_response({"error": "Unauthorized"}, status=self.models_status)
            if self.models is None:
                return web.Response(status=404)
            return web.json_response(
                {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
            )

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", prom)
        app.router.add_get("/v1/models", models)
        return app


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as fake:
        yield fake


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def make_monitor(
    engine: FakeEngine,
    session: aiohttp.ClientSession,
    *,
    interval_s: float = 0.05,
    health_timeout_s: float = 1.0,
    scrape_timeout_s: float = 0.3,
    stale_after_s: float = 0.3,
    eject_after: int = 1,
    readmit_after: int = 1,
) -> tuple[FleetMonitor, Fleet, EngineRecord]:
    config = EngineConfig.model_validate(
        {"url": engine.url, "kind": "vllm", "model": "m", "name": "e", "api_key": ENGINE_KEY}
    )
    adapter = adapter_for(config, session, health_timeout_s, scrape_timeout_s=scrape_timeout_s)
    fleet = Fleet([adapter], stale_after_s)
    monitor = FleetMonitor(fleet, interval_s, eject_after, readmit_after, scrape_timeout_s=scrape_timeout_s)
    return monitor, fleet, fleet.records["e"]


async def until(predicate: object, timeout: float = 5.0) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


async def test_hanging_scrape_makes_state_stale_but_never_ejects(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    # eject_after=1: a single counted failure would eject, so staying healthy proves none counted
    monitor, fleet, record = make_monitor(engine, session, eject_after=1)
    monitor.start()
    try:
        await asyncio.wait_for(monitor.first_round.wait(), 5)
        snap = fleet.engine_snapshot("e")
        assert snap.healthy and not snap.stale and snap.state is not None and snap.state.num_running == 3
        assert estimated_load(snap) == 4.0  # the engine's own count while the reading is fresh

        engine.metrics_mode = "hang"
        assert await until(lambda: fleet.engine_snapshot("e").stale)
        snap = fleet.engine_snapshot("e")
        assert snap.healthy and record.consecutive_failures == 0
        assert snap.state is not None and snap.state.num_running == 3  # last good reading kept
        assert estimated_load(snap) == 0.0  # routing falls back on the gateway's own shadow
        assert await until(lambda: record.state_stale)  # ...and so does its free KV
        assert await until(lambda: monitor.scrape_errors.get("e") == "timed out")
        assert fleet.engine_snapshot("e").healthy and record.consecutive_failures == 0

        engine.metrics_mode = "ok"
        engine.running = 7
        assert await until(lambda: not fleet.engine_snapshot("e").stale)
        snap = fleet.engine_snapshot("e")
        assert snap.state is not None and snap.state.num_running == 7 and "e" not in monitor.scrape_errors
        assert not record.state_stale
    finally:
        await monitor.stop()


async def test_health_checks_keep_their_pace_while_a_scrape_hangs(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """A scrape allowed to hang for 30 s must not hold up the health loop (one loop per engine
    doing both would check health once and then wait)."""
    monitor, _, record = make_monitor(engine, session, scrape_timeout_s=30.0)
    engine.metrics_mode = "hang"
    monitor.start()
    try:
        assert await until(lambda: engine.metrics_hits >= 1)
        hits = engine.health_hits
        assert await until(lambda: engine.health_hits >= hits + 5, timeout=5)
        assert engine.metrics_hits == 1  # still the same scrape
        assert record.healthy and "e" not in monitor.scrape_errors
    finally:
        await monitor.stop()


async def test_scrape_errors_are_not_health_failures_and_never_show_the_engine_key(
    engine: FakeEngine, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="slogate")
    monitor, fleet, record = make_monitor(engine, session, eject_after=1)
    engine.metrics_mode = "error"
    for _ in range(3):
        await monitor.check_once(record)
    assert record.healthy and record.consecutive_failures == 0 and record.consecutive_successes == 3
    assert record.state is None and fleet.engine_snapshot("e").stale
    reason = monitor.scrape_errors["e"]
    assert reason.startswith("HTTP 500"), reason
    # aiohttp's ClientResponseError repr carries the request headers, i.e. the engine's key
    assert ENGINE_KEY not in reason and ENGINE_KEY not in caplog.text and record.last_error == ""


async def test_failed_health_checks_eject_after_the_threshold_and_successes_readmit(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    monitor, _, record = make_monitor(engine, session, eject_after=3, readmit_after=2)
    assert await monitor.check_health(record) and not record.healthy  # one success of two
    assert await monitor.check_health(record) and record.healthy
    # each answered check is a round trip of the path to the engine (the learner's path delay)
    assert len(record.round_trips) == 2 and all(0 < t < 5 for t in record.round_trips)

    engine.health_status = 503
    for expected_healthy in (True, True, False):
        assert not await monitor.check_health(record)
        # a good scrape between failures neither resets nor adds to the failure count
        assert await monitor.scrape_once(record)
        assert record.healthy is expected_healthy
    assert record.consecutive_failures == 3 and record.last_error == "health check failed"

    assert len(record.round_trips) == 2  # (a refused check measures nothing)
    engine.health_status = 200
    assert await monitor.check_health(record) and not record.healthy
    assert await monitor.check_health(record) and record.healthy


async def test_a_hung_health_check_ejects_through_the_loop_and_recovery_readmits(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    monitor, fleet, record = make_monitor(engine, session, health_timeout_s=0.2, eject_after=2)
    monitor.start()
    try:
        await asyncio.wait_for(monitor.first_round.wait(), 5)
        assert record.healthy
        engine.health_hangs = True
        assert await until(lambda: not fleet.engine_snapshot("e").healthy)
        assert record.consecutive_failures >= 2
        engine.health_hangs = False
        assert await until(lambda: fleet.engine_snapshot("e").healthy)
    finally:
        await monitor.stop()


def test_admin_engines_shows_a_slow_scrape_as_stale_and_healthy(engine: FakeEngine) -> None:
    engine.metrics_mode = "hang"
    settings: dict[str, Any] = {
        "monitor_interval_s": 0.05,
        "scrape_timeout_s": 0.2,
        "stale_after_s": 0.3,
        "eject_after_failures": 1,
    }
    entry = {"url": engine.url, "kind": "vllm", "model": "m", "name": "e", "api_key": ENGINE_KEY}
    with run_gateway(engines=[entry], **settings) as gw:

        def view() -> dict[str, object]:
            engines: list[dict[str, object]] = httpx.get(gw.url + "/admin/engines").json()["engines"]
            return engines[0]

        assert wait_until(lambda: view()["scrape_error"] == "timed out")
        shown = view()
        assert shown["healthy"] is True and shown["state_stale"] is True
        assert ENGINE_KEY not in httpx.get(gw.url + "/admin/engines").text


def test_a_data_pool_full_of_streams_does_not_fail_the_engines_health_checks() -> None:
    """The upstream pool allows one connection per engine and a long stream holds it: health
    checks shared that pool and waited for the connection inside their own timeout, so the
    busiest engine failed them and was ejected mid-stream."""
    from tests.gateway.conftest import MODEL
    from tests.gateway.stub_engines import StubEngine, events_every

    settings: dict[str, Any] = {
        "upstream_pool_per_host": 1,
        "monitor_interval_s": 0.1,
        "health_timeout_s": 0.4,
        "eject_after_failures": 3,
        "first_token_timeout_s": 10.0,
    }
    # (a 2.5 s stream: three health checks in a row wait for the pool's only connection and fail)
    with (
        StubEngine(events_every(0.05, 50)) as engine,
        run_gateway(engines=[engine.entry("e0")], **settings) as gw,
    ):
        fleet = gw.gateway.fleet
        assert fleet is not None
        record = fleet.records["e0"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ejected = False
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                ejected = ejected or not record.healthy
                if b"[DONE]" in chunk:
                    break
        assert not ejected and record.healthy, "a healthy engine busy with a stream was ejected"


def test_an_ejected_engine_leaves_no_reported_load_behind() -> None:
    """The engine-reported gauges (running, waiting, KV usage) kept a dead engine's last scrape
    for good: dashboards summed it and KV alerts kept firing. Ejected, its series go; the next
    good scrape after readmission sets them again."""
    import httpx

    from gateway.procs import spawn_sim_engine
    from tests.gateway.conftest import SIM_ARGS, engine_entry
    from tests.gateway.gateway_thread import run_gateway, wait_until

    def series(gw_url: str, name: str) -> list[str]:
        text = httpx.get(gw_url + "/metrics").text
        return [line for line in text.splitlines() if line.startswith(f'{name}{{engine="ejected-0"}}')]

    engine = spawn_sim_engine(*SIM_ARGS, name="ejected-0")
    try:
        with run_gateway(
            engines=[engine_entry(engine)], monitor_interval_s=0.2, eject_after_failures=1
        ) as gw:
            assert wait_until(lambda: bool(series(gw.url, "slogate_engine_kv_usage")), timeout=10)
            engine.stop()
            assert wait_until(
                lambda: (
                    series(gw.url, "slogate_engine_healthy")
                    == ['slogate_engine_healthy{engine="ejected-0"} 0.0']
                ),
                timeout=10,
            )
            for name in ("slogate_engine_kv_usage", "slogate_engine_running", "slogate_engine_waiting"):
                assert series(gw.url, name) == [], name
    finally:
        engine.stop()


def _reported_running() -> float | None:
    return metrics.REGISTRY.get_sample_value("slogate_engine_running", {"engine": "e"})


async def test_an_engine_the_data_path_ejected_first_leaves_no_reported_load_behind(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """A crash under traffic: a request's connect error ejects the engine before any health check
    fails, so the checks that then fail flip nothing; its last load must go all the same."""
    monitor, fleet, record = make_monitor(engine, session)
    await monitor.check_once(record)
    assert record.healthy and _reported_running() == 3.0
    fleet.eject("e", "ClientConnectorError: connection refused")
    engine.health_status, engine.metrics_mode = 503, "error"
    await monitor.check_once(record)
    assert not record.healthy and _reported_running() is None


async def test_an_ejected_engine_whose_metrics_still_answer_reports_no_load(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """vLLM's API server keeps serving /metrics after its engine core died (/health 503): the
    scrapes of the ejected engine must not put its load back; readmitted, the next scrape does."""
    monitor, _, record = make_monitor(engine, session)
    await monitor.check_once(record)
    engine.health_status = 503
    assert not await monitor.check_health(record)
    assert await monitor.scrape_once(record)
    assert not record.healthy and _reported_running() is None
    engine.health_status = 200
    assert await monitor.check_health(record) and record.healthy
    assert await monitor.scrape_once(record)
    assert _reported_running() == 3.0


async def test_a_metrics_answer_without_end_is_a_failed_scrape_not_the_gateway_s_memory(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """Control answers were read whole: an engine streaming /metrics without end grew the
    gateway's memory for the whole scrape timeout (gigabytes over loopback). They stop at
    MAX_CONTROL_BODY now and the scrape fails, health untouched."""
    import tracemalloc

    from gateway.engines.base import MAX_CONTROL_BODY

    monitor, _, record = make_monitor(engine, session, scrape_timeout_s=5.0)
    assert await monitor.check_health(record)
    engine.metrics_mode = "endless"
    tracemalloc.start()
    try:
        assert not await monitor.scrape_once(record)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "over" in monitor.scrape_errors["e"] and record.healthy
    assert peak < 3 * MAX_CONTROL_BODY, peak


async def test_an_engine_whose_model_list_lacks_its_model_is_out_of_rotation_until_it_lists_it(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """An address another deployment took over answers /health, yet every request for the
    configured model got its 404 (and, failing at once, it looked the least loaded)."""
    monitor, _, record = make_monitor(engine, session, eject_after=3, readmit_after=1)
    engine.models = ["m", "m-lora"]
    await monitor.check_once(record)
    assert record.healthy and record.unlisted == ""
    engine.models = ["other-model"]
    await monitor.check_once(record)
    assert not record.healthy  # at once, not after three failed checks
    assert "does not name model 'm'" in record.last_error and "'other-model'" in record.last_error
    assert not await monitor.check_health(record) and not record.healthy  # answering /health is not enough
    engine.models = ["m"]
    await monitor.check_once(record)
    await monitor.check_once(record)  # (the list is read beside the check: the next one readmits)
    assert record.healthy and record.unlisted == ""


async def test_a_kind_that_answers_any_model_name_is_not_judged_by_its_list(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    config = EngineConfig.model_validate({"url": engine.url, "kind": "llamacpp", "model": "m", "name": "e"})
    fleet = Fleet([adapter_for(config, session, 1.0, scrape_timeout_s=0.3)], 0.3)
    monitor, record = FleetMonitor(fleet, 0.05, 1, 1, scrape_timeout_s=0.3), fleet.records["e"]
    engine.models = ["/models/tiny.gguf"]  # (llama.cpp lists its file and serves any name asked)
    await monitor.check_once(record)
    await monitor.check_once(record)
    assert record.healthy and record.unlisted == ""


async def test_a_sleeping_engine_is_out_of_rotation_until_it_wakes_unless_it_is_the_last(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """Asleep, vLLM still answers /health and holds work until woken; with no load and an empty
    cache least-load routing sent it every request while another engine was awake. The last of
    its model in rotation stays: holding requests beats refusing every one."""
    with FakeEngine() as other:
        configs = [
            EngineConfig.model_validate({"url": e.url, "kind": "vllm", "model": "m", "name": name})
            for name, e in (("e", engine), ("o", other))
        ]
        fleet = Fleet([adapter_for(c, session, 1.0, scrape_timeout_s=0.3) for c in configs], 5.0)
        monitor = FleetMonitor(fleet, 0.05, 3, 1, scrape_timeout_s=0.3)
        mine, theirs = fleet.records["e"], fleet.records["o"]
        for record in (mine, theirs):
            await monitor.check_once(record)
        assert mine.healthy and theirs.healthy
        engine.sleeping = True
        assert await monitor.scrape_once(mine)
        assert not mine.healthy and "asleep" in mine.last_error  # at the scrape that shows it
        assert not await monitor.check_health(mine)
        other.sleeping = True
        assert await monitor.scrape_once(theirs) and theirs.healthy  # the last one in rotation
        assert await monitor.check_health(theirs) and theirs.healthy
        engine.sleeping = other.sleeping = False
        assert await monitor.scrape_once(mine)
        assert await monitor.check_health(mine) and mine.healthy


async def test_metrics_without_the_load_gauges_are_a_failed_scrape_not_an_idle_engine(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    monitor, fleet, record = make_monitor(engine, session, eject_after=1)
    engine.no_load_gauges = True
    assert not await monitor.scrape_once(record)
    assert record.state is None and fleet.engine_snapshot("e").stale  # the shadow decides, not zeros
    assert "neither vllm:num_requests_running nor vllm:num_requests_waiting" in monitor.scrape_errors["e"]
    assert await monitor.check_health(record) and record.healthy  # (a failed scrape ejects nothing)
    engine.no_load_gauges = False
    assert await monitor.scrape_once(record) and record.state is not None and record.state.num_running == 3


async def test_what_an_engine_reports_past_any_bound_is_published_bounded_and_an_odd_label_is_skipped(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """The engine gauges were set from the report as it came (dashboards showed -5 running and a
    KV use of 7), and a cache-info label of odd digits failed the whole scrape, for good: the
    engine's load went stale."""
    monitor, _, record = make_monitor(engine, session)
    engine.running = -5
    engine.extra_metrics = (
        "vllm:kv_cache_usage_perc 7\n"
        f'vllm:cache_config_info{{block_size="\u00b9\u2076",num_gpu_blocks="{"9" * 5000}"}} 1\n'
    )
    await monitor.check_once(record)
    assert await monitor.scrape_once(record)
    assert _reported_running() == 0.0
    assert metrics.REGISTRY.get_sample_value("slogate_engine_kv_usage", {"engine": "e"}) == 1.0
    assert record.state is not None and record.state.block_size is None


async def test_an_engine_flipped_away_from_its_launch_role_is_told_it_again_before_it_returns(
    session: aiohttp.ClientSession,
) -> None:
    """A restart puts an engine back in its launch role: a simulated engine flipped to prefill came
    back a decode engine and was re-admitted as a prefill one (every P/D request sent there
    waited out its KV handover and failed). Told its role before it is re-admitted; not
    re-admitted while that fails."""
    from policies.api import Role

    config = EngineConfig.model_validate(
        {"url": "http://127.0.0.1:9", "kind": "sim", "model": "m", "name": "e", "role": "decode"}
    )
    fleet = Fleet([adapter_for(config, session, 1.0, scrape_timeout_s=0.3)], 5.0)
    record = fleet.records["e"]
    fleet.set_role("e", Role.PREFILL)  # (flipped, then it restarted: ejected meanwhile)
    told: list[Role] = []
    refuse = True

    async def health() -> bool:
        return True

    async def switch_role(role: Role) -> None:
        told.append(role)
        if refuse:
            raise aiohttp.ClientConnectionError("not yet")

    record.adapter.health = health  # type: ignore[method-assign]
    record.adapter.switch_role = switch_role  # type: ignore[method-assign]
    monitor = FleetMonitor(fleet, 0.05, 1, 1, scrape_timeout_s=0.3)
    assert not record.healthy
    assert not await monitor.check_health(record) and not record.healthy
    refuse = False
    assert await monitor.check_health(record) and record.healthy
    assert told == [Role.PREFILL, Role.PREFILL]
    await monitor.check_health(record)  # (healthy: not told again on every check)
    assert len(told) == 2


async def test_an_engine_that_refuses_the_gateway_s_key_is_out_of_rotation_until_it_takes_it(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """vLLM's --api-key guards /v1/* and not /health: with the key configured for it wrong or
    rotated, the engine stayed healthy, refused every request placed there at once, looked the
    least loaded, and drew the most."""
    config = EngineConfig.model_validate({"url": engine.url, "kind": "vllm", "model": "m", "name": "e"})
    fleet = Fleet([adapter_for(config, session, 1.0, scrape_timeout_s=0.3)], 0.3)
    monitor, record = FleetMonitor(fleet, 0.05, 1, 1, scrape_timeout_s=0.3), fleet.records["e"]
    engine.models = ["m"]
    await monitor.check_once(record)
    assert record.healthy and record.unlisted == ""
    for status in (401, 403):
        engine.models_status = status
        await monitor.check_once(record)
        assert not record.healthy and "credentials" in record.unlisted and str(status) in record.unlisted
        assert not await monitor.check_health(record)  # (its health route alone does not bring it back)
    engine.models_status = 200
    await monitor.check_once(record)
    await monitor.check_once(record)
    assert record.healthy and record.unlisted == ""
