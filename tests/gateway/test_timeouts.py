"""Every upstream timeout, and a client that stops reading, against real servers on 127.0.0.1.

One fault per test: an address that accepts no connection (connect), a pool with one connection
held by a stream (pool wait), an engine that never sends headers (headers, and the whole of a
non-streamed request, never retried), a hung simulated engine (first token), an engine that
stalls after one event (idle), a retry chain bounded by the request deadline, an engine that
closes keep-alive connections as they are reused (stale connection retry), and a reader that
stops reading (slow client). Timeouts are small; lower bounds are tight (a limit must not fire
early), upper bounds loose (two shared cores).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.vllm import parse_vllm_metrics
from gateway.procs import ChildProcess, spawn_sim_engine
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import (
    Blackhole,
    StaleKeepAliveEngine,
    StubEngine,
    chunk_event,
    completion_body,
    events_every,
    never_answer,
    one_event_then_stall,
    status_after,
)
from tests.support.local_app import serving

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
#: how much later than its limit a timeout may fire on a loaded two-core machine
SLACK_S = 2.0
#: how much earlier than its limit a timeout may seem to fire (clocks, the client's own latency)
EARLY_S = 0.05
#: a monitor that checks once at start-up and then stays out of the way
QUIET_MONITOR: dict[str, Any] = {"monitor_interval_s": 60.0, "health_timeout_s": 1.0}


def chat(stream: bool = False, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream, **extra}


def metric(gw: RunningGateway, name: str, **labels: str) -> float:
    """One sample of the gateway's ``/metrics`` (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def engine_health(gw: RunningGateway) -> dict[str, bool]:
    return {e["id"]: e["healthy"] for e in httpx.get(gw.url + "/admin/engines").json()["engines"]}


def in_flight(gw: RunningGateway, name: str) -> int:
    fleet = gw.gateway.fleet
    assert fleet is not None
    return fleet.records[name].in_flight


def running_on(engine: ChildProcess) -> int:
    return parse_vllm_metrics(httpx.get(engine.url + "/metrics").text).num_running


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    return error


def sse_error(content: bytes) -> dict[str, Any]:
    """The error event that ended a started stream (which must then end with ``[DONE]``)."""
    assert content.endswith(b"data: [DONE]\n\n"), content[-300:]
    for event in content.split(b"\n\n"):
        if event.startswith(b'data: {"error"'):
            error: dict[str, Any] = orjson.loads(event[6:])["error"]
            return error
    raise AssertionError(f"no error event in {content[-300:]!r}")


