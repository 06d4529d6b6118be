"""A stopping gateway (SIGTERM, Ctrl-C) gives open requests ``shutdown_grace_s``, then ends what is
left with answers that say so: a started stream with an error event and ``[DONE]``, a request not
yet answered with a 503 and Retry-After, and their engine requests aborted. Before, uvicorn waited
for every open stream however long (an engine that never answers: for good), until the platform's
kill cut them all without a word."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, chunk_event, events_every

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _streams_for_long_or_never_answers(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    """A stream: an event every 50 ms for a minute. Anything else: no answer at all."""
    if not engine.received[-1].get("stream"):
        await engine.wait_forever()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(1200):
        await response.write(chunk_event(f"t{i} ", i))
        await asyncio.sleep(0.05)
    await response.write(b"data: [DONE]\n\n")
    return response


class _Stream:
    """A streamed request read on a thread: its data lines, and when the last one came."""

    def __init__(self, gw: RunningGateway) -> None:
        self.lines: list[str] = []
        self.ended_at = 0.0
        self.status = 0
        self.thread = threading.Thread(target=self._read, args=(gw,))
        self.thread.start()

    def _read(self, gw: RunningGateway) -> None:
        body = {**BODY, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])
        self.ended_at = time.monotonic()

    def content_events(self) -> int:
        return sum(1 for line in self.lines if line != "[DONE]" and "choices" in json.loads(line))


def test_what_is_open_when_the_grace_ends_is_ended_with_an_answer_that_says_so() -> None:
    grace = 1.0
    with (
        StubEngine(_streams_for_long_or_never_answers) as engine,
        run_gateway(engines=[engine.entry("stub")], shutdown_grace_s=grace, stall_after_s=0) as gw,
    ):
        stream = _Stream(gw)
        plain: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: plain.append(httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=60))
        )
        waiting.start()
        assert wait_until(lambda: len(engine.received) == 2 and stream.content_events() >= 3, timeout=10)
        stopped_at = time.monotonic()
        gw.server.should_exit = True
        stream.thread.join(10)
        waiting.join(10)
        # the grace was given: the stream went on for it, and was ended soon after
        assert grace <= stream.ended_at - stopped_at < grace + 2.0
        assert stream.content_events() >= 3 + 10
        assert stream.status == 200 and stream.lines[-1] == "[DONE]"
        error = json.loads(stream.lines[-2])["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"]
        # the request that had no answer yet: a 503 a client retries (the OpenAI SDK does)
        assert len(plain) == 1 and plain[0].status_code == 503
        assert plain[0].json()["error"]["code"] == "shutting_down"
        assert plain[0].headers["retry-after"] == "1"
        # both engine requests were aborted, not left running on the engine
        assert wait_until(lambda: engine.aborted == 2, timeout=5), engine.aborted
        assert gw.gateway.fleet is not None
        assert all(r.in_flight == 0 for r in gw.gateway.fleet.records.values())


def test_a_stream_that_ends_within_the_grace_is_not_cut() -> None:
    with (
        StubEngine(events_every(0.05, 30)) as engine,
        run_gateway(engines=[engine.entry("stub")], shutdown_grace_s=10.0) as gw,
    ):
        stream = _Stream(gw)
        assert wait_until(lambda: stream.content_events() >= 2, timeout=10)
        stopped_at = time.monotonic()
        gw.server.should_exit = True
        stream.thread.join(10)
        assert stream.status == 200 and stream.lines[-1] == "[DONE]"
        assert stream.content_events() == 30 and not any('"error"' in line for line in stream.lines)
        assert stream.ended_at - stopped_at < 5.0  # (it ended on its own, long before the grace)
        assert engine.aborted == 0


def test_a_gateway_with_nothing_open_stops_at_once() -> None:
    settings: dict[str, Any] = {"shutdown_grace_s": 30.0}
    with StubEngine(events_every(0.01, 2)) as engine:
        started = time.monotonic()
        with run_gateway(engines=[engine.entry("stub")], **settings) as gw:
            response = httpx.post(gw.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30)
            assert response.status_code == 200
            stopping_at = time.monotonic()
        assert time.monotonic() - stopping_at < 5.0, time.monotonic() - started


def test_a_request_being_ended_is_not_ended_twice() -> None:
    """A second cut (a second Ctrl-C after the grace ran out) while a stream is still writing its
    error event would cancel that write and drop the stream without it."""
    with (
        StubEngine(_streams_for_long_or_never_answers) as engine,
        run_gateway(engines=[engine.entry("stub")], stall_after_s=0) as gw,
    ):
        stream = _Stream(gw)
        assert wait_until(lambda: stream.content_events() >= 2, timeout=10)
        proxy = gw.gateway.proxy
        assert proxy is not None
        ended: list[int] = []
        loop = gw.gateway.dispatch._task.get_loop()  # type: ignore[union-attr]
        loop.call_soon_threadsafe(lambda: ended.extend([proxy.cut_open(), proxy.cut_open()]))
        stream.thread.join(10)
        assert ended == [1, 0]
        assert stream.lines[-1] == "[DONE]" and '"shutting_down"' in stream.lines[-2]
        # and later requests are refused as the gateway stops
        late = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"


def test_a_request_still_arriving_when_the_grace_ends_gets_a_503_not_a_500(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client still uploading its body when the grace runs out is refused then with a 503 that
    says so.
    Before, nothing ended it until uvicorn's backstop, 5 s later, cancelled the handler: uvicorn
    answered a bare 500 and logged 'Exception in ASGI application' with a traceback."""
    grace = 0.5
    with (
        caplog.at_level(logging.ERROR),
        StubEngine(events_every(0.01, 2)) as engine,
        run_gateway(engines=[engine.entry("stub")], shutdown_grace_s=grace, body_timeout_s=60.0) as gw,
    ):
        # (uvicorn's logging config, applied as the server starts, turns it off)
        monkeypatch.setattr(logging.getLogger("uvicorn"), "propagate", True)
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=15) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model": "' + MODEL.encode()
            )
            # (uvicorn runs a task for it: its body is being read)
            assert wait_until(lambda: len(gw.server.server_state.tasks) == 1, timeout=5)
            stopped_at = time.monotonic()
            gw.server.should_exit = True
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
            answered_in = time.monotonic() - stopped_at
            proxy = gw.gateway.proxy
            assert proxy is not None and proxy.open_requests == 0
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n")[1]  # (one chunk)
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert b"retry-after: 1" in head.lower(), head
    assert json.loads(body)["error"]["code"] == "shutting_down"
    assert grace - 0.05 <= answered_in < grace + 3.0  # (at the grace's end, not at the backstop's)
    assert not engine.received  # (it never reached an engine)
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
