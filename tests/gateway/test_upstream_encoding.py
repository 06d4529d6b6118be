"""Engines' answers come uncompressed: the gateway reads them on the way (usage, [DONE], errors)
and relays their bytes as they are, so it asks for ``identity``. aiohttp offers gzip, deflate and
br by default; an engine behind a compressing proxy then sent gzip that reached the client as
its JSON (the SDK failed to decode it) and a stream the gateway could not read (a 502 event)."""

from __future__ import annotations

import httpx
import orjson
from aiohttp import web

from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import StubEngine, chunk_event, completion_body

CHAT = "/v1/chat/completions"


def test_the_gateway_asks_engines_for_plain_answers_and_relays_them_readable() -> None:
    offered: list[str] = []

    async def compressing(_: StubEngine, request: web.Request) -> web.StreamResponse:
        """As a compressing proxy in front of an engine: gzip whenever the caller accepts it."""
        offered.append(request.headers.get("Accept-Encoding", ""))
        body = await request.json()
        if not body.get("stream"):
            response = web.Response(body=completion_body("plain"), content_type="application/json")
            response.enable_compression()
            return response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        stream.enable_compression()
        await stream.prepare(request)
        await stream.write(chunk_event("plain "))
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    with StubEngine(compressing) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # the client itself accepts gzip: that is between it and the gateway, not the engine
        headers = {"Accept-Encoding": "gzip"}
        plain = httpx.post(gw.url + CHAT, json=body, headers=headers, timeout=10)
        assert plain.status_code == 200
        assert orjson.loads(plain.content)["choices"][0]["message"]["content"] == "plain"
        streamed = httpx.post(gw.url + CHAT, json={**body, "stream": True}, headers=headers, timeout=10)
        assert streamed.status_code == 200
        assert b"plain " in streamed.content and b'"error"' not in streamed.content
        assert streamed.content.endswith(b"data: [DONE]\n\n")
    assert offered and all(value == "identity" for value in offered)


def test_a_stream_answered_with_a_json_body_is_an_error_that_carries_the_engines_words() -> None:
    """Some servers and proxies answer a failed streamed request with a JSON error under a 200:
    the gateway had begun a stream and ended it with "ended before it was complete", losing the
    engine's message. It is now an OpenAI-shaped 502 naming it, before any stream begins, and the
    engine's capacity is released."""
    error = {
        "object": "error",
        "message": "the model is warming up",
        "type": "ServiceUnavailable",
        "code": 503,
    }

    async def json_under_200(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(body=orjson.dumps(error), content_type="application/json")

    with StubEngine(json_under_200) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
        assert response.status_code == 502 and response.headers["content-type"].startswith("application/json")
        assert "the model is warming up" in response.json()["error"]["message"]
        assert response.json()["error"]["code"] == "upstream_failed"
        assert gw.gateway.fleet.records["e0"].in_flight == 0
        # a streamed request the engine answered whole: the same, not a stream cut short
        error.clear()
        error.update(orjson.loads(completion_body("whole")))
        response = httpx.post(gw.url + CHAT, json=body, timeout=10)
        assert response.status_code == 502 and "without a stream" in response.json()["error"]["message"]