def timed_post(gw: RunningGateway, body: dict[str, Any], **kwargs: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(gw.url + CHAT, json=body, timeout=30, **kwargs)
    return response, time.monotonic() - started


def assert_fired_after(elapsed: float, limit: float, latest: float | None = None) -> None:
    """``elapsed`` is a timeout of ``limit`` firing: not early, not much late."""
    latest = limit + SLACK_S if latest is None else latest
    assert limit - EARLY_S <= elapsed <= latest, f"fired after {elapsed:.3f} s, limit {limit} s"


@pytest.fixture()
def sim_engine() -> Iterator[ChildProcess]:
    with spawn_sim_engine(*SIM_ARGS, name="sim") as engine:
        yield engine


# -- 1. connecting ------------------------------------------------------------------------------


def test_connect_timeout_fails_fast_with_504() -> None:
    """An engine address that stops accepting connections: each request fails with an
    OpenAI-shaped 504 once ``connect_timeout_s`` has passed, instead of hanging on the SYN
    retries (the kernel would keep trying for about two minutes)."""
    connect_s = 0.5
    with (
        Blackhole() as hole,
        run_gateway(engines=[hole.entry("hole")], connect_timeout_s=connect_s, **QUIET_MONITOR) as gw,
    ):
        assert engine_health(gw) == {"hole": True}
        hole.freeze()
        for stream in (False, True):
            response, elapsed = timed_post(gw, chat(stream=stream))
            error = assert_openai_error(response, 504, "upstream_timeout")
            assert error["type"] == "timeout_error"
            assert "connect" in error["message"]
            assert_fired_after(elapsed, connect_s)
        assert in_flight(gw, "hole") == 0


def test_connect_timeout_fails_over_to_another_engine() -> None:
    """A connect timeout is the one timeout that may be retried elsewhere: the request never
    reached the engine. With a healthy second engine the client gets its answer after
    ``connect_timeout_s``; the silent engine stays in rotation (the monitor judges it)."""
    connect_s = 0.5
    with (
        Blackhole() as hole,
        StubEngine(events_every(0.0, 2)) as ok,
        run_gateway(
            engines=[hole.entry("a-hole"), ok.entry("b-ok")],
            routing_profile="round-robin",  # engine-id order: "a-hole" first
            connect_timeout_s=connect_s,
            **QUIET_MONITOR,
        ) as gw,
    ):
        hole.freeze()
        response, elapsed = timed_post(gw, chat(stream=True))
        assert response.status_code == 200, response.text
        assert response.headers["x-slogate-engine"] == "b-ok"
        assert response.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in response.content
        assert_fired_after(elapsed, connect_s)
        assert len(ok.received) == 1
        assert engine_health(gw) == {"a-hole": True, "b-ok": True}


# -- 2. waiting for a pooled connection --------------------------------------------------------


def test_pool_wait_times_out_and_leaves_the_holder_alone(sim_engine: ChildProcess) -> None:
    """One upstream connection in all, held by a long stream: another request waits for it no
    longer than the pool limit (aiohttp bounds the wait and the connect together, so up to
    ``pool_timeout_s + connect_timeout_s``), gets a 504, and the stream keeps flowing."""
    pool_s, connect_s = 1.0, 0.3
    settings: dict[str, Any] = {
        **QUIET_MONITOR,
        "upstream_pool_size": 1,
        "pool_timeout_s": pool_s,
        "connect_timeout_s": connect_s,
    }
    with run_gateway(engines=[engine_entry(sim_engine)], **settings) as gw:
        long = chat(stream=True, max_tokens=5000, ignore_eos=True)
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", gw.url + CHAT, json=long) as stream,
        ):
            assert stream.status_code == 200
            chunks = stream.iter_bytes()
            seen = 0
            while seen < 3:
                seen += next(chunks).count(b"data: ")
            response, elapsed = timed_post(gw, chat())
            error = assert_openai_error(response, 504, "upstream_timeout")
            assert_fired_after(elapsed, pool_s, latest=pool_s + connect_s + SLACK_S)
            assert "in time" in error["message"]
            # the holder never noticed: it goes on streaming content, no error event
            more = b""
            while more.count(b"data: ") < 20:
                more += next(chunks)
            assert b'"error"' not in more and b"[DONE]" not in more
            assert running_on(sim_engine) == 1
        # the stream is closed: the connection goes back, the next request gets it
        assert wait_until(lambda: in_flight(gw, "sim") == 0 and running_on(sim_engine) == 0)
        response, _ = timed_post(gw, chat())
        assert response.status_code == 200, response.text


# -- 3. response headers, and the whole non-streamed request -----------------------------------


