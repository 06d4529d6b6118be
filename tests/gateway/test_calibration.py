"""Calibration against a real simulated engine process: probes seed the engine's latency model,
are never client traffic, and give way to client requests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway import metrics
from gateway.dispatch.slo_service import SloService
from gateway.engines import adapter_for
from gateway.fleet.calibration import PREFILL_REPEATS, PROMPT_TOKENS, Calibrator, Interrupted, _prompt_tokens
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.settings import load_settings
from gateway.sim.profiles import load_profile
from policies.api import Role
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.support.local_app import serving
from tests.support.sim_process import SimProcess, start_sim_engine

MODEL = "m"
#: the engine runs at half its profile's speed; the gateway's prior is the profile: 2x too fast
SPEED = 0.5
TRUTH = load_profile("qwen-7b").latency


@pytest.fixture(scope="module")
def engine() -> Iterator[SimProcess]:
    with start_sim_engine("--profile", "qwen-7b", "--model", MODEL, "--time-scale", str(SPEED)) as proc:
        yield proc


async def setup(engine: SimProcess, session: aiohttp.ClientSession) -> tuple[Fleet, SloService, Calibrator]:
    settings = load_settings(
        None,
        engines=[
            {"url": engine.url, "kind": "sim", "model": MODEL, "name": "e0", "latency_profile": "qwen-7b"}
        ],
    )
    fleet = Fleet([adapter_for(e, session, 2.0) for e in settings.engines], settings.stale_after_s)
    fleet.record_health("e0", True, 1, 1)
    slo = SloService(settings)
    slo.attach(fleet, time.monotonic, settings.latency_step_gap_s)
    return fleet, slo, Calibrator(fleet, slo.latency, session, interval_s=600.0, check_every_s=0.05)


def slo_requests() -> float:
    return sum(
        s.value
        for family in metrics.REGISTRY.collect()
        if family.name == "slogate_slo_requests"
        for s in family.samples
        if s.name.endswith("_total")
    )


def probes(outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "slogate_calibration_probes_total", {"engine": "e0", "outcome": outcome}
    )
    return value or 0.0


@pytest.mark.alone  # (probes time the engine's steps)
async def test_calibration_sets_the_coefficients_within_20_percent(engine: SimProcess) -> None:
    async with aiohttp.ClientSession() as session:
        fleet, slo, calibrator = await setup(engine, session)
        before_slo, before_ok = slo_requests(), probes("ok")
        assert slo.coefficients("e0") == (TRUTH.prefill, TRUTH.decode)  # the prior: 2x the speed
        added = await calibrator.calibrate(fleet.records["e0"])
        prefill, decode = slo.coefficients("e0")
        # the engine's truth: every step takes 1/SPEED of the profile's time
        a, b = (TRUTH.prefill_a / SPEED, TRUTH.prefill_b / SPEED)
        assert prefill[0] == pytest.approx(a, rel=0.2) and prefill[1] == pytest.approx(b, rel=0.2)
        for prompt in (64, 1024):
            true = a + b * prompt + TRUTH.prefill_c / SPEED * prompt**2
            assert prefill[0] + prefill[1] * prompt + prefill[2] * prompt**2 == pytest.approx(true, rel=0.2)
        assert decode[0] == pytest.approx(TRUTH.decode_a / SPEED, rel=0.2)
        for batch, context in ((1, 100), (4, 400)):
            step = decode[0] + decode[1] * context + decode[2] * batch
            true = (TRUTH.decode_a + TRUTH.decode_b * context + TRUTH.decode_c * batch) / SPEED
            assert step == pytest.approx(true, rel=0.2)
        # probes are not client traffic: nothing counted as SLO traffic, nothing reserved
        assert added >= 16 and probes("ok") - before_ok == len(PROMPT_TOKENS) * PREFILL_REPEATS + 1 + 1 + 4
        assert slo_requests() == before_slo
        assert fleet.records["e0"].in_flight == 0 and not fleet.records["e0"].running


async def test_probes_give_way_to_client_requests(engine: SimProcess) -> None:
    async with aiohttp.ClientSession() as session:
        fleet, slo, calibrator = await setup(engine, session)
        record = fleet.records["e0"]
        fleet.reserve("e0", "client-1", RunningEntry(10, 10, 0.1, time.monotonic()))
        with pytest.raises(Interrupted):  # a client request is on the engine: no probing
            await calibrator.calibrate(record)
        fleet.release("e0", "client-1")
        before = probes("interrupted")
        run = asyncio.create_task(calibrator.calibrate(record))
        await asyncio.sleep(0.3)
        # a client request comes and goes while the engine is being probed
        fleet.reserve("e0", "client-2", RunningEntry(10, 10, 0.1, time.monotonic()))
        fleet.release("e0", "client-2")
        with pytest.raises(Interrupted):
            await run
        assert probes("interrupted") == before + 1
        assert slo.latency.sample_counts("e0") == (0, 0)  # its timings were not used
        assert slo.coefficients("e0") == (TRUTH.prefill, TRUTH.decode)


async def test_the_calibration_task_probes_a_joining_engine_once_and_stops(engine: SimProcess) -> None:
    async with aiohttp.ClientSession() as session:
        _, slo, calibrator = await setup(engine, session)
        calibrator.start()
        task = calibrator._task
        try:
            deadline = time.monotonic() + 30
            while not calibrator.done and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert list(calibrator.done) == ["e0"]
            await asyncio.sleep(0.3)
            assert list(calibrator.done) == ["e0"]  # not again before calibration_interval_s
        finally:
            await calibrator.stop()
        assert task is not None and task.cancelled()  # (stop() clears _task whatever happened)
        assert slo.coefficients("e0") != (TRUTH.prefill, TRUTH.decode)


async def test_a_run_interrupted_by_client_traffic_is_not_begun_again_at_every_idle_moment(
    engine: SimProcess,
) -> None:
    """Under load, each brief idle moment began a run that the next request interrupted: probes
    sent for nothing up to once a second, for as long as the load lasted."""
    async with aiohttp.ClientSession() as session:
        _, _, calibrator = await setup(engine, session)
        calibrator.check_every_s = 0.01
        runs = 0

        async def interrupted(record: object) -> int:
            nonlocal runs
            runs += 1
            raise Interrupted()

        calibrator.calibrate = interrupted  # type: ignore[method-assign,assignment]
        calibrator.start()
        try:
            await asyncio.sleep(0.5)
        finally:
            await calibrator.stop()
        assert runs == 1
        assert calibrator.due["e0"] > time.monotonic() + 3  # tried again after a wait


@pytest.mark.alone  # (probes time the engine's steps)
def test_a_gateway_with_calibration_probes_its_engine_and_stops_it_with_itself(engine: SimProcess) -> None:
    entry = {"url": engine.url, "kind": "sim", "model": MODEL, "name": "e0", "latency_profile": "qwen-7b"}
    with run_gateway(engines=[entry], calibration=True) as gw:
        calibrator = gw.gateway.calibrator
        assert calibrator is not None
        assert wait_until(lambda: list(calibrator.done) == ["e0"], timeout=30)
        prefill, _ = gw.gateway.slo.coefficients("e0")
        assert prefill[1] == pytest.approx(TRUTH.prefill_b / SPEED, rel=0.2)
    assert calibrator._task is None  # stopped with the gateway
    with run_gateway(engines=[entry]) as gw:
        assert gw.gateway.calibrator is None  # off unless asked for


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"usage":{"prompt_tokens":120,"completion_tokens":1}}', 120),
        # what the engine computed: cached tokens cost no prefill
        (b'{"usage":{"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":96}}}', 24),
        (b'{"usage":{"prompt_tokens":120,"prompt_tokens_details":null}}', 120),
        (b'{"usage":null}', None),
        (b"not json", None),
    ],
)
def test_probe_lengths_are_what_the_engine_computed(body: bytes, expected: int | None) -> None:
    assert _prompt_tokens(body, 120) == expected


@pytest.mark.parametrize(
    ("usage", "counted"),
    [
        ({"prompt_tokens": 100}, 100),
        ({"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 20}}, 100),
        ({"prompt_tokens": True}, None),  # (a bool is an int in Python)
        ({"prompt_tokens": 2**64 - 1}, None),  # one such sample crushed the fitted slope 28x
        ({"prompt_tokens": 3}, None),
        ({"prompt_tokens": "100"}, None),
    ],
)
def test_an_engines_count_of_a_probe_is_believed_only_near_the_gateways(
    usage: dict[str, object], counted: int | None
) -> None:
    from gateway.fleet.calibration import _prompt_tokens

    assert _prompt_tokens(orjson.dumps({"usage": usage}), 100) == counted


async def test_a_drain_interrupts_a_calibration_run(engine: SimProcess) -> None:
    """A role flip's drain ended at once (probes hold no reservation) and the run went on
    probing an engine that had changed role meanwhile."""
    async with aiohttp.ClientSession() as session:
        fleet, _, calibrator = await setup(engine, session)
        record = fleet.records["e0"]
        fleet.set_draining("e0", True)
        try:
            with pytest.raises(Interrupted):
                await calibrator.calibrate(record)
        finally:
            fleet.set_draining("e0", False)


async def test_a_probe_of_an_engine_streaming_without_end_fails_bounded() -> None:
    """A probe stream read every event (and an event without end whole) into memory for as long
    as the probe's timeout; an ejected engine's run went on, each probe waiting out its timeout
    while every other engine waited for its turn."""
    from aiohttp import web

    from gateway.fleet.calibration import MAX_EVENT_BYTES, MAX_STREAM_EVENTS, _Stream

    mode = {"one_event": False, "sent": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = b"x" * 65536 if mode["one_event"] else b'data: {"choices":[{"text":"a"}]}\n\n'
        with contextlib.suppress(ConnectionError):
            while True:  # (until the prober lets go)
                await response.write(chunk)
                mode["sent"] += len(chunk)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as port, aiohttp.ClientSession() as session:
        engines = [{"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": "e0"}]
        settings = load_settings(None, engines=engines)
        fleet = Fleet([adapter_for(e, session, 2.0) for e in settings.engines], settings.stale_after_s)
        fleet.record_health("e0", True, 1, 1)
        calibrator = Calibrator(fleet, SloService(settings).latency, session, interval_s=600.0)
        record = fleet.records["e0"]
        stream = _Stream(16)
        async with asyncio.timeout(10):
            assert not await calibrator._stream(record, stream)
        assert len(stream.times) <= MAX_STREAM_EVENTS
        mode["one_event"], mode["sent"] = True, 0
        async with asyncio.timeout(10):
            assert not await calibrator._stream(record, _Stream(16))
        assert MAX_EVENT_BYTES < mode["sent"] < 64 * MAX_EVENT_BYTES
        fleet.record_health("e0", False, 1, 1)  # ejected: the run stops at its next probe
        with pytest.raises(Interrupted):
            await calibrator.calibrate(record)


async def test_a_flip_made_between_two_probes_interrupts_the_run(engine: SimProcess) -> None:
    """A flip drains past the probes (they hold no reservation) and may be over before the next
    probe looks: the run went on measuring the engine across its flip, then in its new role."""
    async with aiohttp.ClientSession() as session:
        fleet, _, calibrator = await setup(engine, session)
        record = fleet.records["e0"]
        flips = 0
        real = calibrator._prefill

        async def prefill(rec: Any, watch: Any, n: int) -> Any:
            nonlocal flips
            timed = await real(rec, watch, n)
            if not flips:  # after the first probe, what a flip there and back does to the record
                flips += 1
                fleet.set_draining("e0", True)
                fleet.set_role("e0", Role.DECODE)
                fleet.set_role("e0", Role.COLLOCATED)
                fleet.set_draining("e0", False)
            return timed

        calibrator._prefill = prefill  # type: ignore[method-assign]
        with pytest.raises(Interrupted):
            await calibrator.calibrate(record)
        assert flips == 1 and record.adapter.role is Role.COLLOCATED and not record.draining


def test_an_engine_out_of_rotation_for_a_stall_or_failed_requests_is_not_probed() -> None:
    from gateway.dispatch.offline import offline_fleet

    fleet = offline_fleet({"m": 3})
    stalled, tripped, fine = (fleet.records[f"m-{i}"] for i in range(3))
    fleet.set_stalled(stalled.engine_id, True)
    fleet.set_tripped(tripped.engine_id, True)
    assert [Calibrator._idle(r) for r in (stalled, tripped, fine)] == [False, False, True]
