"""Request heads bounded in size and time (gateway/http_head.py), over real sockets.

httptools bounds neither: a 64 MB header was read whole before any key was checked, joining its
pieces cost seconds of event-loop CPU (every stream frozen), and a head trickled in was never
timed out. These tests talk raw HTTP to a real gateway: the ASGI fuzz tests cannot see a head.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
import uvicorn
from aiohttp import web

from gateway.http_head import BODY_HIGH_WATER
from gateway.server import serving_config
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, chunk_event


@pytest.fixture(scope="module")
def gw() -> Iterator[RunningGateway]:
    # (an engine nobody answers at: these requests never get past the front door's checks)
    engines = [{"url": "http://127.0.0.1:9", "kind": "sim", "model": MODEL, "name": "e0"}]
    with run_gateway(
        engines=engines, head_timeout_s=0.5, body_timeout_s=2.0, monitor_interval_s=30
    ) as running:
        # (read as each connection is made: a new connection waits as long as a kept-alive one)
        running.server.config.timeout_keep_alive = 1
        yield running


def _connect(gw: RunningGateway) -> socket.socket:
    port = int(gw.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one answer until the server closes: status, headers, body."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


def test_a_head_past_the_limit_is_refused_with_a_431_as_it_arrives(gw: RunningGateway) -> None:
    """Refused as it arrives (the head never ends), and the answer is read: the connection is
    half-closed after it and what the client still sends is dropped, not reset."""
    with _connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ")
        for _ in range(50):  # 200 KB of one header value, 4 KB at a time
            sock.sendall(b"k" * 4096)
        status, fields, body = _answer(sock)
    assert status == 431 and fields["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "request_header_too_large"


def test_a_trailer_past_the_limit_is_refused_too(gw: RunningGateway) -> None:
    """A chunked body's trailer fields are parsed as a head's are (and were joined piece by
    piece all the same), after the head was judged."""
    with _connect(gw) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: "
        )
        for _ in range(50):
            sock.sendall(b"t" * 4096)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert b"HTTP/1.1 431 " in data and b"request_header_too_large" in data


def test_a_connection_that_sends_nothing_is_closed(gw: RunningGateway) -> None:
    with _connect(gw) as sock:
        started = time.monotonic()
        sock.sendall(b"\r\n")  # (a stray line end is no request: nothing to answer)
        assert sock.recv(65536) == b""
    assert 0.8 <= time.monotonic() - started < 6.0  # (the kept-alive wait, 1 s, not the head's)


def test_a_431_names_the_limit_and_the_server_goes_on(gw: RunningGateway) -> None:
    with _connect(gw) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n")
        status, fields, body = _answer(sock)
    assert status == 431 and fields["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_header_too_large" and "65536 bytes" in error["message"]
    assert error["type"] == "invalid_request_error"  # (the client's to fix, not the server's)
    assert httpx.get(gw.url + "/health").status_code == 200


def test_a_head_trickling_in_is_refused_with_a_408(gw: RunningGateway) -> None:
    with _connect(gw) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # (its first byte: 0.5 s)
        sock.sendall(b"X-Slow: 1\r\n")  # ...and the rest never comes
        status, _, body = _answer(sock)
    assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"
    assert 0.4 <= time.monotonic() - started < 5.0


def test_heads_under_the_limit_and_large_bodies_are_not_counted_as_heads(gw: RunningGateway) -> None:
    """A 60 KB header is within the limit; a 2 MB body sent with its head in the same reads, and a
    second request on the same connection, are bodies and a next head, not one long head."""
    body = orjson.dumps({"model": "not-served", "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"X-Pad: " + b"p" * (60 * 1024) + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with _connect(gw) as sock:
        sock.sendall(head + body + head + body)  # two requests, one write: keep-alive
        data = b""
        while data.count(b"model_not_found") < 2 and (chunk := sock.recv(65536)):
            data += chunk
    # both answered by the front door itself (a model it does not serve), neither refused as a head
    assert data.count(b"HTTP/1.1 404 ") == 2, data[:300]
    assert b"model_not_found" in data and b"request_header_too_large" not in data


def test_what_follows_a_refused_head_in_the_same_read_is_dropped_quietly(
    gw: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A head refused as it ended, and in the same read a line the parser cannot read: uvicorn
    answered that with a 400 on the half-closed connection, which raised ("Cannot call write()
    after write_eof()") and logged a fatal transport error with its traceback."""
    with _connect(gw) as sock:
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n"
        sock.sendall(head + b"GARBAGE\x01 / HTTP/1.1\r\n\r\n")
        status, _, body = _answer(sock)
    assert status == 431 and orjson.loads(body)["error"]["code"] == "request_header_too_large"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_head_refused_while_a_pipelined_answer_streams_ends_the_connection() -> None:
    """A client pipelines a streamed request and, behind it, a head past the limit. A 431 written
    into the stream under way would interleave with it: the connection ends at once instead, the
    engine's request is aborted, and the server goes on."""

    async def slow_stream(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(50):  # 10 s if nothing ends it
            await response.write(chunk_event(f"t{i} ", i))
            await asyncio.sleep(0.2)
        await response.write(b"data: [DONE]\n\n")
        return response

    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    with StubEngine(slow_stream) as engine, run_gateway(engines=[engine.entry("e0")]) as running:
        with _connect(running) as sock:
            sock.sendall(first)
            data = sock.recv(65536)
            while b"t0 " not in data:  # the first answer is streaming
                data += sock.recv(65536)
            started = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            try:
                for _ in range(20):  # 80 KB of one header value, past the limit as it arrives
                    sock.sendall(b"b" * 4096)
                while chunk := sock.recv(65536):
                    data += chunk
            except (ConnectionResetError, BrokenPipeError):
                # (ended while the client was still sending: on a loaded machine the server's
                # close can come before the rest of the head, and the kernel resets)
                pass
        assert time.monotonic() - started < 3.0  # ended at the refusal, not after the stream's 10 s
        assert data.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 431" not in data
        assert b"[DONE]" not in data
        assert wait_until(lambda: engine.aborted == 1, timeout=5)
        assert httpx.get(running.url + "/health").status_code == 200


class _BodyRecorder:
    """An ASGI app that waits before it reads a request's body, then answers with the size of each
    body message it got: how much the protocol buffered while nobody read."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    async def __call__(self, scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        assert callable(receive) and callable(send)
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asyncio.sleep(self.wait_s)
        sizes = []
        while True:
            message = await receive()
            sizes.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                break
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(sizes)})


@pytest.fixture(scope="module")
def recorder_url() -> Iterator[str]:
    server = uvicorn.Server(serving_config(_BodyRecorder(0.3), "127.0.0.1", 0))
    thread = threading.Thread(target=server.run, name="recorder", daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=15)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


def test_a_body_under_the_high_water_is_read_whole_while_the_app_is_busy(recorder_url: str) -> None:
    """uvicorn paused reading at 64 KiB until the app asked: a 900 KB prompt came in rounds of a
    pause, a receive and a resume (CPU per large request). Here it is buffered whole."""
    body = b"x" * 900_000
    sizes = httpx.post(recorder_url, content=body, timeout=10).json()
    assert sizes == [len(body)]


def test_a_body_past_the_high_water_still_pauses_reading(recorder_url: str) -> None:
    """What one connection buffers stays bounded: past BODY_HIGH_WATER reading pauses until the
    app takes what came, and the body arrives whole over several messages."""
    body = b"y" * (3 * BODY_HIGH_WATER)
    sizes = httpx.post(recorder_url, content=body, timeout=10).json()
    assert sum(sizes) == len(body)
    assert sizes[0] < len(body) and max(sizes) <= BODY_HIGH_WATER + 1024 * 1024


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x01b\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["control-byte", "length-past-64-bits", "not-http"],
)
def test_what_is_not_http_gets_an_openai_shaped_400(gw: RunningGateway, head: bytes) -> None:
    """uvicorn answers a request httptools cannot parse with a plain-text 400."""
    with _connect(gw) as sock:
        sock.sendall(head)
        status, fields, body = _answer(sock)
    assert status == 400 and fields["connection"] == "close" and fields["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http"
    assert httpx.get(gw.url + "/health").status_code == 200  # (and the server goes on)


@contextlib.contextmanager
def _uvicorn_warnings() -> Iterator[list[str]]:
    """What uvicorn's error logger says meanwhile (it does not propagate to the root logger)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("uvicorn.error")
    keep = Keep()
    logger.addHandler(keep)
    try:
        yield seen
    finally:
        logger.removeHandler(keep)


def test_what_is_not_http_is_logged_once_a_minute_not_once_a_request(gw: RunningGateway) -> None:
    """uvicorn warns of every such request: a client sending garbage flooded the log, a line
    each. Held back past the first, counted in the next one that goes out."""
    with _uvicorn_warnings() as seen:
        for _ in range(5):
            with _connect(gw) as sock:
                sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                assert _answer(sock)[0] == 400
    assert sum("Invalid HTTP request" in m for m in seen) <= 1, seen


def test_an_upgrade_to_what_is_not_served_is_logged_once_a_minute_not_once_a_request(
    gw: RunningGateway,
) -> None:
    """uvicorn warns of each (an h2c upgrade, say): the same flood as garbage, by a valid request."""
    with _uvicorn_warnings() as seen:
        for _ in range(5):
            with _connect(gw) as sock:
                sock.sendall(
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
                )
                assert _one_answer(sock)[0] == 200
    assert any("Unsupported upgrade" in m for m in seen), seen  # (uvicorn still says so, once)
    assert sum("Unsupported upgrade" in m for m in seen) == 1, seen


def test_a_repeated_message_goes_out_once_an_interval_with_the_count_held_back() -> None:
    import logging

    from gateway.logs import Repeated

    repeated = Repeated("same", every_s=3600.0)
    records = [
        logging.LogRecord("x", logging.WARNING, "", 0, msg, (), None)
        for msg in ("same", "other", "same", "same")
    ]
    assert [repeated.filter(r) for r in records] == [True, True, False, False]
    repeated._last -= 3600.0
    later = logging.LogRecord("x", logging.WARNING, "", 0, "same", (), None)
    assert repeated.filter(later) and later.getMessage() == "same (2 more since the last said so)"


def _one_answer(sock: socket.socket) -> tuple[int, bytes]:
    """Read one answer (by its length) from a connection that stays open: status, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed within an answer"
        body += chunk
    return int(head.split()[1]), body


def test_a_body_still_arriving_after_its_answer_must_end_within_the_body_time(gw: RunningGateway) -> None:
    """Answered before its body was read (here a 405), a request's body bytes are dropped as
    they come; uvicorn stops its keep-alive timer at any byte, so a client that sent one more
    and then nothing held the connection (and a file descriptor) for good, without a key."""
    with _connect(gw) as sock:
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n")
        status, _ = _one_answer(sock)
        assert status == 405
        started = time.monotonic()
        sock.sendall(b"{")  # ...and nothing more
        assert sock.recv(65536) == b""
    assert 1.8 <= time.monotonic() - started < 6.0  # (the body's time, 2 s)
    # a body that does arrive whole after its answer leaves the connection serving the next
    # request, and idle, it is closed as a kept-alive one is (1 s here)
    with _connect(gw) as sock:
        for _ in range(2):
            sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\n")
            assert _one_answer(sock)[0] == 405
            sock.sendall(b"{}{}")
            time.sleep(0.7)  # (past the head's time: no timer of the body's left running)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _one_answer(sock)[0] == 200
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\n")
        assert _one_answer(sock)[0] == 405
        started = time.monotonic()
        sock.sendall(b"{}{}")
        assert sock.recv(65536) == b""
    assert 0.8 <= time.monotonic() - started < 6.0


def test_a_request_after_an_early_answered_body_in_the_same_read_is_not_cut_by_keep_alive(
    gw: RunningGateway,
) -> None:
    """The end of an early-answered body arms the kept-alive connection's timer; the next
    request in the same read (a loaded loop, pipelining) began without anything cancelling it,
    and the timer closed that request's connection in the middle of it."""
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    with _connect(gw) as sock:
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\n")
        assert _one_answer(sock)[0] == 405
        next_head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        )
        sock.sendall(b"{}{}" + next_head + b"Content-Length: %d\r\n\r\n" % len(chat))
        time.sleep(1.5)  # (past the kept-alive wait, 1 s: the request is still arriving)
        sock.sendall(chat)
        status, body = _one_answer(sock)
    assert status in (400, 404, 503), body  # (answered: its engine is nowhere; not cut)