def test_headers_timeout_is_504_and_never_retried() -> None:
    """Two engines that take requests and never answer. A stream gets a 504 after
    ``headers_timeout_s``, a non-streamed request after ``request_timeout_s``; neither is tried on
    the other engine (each request reached exactly one) and the non-streamed one is not tried
    ``dispatch_attempts`` times over (1 s, not 3 s). The engine's request is closed (aborted)."""
    headers_s, request_s = 0.5, 1.0
    settings: dict[str, Any] = {
        **QUIET_MONITOR,
        "headers_timeout_s": headers_s,
        "first_token_timeout_s": 30.0,
        "request_timeout_s": request_s,
        "dispatch_attempts": 3,
    }
    with (
        StubEngine(never_answer) as a,
        StubEngine(never_answer) as b,
        run_gateway(engines=[a.entry("a"), b.entry("b")], **settings) as gw,
    ):
        assert engine_health(gw) == {"a": True, "b": True}
        for n, (stream, limit) in enumerate(((True, headers_s), (False, request_s)), start=1):
            response, elapsed = timed_post(gw, chat(stream=stream))
            error = assert_openai_error(response, 504, "upstream_timeout")
            assert error["type"] == "timeout_error"
            assert_fired_after(elapsed, limit, latest=limit + 1.5)
            assert len(a.received) + len(b.received) == n, (a.received, b.received)
            # the gateway hung up on the engine: its request is aborted, not left running
            assert wait_until(lambda: a.aborted + b.aborted == len(a.received) + len(b.received))
        assert in_flight(gw, "a") == in_flight(gw, "b") == 0
        assert engine_health(gw) == {"a": True, "b": True}  # slow is not dead: nothing ejected


# -- 4. first token ----------------------------------------------------------------------------


def test_first_token_timeout_ends_the_stream_with_an_error_event(sim_engine: ChildProcess) -> None:
    """A simulated engine that takes the request and never produces a token: the client gets its
    headers at once, then, after ``first_token_timeout_s`` (not the shorter idle limit, which is
    for gaps after the first event), an ``upstream_timeout`` error event and ``[DONE]``."""
    first_token_s, idle_s = 1.0, 0.3
    settings: dict[str, Any] = {
        **QUIET_MONITOR,
        "first_token_timeout_s": first_token_s,
        "idle_timeout_s": idle_s,
        "forward_sim_headers": True,
    }
    with run_gateway(engines=[engine_entry(sim_engine)], **settings) as gw:
        started = time.monotonic()
        with (
            httpx.Client(timeout=10) as http,
            http.stream(
                "POST", gw.url + CHAT, json=chat(stream=True, max_tokens=20), headers={"X-Sim-Fault": "hang"}
            ) as stream,
        ):
            headers_after = time.monotonic() - started
            assert stream.status_code == 200
            assert stream.headers["content-type"] == "text/event-stream"
            content = stream.read()
        elapsed = time.monotonic() - started
        assert headers_after < first_token_s - 0.3, headers_after  # headers first, well before
        error = sse_error(content)
        assert error["code"] == "upstream_timeout" and "no first token" in error["message"], error
        assert_fired_after(elapsed, first_token_s)
        assert wait_until(lambda: running_on(sim_engine) == 0 and in_flight(gw, "sim") == 0)


# -- 5. silence between events -----------------------------------------------------------------


def test_idle_timeout_is_armed_from_the_first_event() -> None:
    """An engine that sends one event and then nothing: the stream ends with an
    ``upstream_timeout`` event ``idle_timeout_s`` after that event, not after the (long)
    first-token limit; the engine's request is closed."""
    idle_s = 0.5
    settings: dict[str, Any] = {**QUIET_MONITOR, "first_token_timeout_s": 30.0, "idle_timeout_s": idle_s}
    with (
        StubEngine(one_event_then_stall) as engine,
        run_gateway(engines=[engine.entry("stall")], **settings) as gw,
    ):
        started = time.monotonic()
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", gw.url + CHAT, json=chat(stream=True)) as stream,
        ):
            assert stream.status_code == 200
            chunks = stream.iter_bytes()
            content = next(chunks)
            first_at = time.monotonic()
            assert b'"content":"first"' in content
            content += b"".join(chunks)
        ended_at = time.monotonic()
        error = sse_error(content)
        assert error["code"] == "upstream_timeout" and "stalled between events" in error["message"], error
        assert_fired_after(ended_at - first_at, idle_s)
        assert ended_at - started < 5.0
        assert wait_until(lambda: engine.aborted == 1)
        assert in_flight(gw, "stall") == 0


