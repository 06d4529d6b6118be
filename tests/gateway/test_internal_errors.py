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


def test_a_failure_recording_the_decision_gives_the_engine_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug after the placement and before the engine is called (recording the decision) is a
    500 like any other, and the seat the placement reserved is released with it."""
    from gateway.serving.collocated import CollocatedFlow

    real = CollocatedFlow._decided

    def decided(self: CollocatedFlow, call: Any, attempt: int, *args: Any) -> None:
        real(self, call, attempt, *args)
        if args[3] is not None:  # (an engine was placed)
            raise RuntimeError("a bug")

    monkeypatch.setattr(CollocatedFlow, "_decided", decided)

    async def answer(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(body=completion_body("x"), content_type="application/json")

    with StubEngine(answer) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(3):
            response = httpx.post(gw.url + CHAT, json=body, timeout=10)
            assert response.status_code == 500
        record = gw.gateway.fleet.records["e0"]
        assert wait_until(lambda: record.in_flight == 0 and not record.running, timeout=5), record.running


def test_a_failure_recording_the_decision_does_not_fail_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """What only observes a request (the dashboard's decision log, its spans) must not fail it."""
    from gateway.dashboard.decisions import DecisionLog

    def add(self: DecisionLog, *args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(DecisionLog, "add", add)

    async def answer(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(body=completion_body("x"), content_type="application/json")

    with StubEngine(answer) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        assert gw.gateway.decisions is not None
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
        assert response.status_code == 200, response.text
        record = gw.gateway.fleet.records["e0"]
        assert wait_until(lambda: record.in_flight == 0 and not record.running, timeout=5)


def test_an_engine_refusing_the_gateway_s_key_is_no_client_authentication_error() -> None:
    """An engine's 401 (the key configured for it is wrong or was rotated there) reached the
    client as its own authentication_error: the SDK gave up on a key that was fine. Now another
    engine takes the request, and with none left it is a 502 naming the engine's refusal."""

    async def refuse(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "Unauthorized"}, status=401)

    async def answer(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(body=completion_body("x"), content_type="application/json")

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with StubEngine(refuse) as wrong, StubEngine(answer) as right:
        with run_gateway(engines=[wrong.entry("e0"), right.entry("e1")]) as gw:
            for _ in range(4):
                response = httpx.post(gw.url + CHAT, json=body, timeout=10)
                assert response.status_code == 200, response.text
        with run_gateway(engines=[wrong.entry("e0")]) as gw:
            response = httpx.post(gw.url + CHAT, json=body, timeout=10)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["code"] == "upstream_auth_failed" and error["type"] != "authentication_error"


def test_a_streamed_request_answered_whole_is_not_generated_again_elsewhere() -> None:
    """An engine that ignores stream: true answers with the whole completion, generated: taken
    as an engine's failure, the same request went to the next engine, which generated it again,
    up to every attempt, and the client got a 502 all the same."""
    posts = {"n": 0}

    async def whole(_: StubEngine, request: web.Request) -> web.StreamResponse:
        posts["n"] += 1
        return web.Response(body=completion_body("all of it"), content_type="application/json")

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with (
        StubEngine(whole) as a,
        StubEngine(whole) as b,
        run_gateway(engines=[a.entry("e0"), b.entry("e1")]) as gw,
    ):
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
    assert response.status_code == 502 and "without a stream" in response.json()["error"]["message"]
    assert posts["n"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_html_page_is_no_completion(stream: bool) -> None:
    """A 200 page (a proxy's sign-in or maintenance page in front of an engine) was relayed as a
    200 completion of HTML, or as a stream of it cut at blank lines: another engine takes the
    request, and with none left it is a 502."""

    async def page(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html><body>\n\nsign in</body></html>", content_type="text/html")

    async def answer(_: StubEngine, request: web.Request) -> web.StreamResponse:
        if stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(
                b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'
            )
            return response
        return web.Response(body=completion_body("x"), content_type="application/json")

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }
    with StubEngine(page) as proxy, StubEngine(answer) as right:
        with run_gateway(engines=[proxy.entry("e0"), right.entry("e1")]) as gw:
            for _ in range(4):
                response = httpx.post(gw.url + CHAT, json=body, timeout=10)
                assert response.status_code == 200 and "sign in" not in response.text, response.text
                assert ("[DONE]" in response.text) is stream and '"error"' not in response.text
        with run_gateway(engines=[proxy.entry("e0")]) as gw:
            response = httpx.post(gw.url + CHAT, json=body, timeout=10)
            assert response.status_code == 502 and "HTML page" in response.json()["error"]["message"]


def test_a_proxy_s_502_page_is_not_the_error_s_message() -> None:
    """A proxy in front of an engine answered 502 with its HTML page, which reached the client as
    the error's message. Not tried on another engine: behind a proxy a 502 may come after the
    engine did the work (it died mid-answer), and another gateway as the engine answers 502 so."""
    posts = {"n": 0}

    async def bad_gateway(_: StubEngine, request: web.Request) -> web.StreamResponse:
        posts["n"] += 1
        page = "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
        return web.Response(status=502, text=page, content_type="text/html")

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with (
        StubEngine(bad_gateway) as a,
        StubEngine(bad_gateway) as b,
        run_gateway(engines=[a.entry("e0"), b.entry("e1")]) as gw,
    ):
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
    assert response.status_code == 502 and "<html" not in response.text
    assert "HTML page" in response.json()["error"]["message"] and posts["n"] == 1


def test_a_streamed_request_refused_with_an_error_object_under_a_200_goes_to_another_engine() -> None:
    """An error object under a 200 (as some servers and proxies send) is no answer generated:
    another engine may take the request, as before a whole answer was told apart from it."""

    async def refuse(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "overloaded", "type": "server_error"}})

    async def stream(_: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n')
        return response

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with (
        StubEngine(refuse) as busy,
        StubEngine(stream) as right,
        run_gateway(engines=[busy.entry("e0"), right.entry("e1")]) as gw,
    ):
        for _ in range(4):
            response = httpx.post(gw.url + CHAT, json=body, timeout=10)
            assert response.status_code == 200 and "[DONE]" in response.text, response.text
