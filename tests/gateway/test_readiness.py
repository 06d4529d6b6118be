"""``GET /ready``: this process can serve (started, dispatch loop running, at least one model with a
healthy engine), so one dead model never takes every replica out of the Service; ``?all=1`` is the
strict view for alerting (every served model has a healthy engine)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import MODEL, free_port
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.gateway.stub_engines import HeaderEngine


@pytest.fixture()
def engine() -> Iterator[HeaderEngine]:
    with HeaderEngine() as e:
        yield e


def dead(name: str, model: str) -> dict[str, object]:
    """An engine nothing listens for: ejected by the first health checks."""
    return {"url": f"http://127.0.0.1:{free_port()}", "kind": "sim", "model": model, "name": name}


def test_one_dead_model_leaves_the_replica_ready(engine: HeaderEngine) -> None:
    with run_gateway(engines=[engine.entry("e0"), dead("gone", "other")], monitor_interval_s=0.2) as gw:
        assert gw.gateway.fleet is not None
        assert wait_until(
            lambda: gw.gateway.fleet is not None and gw.gateway.fleet.healthy_models() == {MODEL}
        )
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ready", "models": [MODEL, "other"], "unroutable": ["other"]}
        strict = httpx.get(gw.url + "/ready?all=1")
        assert strict.status_code == 503
        assert strict.json()["error"]["message"] == "not ready: no healthy engine for: other"
        # the model that works is still served
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200


def test_every_model_healthy_is_ready_both_ways(engine: HeaderEngine) -> None:
    with run_gateway(engines=[engine.entry("e0")], monitor_interval_s=0.2) as gw:
        for path in ("/ready", "/ready?all=1"):
            r = httpx.get(gw.url + path)
            assert r.status_code == 200 and r.json()["unroutable"] == [], (path, r.text)


def test_no_routable_model_is_not_ready() -> None:
    with run_gateway(engines=[dead("d1", MODEL), dead("d2", "other")], monitor_interval_s=0.2) as gw:
        assert wait_until(lambda: gw.gateway.fleet is not None and not gw.gateway.fleet.healthy_models())
        for path in ("/ready", "/ready?all=1"):
            r = httpx.get(gw.url + path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", path
    with run_gateway(engines=[]) as gw:
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["message"] == "not ready: no engines configured"


def test_a_stopped_dispatch_loop_is_not_ready(engine: HeaderEngine) -> None:
    with run_gateway(engines=[engine.entry("e0")], monitor_interval_s=0.2) as gw:
        assert httpx.get(gw.url + "/ready").status_code == 200
        loop = gw.gateway.dispatch
        assert loop is not None and loop._task is not None
        task = loop._task
        task.get_loop().call_soon_threadsafe(task.cancel)
        assert wait_until(task.done)
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "not ready: the dispatch loop is not running"


def test_with_keys_an_anonymous_probe_learns_readiness_not_model_names(engine: HeaderEngine) -> None:
    """GET /v1/models needs a client key; /ready stays open for probes, so without a key it
    counts the models instead of naming them."""
    entries = [engine.entry("e0"), dead("gone", "secret-model")]
    with run_gateway(engines=entries, monitor_interval_s=0.2, api_keys=["sk-client-1"]) as gw:
        assert gw.gateway.fleet is not None
        assert wait_until(lambda: not gw.gateway.fleet.has_healthy("secret-model"), timeout=10)
        anonymous = httpx.get(gw.url + "/ready")
        assert anonymous.status_code == 200
        assert anonymous.json() == {"status": "ready", "models": 2, "unroutable": 1}
        strict = httpx.get(gw.url + "/ready?all=1")
        assert strict.status_code == 503 and "secret-model" not in strict.text
        assert strict.json()["error"]["message"] == "not ready: no healthy engine for: 1 of 2 models"
        keyed = httpx.get(gw.url + "/ready", headers={"Authorization": "Bearer sk-client-1"})
        assert keyed.json() == {
            "status": "ready",
            "models": [MODEL, "secret-model"],
            "unroutable": ["secret-model"],
        }