def test_a_steady_stream_outlives_the_first_token_limit() -> None:
    """Once the first event is in, only gaps count: events every 0.3 s for ~2.4 s pass a
    first-token limit of 0.6 s and an idle limit of 1 s untouched."""
    settings: dict[str, Any] = {**QUIET_MONITOR, "first_token_timeout_s": 0.6, "idle_timeout_s": 1.0}
    with (
        StubEngine(events_every(0.3, 9)) as engine,
        run_gateway(engines=[engine.entry("steady")], **settings) as gw,
    ):
        response, elapsed = timed_post(gw, chat(stream=True))
        assert response.status_code == 200
        assert b'"error"' not in response.content, response.content[-300:]
        assert response.content.count(b'"content":"t') == 9
        assert response.content.endswith(b"data: [DONE]\n\n")
        assert elapsed >= 2.4 - EARLY_S


def test_a_sub_quarter_second_idle_limit_allows_busy_streams() -> None:
    """Events every 50 ms never leave a 200 ms gap, so a 0.2 s idle limit must not fire."""
    settings: dict[str, Any] = {**QUIET_MONITOR, "first_token_timeout_s": 5.0, "idle_timeout_s": 0.2}
    with (
        StubEngine(events_every(0.05, 20)) as engine,
        run_gateway(engines=[engine.entry("busy")], **settings) as gw,
    ):
        response, _ = timed_post(gw, chat(stream=True))
        assert response.status_code == 200
        assert b'"error"' not in response.content, response.content[-300:]
        assert response.content.count(b'"content":"t') == 20


# -- 6. the whole non-streamed request, across retries -----------------------------------------


@pytest.mark.parametrize("first_dies", [True, False], ids=["dead-port-then-hang", "slow-503-then-hang"])
def test_request_timeout_bounds_every_attempt_together(first_dies: bool) -> None:
    """A non-streamed request whose first engine fails in a retryable way and whose second engine
    hangs. The first engine either died since its last health check (its port refuses: it is
    ejected) or answers 503 after 0.7 s. The retry gets what is left of ``request_timeout_s`` from
    arrival, not a fresh limit: the 504 comes at ~1 s, not 1.7 s."""
    request_s, first_takes_s = 1.0, 0.7
    settings: dict[str, Any] = {
        **QUIET_MONITOR,
        # round robin in engine-id order: "a-first" is tried first, "b-hang" second
        "routing_profile": "round-robin",
        "request_timeout_s": request_s,
        "dispatch_attempts": 3,
    }
    with (
        StubEngine(never_answer) as hang,
        StubEngine(status_after(503, first_takes_s)) as first,
        run_gateway(engines=[first.entry("a-first"), hang.entry("b-hang")], **settings) as gw,
    ):
        assert engine_health(gw) == {"a-first": True, "b-hang": True}
        if first_dies:
            first.stop()
        response, elapsed = timed_post(gw, chat())
        assert_openai_error(response, 504, "upstream_timeout")
        # not early, and the shared deadline: never the 1.7 s of a fresh limit per attempt
        assert_fired_after(elapsed, request_s, latest=request_s + first_takes_s - 0.2)
        assert len(first.received) == (0 if first_dies else 1)
        assert len(hang.received) == 1
        assert engine_health(gw) == {"a-first": not first_dies, "b-hang": True}
        assert in_flight(gw, "a-first") == in_flight(gw, "b-hang") == 0


# -- 7. stale keep-alive connections -----------------------------------------------------------


