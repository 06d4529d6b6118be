"""An engine that answers with bytes that are not HTTP: the client is not given a 500, and another
engine serves the request (nothing had reached the client)."""

from __future__ import annotations

import httpx
from aiohttp import web

from gateway import metrics
from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import MODEL, StubEngine, events_every


async def not_http(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    transport = request.transport
    assert transport is not None
    transport.write(b"NOT HTTP AT ALL\r\nX: \x00\r\n\r\n")
    transport.close()
    await engine.wait_forever()
    return web.Response(status=500)


def test_a_malformed_answer_fails_over_to_another_engine() -> None:
    with StubEngine(not_http) as broken, StubEngine(events_every(0.0, 2)) as good:
        engines = [broken.entry("broken"), good.entry("good")]
        with run_gateway(engines=engines, monitor_interval_s=0.2, dispatch_attempts=2) as gw:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            answers = [httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10) for _ in range(6)]
            assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
            assert all(r.headers["x-slogate-engine"] == "good" for r in answers)
            assert broken.received, "the broken engine was never tried: the test proves nothing"
        with run_gateway(engines=[broken.entry("broken")], monitor_interval_s=0.2) as gw:
            refusals = _no_engine_count()
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"
            # the retry found no other engine: the engine's failure is the answer, and the request
            # was not refused for want of an engine (that attempt's 503 was counted as if it were)
            assert _no_engine_count() == refusals


def _no_engine_count() -> float:
    """``slogate_no_engine_total`` for the stubs' model, in this process's registry."""
    return metrics.REGISTRY.get_sample_value("slogate_no_engine_total", {"model": MODEL}) or 0.0


async def cut_mid_body(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    """A JSON answer whose Content-Length promises more than comes before the engine closes."""
    response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "4000"})
    await response.prepare(request)
    await response.write(b'{"id": "cmpl-1", "object": "chat.completion", ')
    transport = request.transport
    assert transport is not None
    transport.close()
    await engine.wait_forever()
    return response


def test_an_answer_cut_mid_body_is_a_502_with_a_one_line_reason() -> None:
    """A plain answer cut before its end is a 502 naming the engine and what failed in one line
    (never the exception's repr, which for aiohttp's errors may carry the request's headers)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with (
        StubEngine(cut_mid_body) as cut,
        run_gateway(engines=[cut.entry("cut")], monitor_interval_s=30.0, dispatch_attempts=1) as gw,
    ):
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    assert cut.received, "the engine was never asked: the test proves nothing"
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed", r.text
    message = r.json()["error"]["message"]
    # (a repr reads "ClientPayloadError('Response payload...', <ContentLengthError...>)")
    prefix = "engine cut failed mid-response: ClientPayloadError: Response payload is not completed"
    assert message.startswith(prefix) and "\n" not in message, message
