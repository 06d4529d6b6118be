"""Outlier ejection against real servers: an engine whose health route answers while every
completion fails (a 500) is no longer the least loaded engine every request tries first. Its
failures are retried on another engine, and after ``outlier_consecutive_failures`` of them in a
row it is out of rotation for ``outlier_ejection_s``, then on probation (one more failure: out
again, for twice as long). Never the last engine of a pool, nor more than its share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.procs import ChildProcess
from gateway.serving.call import ClientGone
from gateway.serving.outliers import raised_verdict, verdict
from gateway.serving.stream_state import Cut
from policies.migration import MigrationReason
from tests.gateway.conftest import MODEL, BrokenEngine, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.test_timeouts import QUIET_MONITOR, metric

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OUTLIERS: dict[str, Any] = {
    **QUIET_MONITOR,
    "outlier_consecutive_failures": 3,
    "outlier_ejection_s": 1.0,
    "outlier_max_ejection_s": 5.0,
}


def broken_entry(engine: BrokenEngine, name: str) -> dict[str, object]:
    # (kind vllm: its health route answers, its completions fail)
    return {"url": engine.url, "kind": "vllm", "model": MODEL, "name": name}


@pytest.fixture()
def broken_and_good(two_engines: list[ChildProcess]) -> Iterator[tuple[BrokenEngine, RunningGateway]]:
    with (
        BrokenEngine(500) as broken,
        run_gateway(engines=[engine_entry(two_engines[0]), broken_entry(broken, "broken")], **OUTLIERS) as gw,
    ):
        yield broken, gw


def ejected(gw: RunningGateway, name: str) -> bool:
    return bool({e["id"]: e for e in httpx.get(gw.url + "/admin/engines").json()["engines"]}[name]["ejected"])


def test_a_failing_engine_is_retried_around_then_taken_out_then_on_probation(
    broken_and_good: tuple[BrokenEngine, RunningGateway],
) -> None:
    broken, gw = broken_and_good
    for _ in range(10):
        answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert answer.status_code == 200, answer.text  # (its 500s retried on the other engine)
    # least load sent every request there first until the third failure in a row took it out
    assert len(broken.received) == 3
    assert metric(gw, "slogate_engine_ejections_total", engine="broken") == 1.0
    assert wait_until(lambda: not ejected(gw, "broken"), 5)
    assert metric(gw, "slogate_engine_ejected", engine="broken") == 0.0
    # back on probation: its next failure takes it out again at once, for twice as long
    for _ in range(5):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    out_at = time.monotonic()
    assert len(broken.received) == 4
    assert metric(gw, "slogate_engine_ejections_total", engine="broken") == 2.0
    assert wait_until(lambda: not ejected(gw, "broken"), 10)
    assert time.monotonic() - out_at >= 1.5  # (2 s; a slow machine only makes it later)


def test_never_more_than_half_of_a_pool_and_not_for_what_fails_everywhere(
    two_engines: list[ChildProcess],
) -> None:
    with BrokenEngine(500) as one, BrokenEngine(500) as other:
        engines = [engine_entry(two_engines[0]), broken_entry(one, "one"), broken_entry(other, "other")]
        with run_gateway(engines=engines, **OUTLIERS) as gw:
            for _ in range(12):
                assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
            # both fail every request, served elsewhere: half of three is one, the other stays
            assert sorted([ejected(gw, "one"), ejected(gw, "other")]) == [False, True]
        with run_gateway(engines=[broken_entry(one, "one"), broken_entry(other, "other")], **OUTLIERS) as gw:
            before = metric(gw, "slogate_engine_ejections_total", engine="one")
            for _ in range(12):
                answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
                assert answer.status_code == 500 and answer.json()["error"]["message"] == "engine exploded"
            # (failing on every engine it tries, a request is as likely at fault as they are)
            assert not ejected(gw, "one") and not ejected(gw, "other")
            assert metric(gw, "slogate_engine_ejections_total", engine="one") == before


def test_what_counts_against_an_engine() -> None:
    assert verdict(200) is True and verdict(502) is False and verdict(504) is False
    assert verdict(GatewayError(400, "bad prompt")) is True  # (the engine answered: the client's fault)
    assert verdict(GatewayError(500, "engine exploded")) is False
    assert verdict(GatewayError(502, "cut", code="upstream_failed")) is False
    assert verdict(GatewayError(503, "busy")) is None  # (overloaded: no fault)
    assert verdict(GatewayError(502, "key", code="upstream_auth_failed")) is None
    assert verdict(Cut(MigrationReason.STALL, "e", None)) is False
    assert verdict(Cut(MigrationReason.SLACK, "e", None)) is None
    assert raised_verdict(ClientGone()) is None and raised_verdict(asyncio.CancelledError()) is None
    assert raised_verdict(GatewayError(404, "no such adapter")) is True


def _ejector(engines: int, **params: Any) -> tuple[Any, Any]:
    from gateway.dispatch.offline import offline_fleet
    from gateway.serving.outliers import OutlierEjector
    from policies.outliers import OutlierParams

    fleet = offline_fleet({MODEL: engines})
    return fleet, OutlierEjector(fleet, OutlierParams(**{"consecutive_failures": 3, **params}))


async def test_a_readmission_timer_that_fires_after_the_pool_took_the_engine_back_does_nothing() -> None:
    fleet, ejector = _ejector(3)
    failing = f"{MODEL}-0"
    for _ in range(3):
        ejector._failed(failing)
    assert fleet.records[failing].tripped
    # the others leave: the pool takes it back (it is all there is), and it serves again
    fleet.eject(f"{MODEL}-1", "gone")
    fleet.eject(f"{MODEL}-2", "gone")
    assert not fleet.records[failing].tripped
    fleet.record_health(f"{MODEL}-1", True, 1, 1)
    fleet.record_health(f"{MODEL}-2", True, 1, 1)
    ejector.judge(failing, 200, None)
    ejector._readmit(failing)  # (its timer, late)
    ejector._failed(failing)  # one failure: not on probation, so not out again
    assert not fleet.records[failing].tripped
    ejector.close()


def test_an_ejection_its_pool_undoes_at_once_is_not_counted() -> None:
    fleet, ejector = _ejector(2, max_ejected_share=1.0)
    only = f"{MODEL}-0"
    fleet.set_adapters(only, frozenset({"adapter-x"}))  # (the only engine with it)
    before = metrics.ENGINE_EJECTIONS.labels(only)._value.get()
    for _ in range(6):
        ejector._failed(only)
    assert not fleet.records[only].tripped
    assert metrics.ENGINE_EJECTIONS.labels(only)._value.get() == before and only not in ejector._ejections


async def test_final_failures_in_a_row_count_as_they_come() -> None:
    """A final 500 (no other engine tries the request: a P/D decode stage's) counts as it comes;
    only failures in a row, which any answer clears. Final 502s and 504s are not the engine's
    alone (a shared deadline's timeout, an answer past the gateway's limit, a proxy's)."""
    fleet, ejector = _ejector(3)
    failing = f"{MODEL}-0"
    exploded = GatewayError(500, "engine exploded")
    assert raised_verdict(exploded) is False
    assert raised_verdict(GatewayError(504, "late", code="upstream_timeout")) is None
    assert raised_verdict(GatewayError(502, "too big", code="upstream_too_large")) is None
    assert raised_verdict(GatewayError(503, "short", code="gateway_overloaded")) is None
    assert raised_verdict(GatewayError(503, "busy")) is None  # (overloaded: no fault)
    for _ in range(2):
        ejector.judge_raised(failing, exploded)
    ejector.judge(failing, 200, None)  # (an answer: the two were not in a row with the next)
    for _ in range(2):
        ejector.judge_raised(failing, exploded)
        assert not fleet.records[failing].tripped
    ejector.judge_raised(failing, exploded)
    assert fleet.records[failing].tripped
    ejector.close()