def test_stale_keepalive_connection_is_retried_on_a_fresh_one() -> None:
    """An engine that closes each keep-alive connection as it is reused: every request still
    succeeds (one retry on a new connection each), the engine stays in rotation, and each retry is
    counted as ``slogate_upstream_retries_total{reason="stale_connection"}``."""
    with (
        StaleKeepAliveEngine() as engine,
        run_gateway(engines=[engine.entry("closer")], **QUIET_MONITOR) as gw,
    ):
        assert engine_health(gw) == {"closer": True}
        name = "slogate_upstream_retries_total"
        stale_before = metric(gw, name, reason="stale_connection")
        cut_before = metric(gw, name, reason="cut")
        rounds = 6
        for i in range(rounds):
            stream = bool(i % 2)
            response, _ = timed_post(gw, chat(stream=stream))
            assert response.status_code == 200, response.text
            if stream:
                assert response.content.endswith(b"data: [DONE]\n\n") and b'"error"' not in response.content
            else:
                assert response.json()["choices"][0]["message"]["content"] == "hello"
        # the monitor's reads leave pooled connections the engine will close at reuse; a request
        # that meets one is retried once, on a connection of its own (never another pooled one)
        assert engine.closed_at_reuse >= rounds // 2
        assert metric(gw, name, reason="stale_connection") - stale_before == engine.closed_at_reuse
        assert metric(gw, name, reason="cut") == cut_before
        assert engine_health(gw) == {"closer": True}
        assert in_flight(gw, "closer") == 0


# -- 8. a client that stops reading ------------------------------------------------------------


def test_slow_reader_is_cut_and_frees_the_engine() -> None:
    """A client asks for a long, fast stream and stops reading after the headers (small receive
    buffer, never calls recv). Once the socket buffers between them are full the relay blocks in
    send, and the idle limit ends the stream: the engine's requests are aborted, the gateway's
    in-flight count drops to 0, ``slogate_slow_clients_total`` counts it, the connection is
    closed. What the client can still read is only what the socket buffers held (nothing piles up
    in the gateway), and never ``[DONE]``.

    ``n=4`` choices at 100x simulated speed: ~5 MB/s of events, so the ~3-4 MB of kernel buffers
    fill in under a second while generating the whole answer would take ~4.5 s.
    """
    idle_s, max_tokens, choices = 1.0, 30000, 4
    settings: dict[str, Any] = {**QUIET_MONITOR, "idle_timeout_s": idle_s, "first_token_timeout_s": 10.0}
    fast = ("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "100")
    with (
        spawn_sim_engine(*fast, name="fast") as sim,
        run_gateway(engines=[engine_entry(sim)], **settings) as gw,
    ):
        slow_before = metric(gw, "slogate_slow_clients_total")
        host, port = gw.url.removeprefix("http://").split(":")
        body = orjson.dumps(
            chat(stream=True, max_tokens=max_tokens, ignore_eos=True, n=choices, temperature=1.0)
        )
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect((host, int(port)))
            client.sendall(
                b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), host.encode(), len(body), body)
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += client.recv(256)
            stalled_at = time.monotonic()
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert running_on(sim) == choices
            freed = wait_until(
                lambda: running_on(sim) == 0 and in_flight(gw, "fast") == 0, timeout=idle_s + 6, interval=0.05
            )
            freed_after = time.monotonic() - stalled_at
            assert freed, "the stalled stream still holds the engine"
            assert freed_after >= idle_s - EARLY_S, freed_after
            assert metric(gw, "slogate_slow_clients_total") - slow_before == 1
            # reading now: the bytes the buffers held, then the end of the connection
            client.settimeout(5)
            buffered = head
            while chunk := client.recv(1 << 20):
                buffered += chunk
    assert b"[DONE]" not in buffered
    assert 0 < buffered.count(b"data: ") < max_tokens * choices
    assert len(buffered) < _max_send_buffer() + (1 << 20), len(buffered)
    print(f"slow reader freed after {freed_after:.2f} s; {len(buffered) / 1e6:.1f} MB were buffered")


