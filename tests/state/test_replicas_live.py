"""Two real gateways sharing a real redis-server count each other's requests on the same engines:
with ``max_engine_load: 1`` and two engines, three requests through two replicas never put two on
one engine, and the one that waits is placed as soon as the other replica's request ends."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import metrics
from gateway.app import Gateway
from policies.plugins.affinity import affinity_key
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import MODEL, HeaderEngine
from tests.support.redis_server import RedisServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@contextlib.contextmanager
def two_replicas(
    redis_server: RedisServer, gates: dict[str, threading.Event], **settings: Any
) -> Iterator[tuple[HeaderEngine, HeaderEngine, RunningGateway, RunningGateway]]:
    """Engines ``x`` and ``y`` (each holding its answers until its gate is set) behind replicas
    ``gw-a`` and ``gw-b`` sharing ``redis_server``."""
    shared: dict[str, Any] = {
        "state_store": "redis",
        "redis_url": redis_server.url,
        "replica_sync_interval_s": 0.05,
        # (no scrape or health round within a test: only the exchange can tell a replica)
        "monitor_interval_s": 60.0,
    } | settings
    with (
        HeaderEngine(gate=gates["x"]) as x,
        HeaderEngine(gate=gates["y"]) as y,
        run_gateway(engines=[x.entry("x"), y.entry("y")], replica_id="gw-a", **shared) as a,
        run_gateway(engines=[x.entry("x"), y.entry("y")], replica_id="gw-b", **shared) as b,
    ):
        yield x, y, a, b


def taken() -> float:
    return float(metrics.REPLICA_ROUTES.labels("taken")._value.get())


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

    with two_replicas(redis_server, gates, max_engine_load=1) as (x, y, a, b):
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
            exposed = httpx.get(a.url + "/metrics").text
            assert "slogate_replicas 2.0" in exposed
        finally:
            for gate in gates.values():  # (a failed check must not hold the engines' answers)
                gate.set()


def test_deployments_sharing_one_redis_database_are_kept_apart_by_their_namespace(
    redis_server: RedisServer,
) -> None:
    """Two deployments on one Redis database with the same engine ids (a staging and a production
    release, say) counted each other's requests and took each other's sessions: every key and
    channel began with the same fixed name."""
    gates = {"x": threading.Event(), "y": threading.Event()}
    apart = {"state_namespace": "staging"}
    with (
        two_replicas(redis_server, gates) as (x, _, a, _b),
        run_gateway(
            engines=[x.entry("x")],
            replica_id="other-release",
            state_store="redis",
            redis_url=redis_server.url,
            replica_sync_interval_s=0.05,
            monitor_interval_s=60.0,
            **apart,
        ) as c,
    ):
        try:
            assert c.gateway.replicas is not None and a.gateway.replicas is not None
            assert wait_until(lambda: a.gateway.replicas.peers == ("gw-b",))  # type: ignore[union-attr]
            thread = threading.Thread(
                target=lambda: httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=30)
            )
            thread.start()
            assert wait_until(lambda: len(x.received) == 1)
            time.sleep(0.3)  # (several rounds of the exchange)
            assert remote(a.gateway)["x"] == 0 and c.gateway.replicas.peers == ()  # type: ignore[union-attr]
            assert "other-release" not in a.gateway.replicas.peers  # type: ignore[union-attr]
        finally:
            for gate in gates.values():
                gate.set()
        thread.join(30)


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
        exposed = httpx.get(gw.url + "/metrics").text
        assert "slogate_state_store_errors_total" in exposed and "slogate_replicas 1.0" in exposed


def test_a_sessions_next_turn_through_the_other_replica_goes_to_its_engine(redis_server: RedisServer) -> None:
    """The peers' "replicas split prefix state": the turns of a conversation land on replicas in
    turn; the second, through replica B, must go where the first went through A (its prompt is
    cached there, its session went there), although B alone would pick the other engine: the
    first turn still runs on that one (B counts it through the load exchange)."""
    gates = {"x": threading.Event(), "y": threading.Event()}
    statuses: list[int] = []
    history = [{"role": "user", "content": "Plan a week of meals around lentils and rice. " * 8}]

    def send(url: str, messages: list[dict[str, str]]) -> threading.Thread:
        def post() -> None:
            body = {"model": MODEL, "messages": messages, "stream": True}
            headers = {"x-session-id": "conversation-1"}
            statuses.append(
                httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code
            )

        thread = threading.Thread(target=post)
        thread.start()
        return thread

    with two_replicas(redis_server, gates, routing_profile="prefix-aware") as (x, y, a, b):
        engines = {"x": x, "y": y}
        replicas_b = b.gateway.replicas
        routes_b = b.gateway.prefix
        assert a.gateway.routes is not None and routes_b is not None and routes_b.affinity is not None
        try:
            # (routes are told only to replicas known: wait until A knows B)
            assert wait_until(
                lambda: a.gateway.replicas is not None and a.gateway.replicas.peers == ("gw-b",)
            )
            taken_before = taken()
            threads = [send(a.url, history)]
            assert wait_until(lambda: len(x.received) + len(y.received) == 1)
            first = "x" if x.received else "y"
            other = "y" if first == "x" else "x"
            assert replicas_b is not None and wait_until(lambda: remote(b.gateway)[first] == 1)
            # B hears where the session went (as it routes: by the monotonic clock)
            session = affinity_key("default", "conversation-1")
            assert session is not None
            assert wait_until(
                lambda: (
                    routes_b.affinity is not None
                    and routes_b.affinity.get(session, time.monotonic()) == first
                )
            )
            turn = [
                *history,
                {"role": "assistant", "content": "Monday: dal."},
                {"role": "user", "content": "Tuesday?"},
            ]
            threads.append(send(b.url, turn))
            assert wait_until(lambda: len(x.received) + len(y.received) == 2)
            assert len(engines[first].received) == 2 and len(engines[other].received) == 0
            gates["x"].set()
            gates["y"].set()
            for thread in threads:
                thread.join(30)
            assert statuses == [200, 200]
            # (both gateways run in this process: one registry; A's turn 1 is the route taken)
            assert taken() >= taken_before + 1
        finally:
            for gate in gates.values():
                gate.set()


def test_a_replica_started_after_a_sessions_turn_sends_the_next_one_to_its_engine(
    redis_server: RedisServer,
) -> None:
    """A rolling update: replica A served a conversation's turn and is replaced by B. B knew
    nothing of the session and sent the next turn where load said (its history prefilled again
    on a cold engine); now B reads the sessions A wrote as it starts."""
    gates = {"x": threading.Event(), "y": threading.Event()}
    for gate in gates.values():
        gate.set()
    settings: dict[str, Any] = {
        "state_store": "redis",
        "redis_url": redis_server.url,
        "monitor_interval_s": 60.0,
        "routing_profile": "prefix-aware",
    }
    headers = {"x-session-id": "conversation-2"}
    turn = {"model": MODEL, "messages": [{"role": "user", "content": "Which spices go with dal? " * 8}]}
    with HeaderEngine(gate=gates["x"]) as x, HeaderEngine(gate=gates["y"]) as y:
        engines = {"x": x, "y": y}
        entries = [x.entry("x"), y.entry("y")]
        with run_gateway(engines=entries, replica_id="gw-a", **settings) as a:
            assert httpx.post(a.url + "/v1/chat/completions", json=turn, headers=headers).status_code == 200
        first = "x" if x.received else "y"
        other = "y" if first == "x" else "x"
        threads: list[threading.Thread] = []
        try:
            with run_gateway(engines=entries, replica_id="gw-b", **settings) as b:
                routes_b = b.gateway.prefix
                session = affinity_key("default", "conversation-2")
                assert routes_b is not None and session is not None
                assert wait_until(
                    lambda: (
                        routes_b.affinity is not None
                        and routes_b.affinity.get(session, time.monotonic()) == first
                    )
                )
                # B holds a request of its own on that engine (the other answers at once): by
                # load alone the next turn would go to the other one
                gates[first].clear()
                while len(engines[first].received) < 2:
                    seen = len(engines[first].received) + len(engines[other].received)
                    thread = threading.Thread(
                        target=httpx.post,
                        args=(b.url + "/v1/chat/completions",),
                        kwargs={"json": CHAT, "timeout": 30},
                    )
                    thread.start()
                    threads.append(thread)
                    assert wait_until(
                        lambda seen=seen: len(engines[first].received) + len(engines[other].received) > seen
                    )
                held_other = len(engines[other].received)
                follow = {**turn, "messages": [*turn["messages"], {"role": "assistant", "content": "Cumin."}]}
                sent = threading.Thread(
                    target=httpx.post,
                    args=(b.url + "/v1/chat/completions",),
                    kwargs={"json": follow, "headers": headers, "timeout": 30},
                )
                sent.start()
                threads.append(sent)
                assert wait_until(lambda: len(engines[first].received) == 3)
                assert len(engines[other].received) == held_other
                gates[first].set()
                for thread in threads:
                    thread.join(30)
        finally:
            for gate in gates.values():
                gate.set()


def test_a_stored_response_is_continued_and_kept_its_tenants_through_any_replica(
    redis_server: RedisServer,
) -> None:
    """Replicas share where each stored Responses API answer is: a continuation through the
    other replica goes to the engine that stored it, and another tenant is told it does not
    exist there too (looking on the engines instead, the first to ask would have been let in)."""
    from gateway.procs import spawn_sim_engine
    from tests.gateway.conftest import SIM_ARGS, engine_entry

    keys = {"sk-team-a-0123456789": {"tenant": "a"}, "sk-team-b-0123456789": {"tenant": "b"}}
    shared: dict[str, Any] = {
        "state_store": "redis",
        "redis_url": redis_server.url,
        "replica_sync_interval_s": 0.05,
        "api_keys": list(keys),
        "api_key_policies": keys,
    }
    with (
        spawn_sim_engine(*SIM_ARGS, name="s0") as s0,
        spawn_sim_engine(*SIM_ARGS, name="s1") as s1,
        run_gateway(engines=[engine_entry(s0), engine_entry(s1)], replica_id="gw-a", **shared) as a,
        run_gateway(engines=[engine_entry(s0), engine_entry(s1)], replica_id="gw-b", **shared) as b,
    ):
        team_a = {"authorization": "Bearer sk-team-a-0123456789"}
        team_b = {"authorization": "Bearer sk-team-b-0123456789"}
        ask = {"model": MODEL, "max_output_tokens": 3}
        first = httpx.post(
            a.url + "/v1/responses", json={**ask, "input": "hello"}, headers=team_a, timeout=30
        )
        assert first.status_code == 200, first.text
        home, rid = first.headers["x-slogate-engine"], first.json()["id"]
        first_rid = rid
        proxy_b = b.gateway.proxy
        assert proxy_b is not None and proxy_b.responses.store is not None
        loop_b = b.gateway.dispatch._task.get_loop()  # type: ignore[union-attr]
        key = proxy_b.responses._key_prefix + rid

        def in_store() -> bool:
            assert proxy_b.responses.store is not None
            read = asyncio.run_coroutine_threadsafe(proxy_b.responses.store.get_many([key]), loop_b)
            return read.result(5)[0] is not None

        assert wait_until(in_store, 5)  # (a's write is its own task, after its answer)
        stranger = httpx.post(
            b.url + "/v1/responses",
            json={**ask, "input": "x", "previous_response_id": rid},
            headers=team_b,
            timeout=30,
        )
        assert stranger.status_code == 404, stranger.text
        assert httpx.get(b.url + f"/v1/responses/{rid}", headers=team_b, timeout=30).status_code == 404
        for turn in range(3):
            answer = httpx.post(
                b.url + "/v1/responses",
                json={**ask, "input": f"turn {turn}", "previous_response_id": rid},
                headers=team_a,
                timeout=30,
            )
            assert answer.status_code == 200 and answer.headers["x-slogate-engine"] == home, answer.text
            rid = answer.json()["id"]
        # b took the first answer's home from the store (its conversation's tokens with it), not
        # from asking the engines (which tell only where, not how long)
        known = proxy_b.responses.homes.get(first_rid)
        assert known is not None and known.engine_id == home and known.tokens > 0