def test_a_client_that_pipelines_a_request_and_leaves_is_a_disconnect_not_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvicorn's current request is the newest: a client that pipelined a second request behind
    a stream and closed its socket was never heard to leave by the stream's request, which went
    on writing to a closed transport (uvloop: RuntimeError, read as a 500 and logged with a
    traceback) with its engine's request running until then."""
    from gateway import metrics
    from tests.gateway.stub_engines import events_every

    caplog.set_level(logging.ERROR, logger="slogate")
    chat = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    request = head + b"Content-Length: %d\r\n\r\n" % len(chat) + chat
    with (
        StubEngine(events_every(0.2, 100)) as engine,
        run_gateway(engines=[engine.entry("e0")], monitor_interval_s=30) as gw,
    ):
        before = metrics.CLIENT_DISCONNECTS._value.get()
        with _connect(gw) as sock:
            sock.sendall(request + request)  # (the second pipelined behind the first, at once)
            first = sock.recv(65536)
            assert first.startswith(b"HTTP/1.1 200"), first
        # (closed: the stream's request hears it, and its engine's request is aborted)
        assert wait_until(lambda: engine.aborted == 1, timeout=5)
        assert wait_until(lambda: metrics.CLIENT_DISCONNECTS._value.get() > before, timeout=5)
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.getMessage() == "internal error"], caplog.text
    assert len(engine.received) == 1  # (the second never started: its client had left)