def test_a_stream_behind_an_unread_answer_on_the_same_connection_is_cut_at_its_headers() -> None:
    """HTTP/1.1 pipelining: a large plain answer the client does not read, then a stream on the
    same connection. The plain answer fits in the transport's buffer, so the stream is placed and
    its engine answers, but even the stream's headers wait for the socket to drain: unbounded,
    that wait held the engine reservation for as long as the client kept the connection open."""
    idle_s = 0.5
    big = completion_body("a" * (16 << 20))

    async def behaviour(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        if not engine.received[-1].get("stream"):
            return web.Response(body=big, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk_event("t0 ") + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    settings: dict[str, Any] = {**QUIET_MONITOR, "idle_timeout_s": idle_s, "first_token_timeout_s": 30.0}
    with StubEngine(behaviour) as engine, run_gateway(engines=[engine.entry("e0")], **settings) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        slow_before = metric(gw, "slogate_slow_clients_total")

        def request(stream: bool) -> bytes:
            body = orjson.dumps(chat(stream=stream))
            return b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % (
                CHAT.encode(),
                host.encode(),
            ) + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect((host, int(port)))
            client.sendall(request(False) + request(True))
            assert wait_until(lambda: len(engine.received) == 2, timeout=10), "the stream never started"
            freed = wait_until(lambda: in_flight(gw, "e0") == 0, timeout=idle_s + SLACK_S + 2)
            assert freed, "a client reading nothing holds the stream's engine reservation"
            assert metric(gw, "slogate_slow_clients_total") - slow_before >= 1


def _max_send_buffer() -> int:
    """The most the kernel may buffer on the gateway's side of a TCP connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/admin/engines/e0/role"])
def test_a_body_that_stops_arriving_gets_a_408_at_the_body_timeout(
    sim_engine: ChildProcess, path: str
) -> None:
    """A client that declares a body and stops sending it held its handler and connection for
    good: nothing bounded the body read (the admin role route's neither, after the data routes')."""
    settings = {"body_timeout_s": 0.5, "admin_api_keys": ["sk-admin"], **QUIET_MONITOR}
    with run_gateway(engines=[engine_entry(sim_engine, name="e0")], **settings) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.socket() as client:
            client.settimeout(10)
            client.connect((host, int(port)))
            client.sendall(
                b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" % path.encode()
                + b"Authorization: Bearer sk-admin\r\n"
                + b'Content-Length: 100\r\n\r\n{"model":'
            )
            started = time.monotonic()
            answer = b""
            while chunk := client.recv(65536):  # to the end: the gateway closes the connection
                answer += chunk
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"code":"request_timeout"' in answer and 0.4 < waited < 8, (answer, waited)


def _upload_head(path: str, length: int | None, close: bool = False) -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    closing = b"Connection: close\r\n" if close else b""
    return b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s%s\r\n" % (
        path.encode(),
        closing,
        framing,
    )


def _response_of(client: socket.socket) -> bytes:
    """One response with a Content-Length body (what error answers have), the connection kept."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += client.recv(65536)
    head, _, rest = answer.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line[15:]) for line in lines if line.startswith(b"content-length:"))
    while len(rest) < length:
        rest += client.recv(65536)
    return head + b"\r\n\r\n" + rest


def _answer_of(client: socket.socket) -> bytes:
    answer = b""
    while chunk := client.recv(65536):  # to the end: the gateway closes the connection
        answer += chunk
    return answer


