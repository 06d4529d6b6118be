"""Two real gateways sharing a real redis-server count each other's requests on the same engines:
with ``max_engine_load: 1`` and two engines, three requests through two replicas never put two on
one engine, and the one that waits is placed as soon as the other replica's request ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import Gateway
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.gateway.stub_engines import MODEL, HeaderEngine
from tests.support.redis_server import RedisServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def remote(gateway: Gateway) -> dict[str, int]:
    assert gateway.fleet is not None
    return {e: r.remote_in_flight for e, r in gateway.fleet.records.items()}


def test_two_replicas_never_put_two_requests_on_a_one_seat_engine(redis_server: RedisServer) -> None:
    gates = {"x": threading.Event(), "y": threading.Event()}
    statuses: list[int] = []

    def send(url: str) -> threading.Thread:
        def post() -> None:
            statuses.append(httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code)

        thread = threading.Thread(target=post)
        thread.start()
        return thread

    shared: dict[str, Any] = {
        "state_store": "redis",
        "redis_url": redis_server.url,
        "replica_sync_interval_s": 0.05,
        "max_engine_load": 1,
        # (no scrape or health round within the test: only the exchange can tell a replica)
        "monitor_interval_s": 60.0,
    }
    with (
        HeaderEngine(gate=gates["x"]) as x,
        HeaderEngine(gate=gates["y"]) as y,
        run_gateway(engines=[x.entry("x"), y.entry("y")], replica_id="gw-a", **shared) as a,
        run_gateway(engines=[x.entry("x"), y.entry("y")], replica_id="gw-b", **shared) as b,
    ):
        engines = {"x": x, "y": y}
        try:
            threads = [send(a.url)]
            assert wait_until(lambda: len(x.received) + len(y.received) == 1)
            first = "x" if x.received else "y"
            other = "y" if first == "x" else "x"
            assert wait_until(lambda: remote(b.gateway)[first] == 1)
            # replica B has no request of its own: alone, it would take the engine A just filled
            threads.append(send(b.url))
            assert wait_until(lambda: len(engines[other].received) == 1)
            assert len(engines[first].received) == 1
            assert wait_until(lambda: remote(a.gateway)[other] == 1)
            listed = httpx.get(a.url + "/admin/engines").json()["engines"]
            assert {e["id"]: (e["in_flight"], e["other_replicas_in_flight"]) for e in listed} == {
                first: (1, 0),
                other: (0, 1),
            }
            # both engines' one seat taken, each by another replica: the third request waits in B
            threads.append(send(b.url))
            assert not wait_until(lambda: len(x.received) + len(y.received) > 2, timeout=0.5)
            # A's request ends: B hears of it within a round and places the one waiting there
            gates[first].set()
            assert wait_until(lambda: len(engines[first].received) == 2)
            assert len(engines[other].received) == 1
            gates[other].set()
            for thread in threads:
                thread.join(30)
            assert statuses == [200, 200, 200]
            metrics = httpx.get(a.url + "/metrics").text
            assert "slogate_replicas 2.0" in metrics
        finally:
            for gate in gates.values():  # (a failed check must not hold the engines' answers)
                gate.set()


def test_a_gateway_whose_redis_is_down_serves_alone_and_says_so() -> None:
    server = RedisServer()  # (never started: nothing listens on its port)
    with (
        HeaderEngine() as x,
        run_gateway(
            engines=[x.entry("x")],
            state_store="redis",
            redis_url=server.url,
            replica_sync_interval_s=0.05,
            state_store_timeout_s=0.2,
        ) as gw,
    ):
        response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200 and b"[DONE]" in response.content
        assert gw.gateway.replicas is not None
        assert wait_until(lambda: gw.gateway.replicas is not None and gw.gateway.replicas.errors >= 2)
        metrics = httpx.get(gw.url + "/metrics").text
        assert "slogate_state_store_errors_total" in metrics and "slogate_replicas 1.0" in metrics
