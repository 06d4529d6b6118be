"""A bug in the gateway (an exception nothing expected) still answers an OpenAI-shaped 500, and a
client that takes not even that answer does not hold the handler (or what it keeps) forever."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

import gateway.api.proxy as proxy_module
from gateway.api.proxy import Proxy
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, completion_body

CHAT = "/v1/chat/completions"


def _requests_5xx(gw: RunningGateway) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith("slogate_requests_total{") and 'status="5xx"' in line:
            total += float(line.split()[-1])
    return total


def _buggy(monkeypatch: pytest.MonkeyPatch, when: Any) -> None:
    real = Proxy._serve

    async def serve(self: Proxy, call: Any, receive: Any) -> int:
        if when(call):
            raise RuntimeError("a bug")
        return await real(self, call, receive)

    monkeypatch.setattr(Proxy, "_serve", serve)


def test_a_bug_answers_an_openai_shaped_500(monkeypatch: pytest.MonkeyPatch) -> None:
    _buggy(monkeypatch, lambda call: True)

    async def never(_: StubEngine, request: web.Request) -> web.StreamResponse:
        raise AssertionError("not reached")

    with StubEngine(never) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
        assert response.status_code == 500
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "internal_error"
        assert "a bug" not in response.text  # (the traceback goes to the log, not the client)


def test_a_client_taking_nothing_does_not_hold_a_500_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 500 waits behind a large unread answer on the same (pipelined) connection: its send
    is bounded like every other error answer's, so the handler ends and is counted."""
    monkeypatch.setattr(proxy_module, "_ERROR_SEND_S", 0.5)
    _buggy(monkeypatch, lambda call: call.request.stream)
    big = completion_body("a" * (16 << 20))

    async def answer(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(body=big, content_type="application/json")

    with StubEngine(answer) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        before = _requests_5xx(gw)
        host, port = gw.url.removeprefix("http://").split(":")

        def request(stream: bool) -> bytes:
            body = orjson.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            )
            head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % (
                CHAT.encode(),
                host.encode(),
            )
            return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)

        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect((host, int(port)))
            client.sendall(request(False) + request(True))
            assert wait_until(lambda: _requests_5xx(gw) - before == 1, timeout=5.0), (
                "the handler of a 500 nobody reads never ended"
            )