def test_bodies_held_at_once_are_bounded_and_ordinary_requests_still_get_through(
    sim_engine: ChildProcess,
) -> None:
    """max_body_bytes bounded one body and nothing bounded how many: a few hundred slow 16 MB
    uploads took gigabytes. Past max_body_memory_bytes a large body gets a 503 (one whose
    declared length would not fit: at once; a chunked one: as it passes the bound), while small
    requests keep their quarter; a head declaring a large body and sending nothing holds nothing."""
    settings = {
        **QUIET_MONITOR,
        "max_body_bytes": 150_000,
        "max_body_memory_bytes": 200_000,  # (large bodies may hold 150,000 of it)
        "body_timeout_s": 30.0,
    }
    with run_gateway(engines=[engine_entry(sim_engine, name="e0")], **settings) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        # (the registry is the process's: earlier gateways in it may have counted refusals)
        refusals = metric(gw, "slogate_body_budget_refusals_total")
        # (bulk the engine does not count as prompt tokens: its context is small)
        body = orjson.dumps({**chat(), "user": "x" * 149_000})
        assert len(body) <= 150_000
        with (
            socket.create_connection((host, int(port)), timeout=20) as silent,
            socket.create_connection((host, int(port)), timeout=20) as holder,
        ):
            silent.sendall(_upload_head(CHAT, len(body)))  # declared, nothing sent: nothing held
            # a large upload that has sent all but the end of its body holds what it sent
            holder.sendall(_upload_head(CHAT, len(body), close=True) + body[:-10])
            assert wait_until(lambda: metric(gw, "slogate_request_body_bytes") == len(body) - 10, timeout=10)
            with socket.create_connection((host, int(port)), timeout=20) as declared:
                # refused without waiting for the body it declared; the connection stays usable
                declared.sendall(_upload_head(CHAT, 100_000))
                answer = _response_of(declared).lower()
                assert answer.startswith(b"http/1.1 503") and b'"code":"server_busy"' in answer, answer
                assert b"\r\nretry-after: 1\r\n" in answer and b"\r\nconnection: close" not in answer
            with socket.create_connection((host, int(port)), timeout=20) as chunked:
                # chunked (no length declared): refused once what arrived passes the bound
                chunked.sendall(_upload_head(CHAT, None) + b"%x\r\n%s\r\n" % (70_000, b" " * 70_000))
                answer = _response_of(chunked)
            assert answer.startswith(b"HTTP/1.1 503") and b'"code":"server_busy"' in answer, answer
            # an ordinary request still gets through beside the upload
            assert httpx.post(gw.url + CHAT, json=chat(), timeout=20).status_code == 200
            holder.sendall(body[-10:])
            answer = _answer_of(holder)
            assert answer.startswith(b"HTTP/1.1 200"), answer
        assert wait_until(lambda: metric(gw, "slogate_request_body_bytes") == 0, timeout=10)
        assert metric(gw, "slogate_body_budget_refusals_total") - refusals == 2
        # and the upload that was refused is served once the budget has room
        assert httpx.post(gw.url + CHAT, content=body, timeout=20).status_code == 200
        assert wait_until(lambda: metric(gw, "slogate_request_body_bytes") == 0, timeout=10)


def test_a_plain_request_that_waited_its_whole_time_in_the_queue_never_reaches_an_engine() -> None:
    """Queued behind a stream past request_timeout_s, it was still sent: the engine did the work
    and was blamed for a 504 "did not answer in time" that was the queue's."""
    import asyncio
    import threading

    from tests.gateway.stub_engines import StubEngine, chunk_event, completion_body

    async def behaviour(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        if engine.received[-1].get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(12):
                await response.write(chunk_event("t", i))
                await asyncio.sleep(0.1)
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.Response(body=completion_body("ok"), content_type="application/json")

    settings = {**QUIET_MONITOR, "max_engine_load": 1, "request_timeout_s": 0.6}
    with StubEngine(behaviour) as engine, run_gateway(engines=[engine.entry("e")], **settings) as gw:
        holder = threading.Thread(
            target=httpx.post, args=(gw.url + CHAT,), kwargs={"json": chat(stream=True), "timeout": 20}
        )
        holder.start()
        assert wait_until(lambda: gw.gateway.fleet.records["e"].in_flight == 1, timeout=10)
        started = time.monotonic()
        response = httpx.post(gw.url + CHAT, json=chat(), timeout=20)
        waited = time.monotonic() - started
        holder.join()
        assert response.status_code == 504, (waited, len(engine.received))
        assert response.json()["error"]["code"] == "request_timeout"
        assert len(engine.received) == 1  # the stream only
        assert metric(gw, "slogate_upstream_errors_total", engine="e", kind="timeout") == 0.0


# -- one timer per request ----------------------------------------------------------------------


def test_a_served_request_makes_no_timer_per_limit(
    sim_engine: ChildProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits a request passes through (its body, the engine's headers, its answer or events,
    each send to the client) share the handler task's one timer (gateway.serving.watchdog):
    asyncio.timeout made and cancelled a loop timer for each, about 8 µs apiece. Counted here: the
    asyncio.timeout / timeout_at calls gateway code makes while plain and streamed requests are
    served (aiohttp's own are not the gateway's)."""
    import asyncio
    import sys

    made: dict[str, int] = {}
    real_timeout, real_timeout_at = asyncio.timeout, asyncio.timeout_at

    def counted(real: Any) -> Any:
        def make(when: float | None) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("gateway."):
                made[caller] = made.get(caller, 0) + 1
            return real(when)

        return make

    with run_gateway(engines=[engine_entry(sim_engine)], **QUIET_MONITOR) as gw:
        for stream in (False, True):  # (a first request of each kind before counting)
            assert httpx.post(gw.url + CHAT, json=chat(stream=stream), timeout=30).status_code == 200
        monkeypatch.setattr(asyncio, "timeout", counted(real_timeout))
        monkeypatch.setattr(asyncio, "timeout_at", counted(real_timeout_at))
        for _ in range(5):
            for stream in (False, True):
                response = httpx.post(gw.url + CHAT, json=chat(stream=stream), timeout=30)
                assert response.status_code == 200, response.text
        # (and a limit that runs out still answers as before: see the tests above)
    assert made == {}, f"timers made per limit by gateway code: {made}"


def test_a_whole_answer_past_what_the_gateway_holds_is_a_502_and_an_error_body_is_read_in_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-streamed answer (and an error answer) was read whole, bounded by time alone: an
    engine, or a proxy before it, answering without end filled the gateway's memory for up to
    request_timeout_s (900 s), every stream with it. Past MAX_PLAIN_BYTES it is a 502 at once,
    not tried again (another engine would answer the same); of an error answer only the first
    MAX_ERROR_BYTES are read."""
    import asyncio

    from gateway.serving import relay

    monkeypatch.setattr(relay, "MAX_PLAIN_BYTES", 1 << 20)

    let_go: list[str] = []

    async def endless(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"usage": {"x": "')
        try:
            while True:  # (until the gateway lets go)
                await response.write(b"x" * 65536)
                await asyncio.sleep(0)
        except (ConnectionError, asyncio.CancelledError):
            let_go.append("closed")
            raise

    with (
        StubEngine(endless) as a,
        StubEngine(endless) as b,
        run_gateway(engines=[a.entry("a"), b.entry("b")], **QUIET_MONITOR) as gw,
    ):
        response, elapsed = timed_post(gw, chat())
        assert_openai_error(response, 502, "upstream_too_large")
        assert elapsed < 10 and len(a.received) + len(b.received) == 1  # (not tried again)
        assert wait_until(lambda: let_go == ["closed"])  # (the engine's request closed)


async def test_read_up_to_reads_no_more_than_its_limit() -> None:
    from gateway.engines.base import read_up_to

    async def big(_: web.Request) -> web.StreamResponse:
        return web.Response(body=b"e" * 500_000)

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(8):
            await response.write(b"c" * 100_000)
        return response

    app = web.Application()
    app.router.add_get("/big", big)
    app.router.add_get("/chunked", chunked)
    async with serving(app) as port:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for path, size in (("/big", 500_000), ("/chunked", 800_000)):
                async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
                    body, whole = await read_up_to(resp, 65_536)
                    assert len(body) == 65_536 and not whole
                async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
                    body, whole = await read_up_to(resp, 1 << 20)
                    assert len(body) == size and whole
